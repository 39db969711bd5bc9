"""`SimOutput`: what a simulation run hands to metrics and output (numpy, after the run).

Per-request arrays are in `RequestSet` row order (injection-time order). Counters are
per instance (shape [I]); a scalar is accepted for a single instance. All times are int64 µs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from blis_jax.errors import ConfigError

# Request status codes (int8). NOT_ARRIVED is 0 so a zero-initialised engine array means
# "not injected yet" (e.g. its arrival lies past the horizon).
NOT_ARRIVED = 0
QUEUED = 1          # in a wait queue when the run stopped (counts in still_queued)
RUNNING = 2         # in a running batch when the run stopped (counts in still_running)
COMPLETED = 3
LENGTH_CAPPED = 4   # force-completed at max_model_len − 1: a completion in every BLIS count
TIMED_OUT = 5       # cancelled at its deadline
DROPPED = 6         # unservable at enqueue (max_model_len / KV capacity guards)
REJECTED = 7        # refused by cluster admission (never reached an instance)

STATUS_NAMES = {NOT_ARRIVED: "not_arrived", QUEUED: "queued", RUNNING: "running",
                COMPLETED: "completed", LENGTH_CAPPED: "length_capped", TIMED_OUT: "timed_out",
                DROPPED: "dropped", REJECTED: "rejected"}

RESULT_OK = 0  # `result` code of a run that finished without a capacity/overflow problem

_PER_REQUEST = {"status": np.int8, "ttft_us": np.int64, "e2e_us": np.int64, "itl_sum_us": np.int64,
                "num_itl": np.int64, "sched_delay_us": np.int64, "output_tokens": np.int64,
                "handled_by": np.int32}
_COUNTERS = ("preemption_count", "kv_hits", "kv_misses", "dropped_unservable", "timed_out",
             "length_capped", "total_input_tokens", "sim_end_us", "still_queued", "still_running",
             "kv_allocation_failures")


def is_completed(status: np.ndarray) -> np.ndarray:
    """Completed in BLIS's sense: normal completion or length-capped force completion."""
    status = np.asarray(status)
    return (status == COMPLETED) | (status == LENGTH_CAPPED)


@dataclasses.dataclass(frozen=True, eq=False)
class SimOutput:
    """Result of one simulation.

    Per request (shape [N]): `status` (codes above); `ttft_us` (-1 if no first token;
    kept for requests that timed out later); `e2e_us` (-1 unless completed); `itl_sum_us`
    and `num_itl` (Σ and count of the request's inter-token gaps, also for timed-out
    requests); `sched_delay_us` (latest admission into a running batch − arrival, -1 if
    never scheduled); `output_tokens` (counted at completion, else 0); `handled_by`
    (instance index, -1 if none).

    `itl_samples` (shape [M]): every ITL sample of completed requests, concatenated in
    request row order, request i contributing its `num_itl[i]` samples — so samples can be
    attributed to requests (per-instance metrics) without another array.

    Per instance (shape [I]): `preemption_count`, `kv_hits`, `kv_misses` (prefix-cache
    blocks), `dropped_unservable`, `timed_out`, `length_capped`, `total_input_tokens`
    (counted at enqueue), `sim_end_us` (min(last event clock, horizon)), `still_queued`,
    `still_running`, `kv_allocation_failures`. `result` is the engine's result code.
    """

    status: np.ndarray
    ttft_us: np.ndarray
    e2e_us: np.ndarray
    itl_sum_us: np.ndarray
    num_itl: np.ndarray
    sched_delay_us: np.ndarray
    output_tokens: np.ndarray
    handled_by: np.ndarray
    itl_samples: np.ndarray
    preemption_count: np.ndarray
    kv_hits: np.ndarray
    kv_misses: np.ndarray
    dropped_unservable: np.ndarray
    timed_out: np.ndarray
    length_capped: np.ndarray
    total_input_tokens: np.ndarray
    sim_end_us: np.ndarray
    still_queued: np.ndarray
    still_running: np.ndarray
    kv_allocation_failures: np.ndarray
    result: int = RESULT_OK

    def __post_init__(self) -> None:
        for name, dtype in _PER_REQUEST.items():
            object.__setattr__(self, name, _frozen(np.asarray(getattr(self, name)).reshape(-1), dtype))
        # int32: each sample is one step time in µs; pools reach tens of millions of samples
        itl = np.asarray(self.itl_samples)
        object.__setattr__(self, "itl_samples", _frozen(itl if itl.ndim == 1 else itl.reshape(-1), np.int32))
        for name in _COUNTERS:
            object.__setattr__(self, name, _frozen(np.atleast_1d(np.asarray(getattr(self, name))), np.int64))
        object.__setattr__(self, "result", int(self.result))
        self.validate()

    @property
    def num_requests(self) -> int:
        return int(self.status.shape[0])

    @property
    def num_instances(self) -> int:
        return int(self.sim_end_us.shape[0])

    def validate(self) -> SimOutput:
        n, i = self.num_requests, self.num_instances
        for name in _PER_REQUEST:
            if getattr(self, name).shape != (n,):
                raise ConfigError(f"SimOutput.{name}: shape {getattr(self, name).shape}, expected ({n},)")
        for name in _COUNTERS:
            if getattr(self, name).shape != (i,):
                raise ConfigError(f"SimOutput.{name}: shape {getattr(self, name).shape}, expected ({i},) "
                                  "(one counter per instance)")
        if np.any(~np.isin(self.status, list(STATUS_NAMES))):
            raise ConfigError(f"SimOutput.status: unknown code(s) {sorted(set(self.status.tolist()) - set(STATUS_NAMES))}")
        if np.any((self.handled_by < -1) | (self.handled_by >= i)):
            raise ConfigError(f"SimOutput.handled_by: instance index outside -1..{i - 1}")
        done = is_completed(self.status)
        expected = int(self.num_itl[done].sum())
        if self.itl_samples.shape[0] != expected:
            raise ConfigError(f"SimOutput.itl_samples: {self.itl_samples.shape[0]} samples, but completed "
                              f"requests have Σ num_itl = {expected}")
        if np.any(done & (self.e2e_us < 0)):
            raise ConfigError("SimOutput.e2e_us: a completed request has no E2E (-1)")
        return self

    def completed_mask(self) -> np.ndarray:
        return is_completed(self.status)

    def itl_owner(self) -> np.ndarray:
        """Row index of the request each `itl_samples` entry belongs to."""
        done = np.flatnonzero(self.completed_mask())
        return np.repeat(done, self.num_itl[done])


def _frozen(arr: np.ndarray, dtype) -> np.ndarray:
    # A read-only array of the right type that owns its data cannot change under us: keep it
    # (the ITL pool can be hundreds of MB); copy anything else.
    if (isinstance(arr, np.ndarray) and arr.dtype == dtype and not arr.flags.writeable
            and arr.flags.owndata):
        return arr
    out = np.array(arr, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out
