"""`SimOutput`: what a simulation run hands to metrics and output (numpy, after the run).

Per-request arrays are in `RequestSet` row order (injection-time order). Counters are
per instance (shape [I]); a scalar is accepted for a single instance. All times are int64 µs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from blis_jax.errors import ConfigError

from blis_jax.engine.status import (  # noqa: E402,F401  (re-exported: outputs name them from here)
    COMPLETED,
    DROPPED,
    ENCODE_REJECTED,
    GATEWAY_EXPIRED,
    GATEWAY_QUEUED,
    GATEWAY_REJECTED,
    GATEWAY_SHED,
    LENGTH_CAPPED,
    NOT_ARRIVED,
    QUEUED,
    REJECTED,
    ROUTING_REJECTED,
    RUNNING,
    STATUS_NAMES,
    TIMED_OUT,
)

RESULT_OK = 0  # `result` code of a run that finished without a capacity/overflow problem

_PER_REQUEST = {"status": np.int8, "ttft_us": np.int64, "e2e_us": np.int64, "itl_sum_us": np.int64,
                "num_itl": np.int64, "sched_delay_us": np.int64, "output_tokens": np.int64,
                "handled_by": np.int32}
_COUNTERS = ("preemption_count", "kv_hits", "kv_misses", "dropped_unservable", "timed_out",
             "length_capped", "total_input_tokens", "sim_end_us", "still_queued", "still_running",
             "kv_allocation_failures", "peak_batch_size")


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

    ITL samples of completed requests, in compressed form (every request decoding in a step gets
    the same sample, the step's duration plus α2): `itl_step_us` (shape [S]) holds one sample
    value per step and `itl_runs` (shape [K, 3]) rows (request row, first step, last step), the
    runs of consecutive steps in which a completed request produced ITL samples; request i's
    runs cover exactly `num_itl[i]` steps. `itl_pool(mask)` turns them into (value, count) pairs
    and `itl_samples()` expands them (small outputs only). Memory is O(steps + requests), where
    one entry per sample would be O(output tokens).

    Per instance (shape [I]): `preemption_count`, `kv_hits`, `kv_misses` (prefix-cache
    blocks), `dropped_unservable`, `timed_out`, `length_capped`, `total_input_tokens`
    (counted at enqueue), `sim_end_us` (min(last event clock, horizon)), `still_queued`,
    `still_running`, `kv_allocation_failures`, `peak_batch_size` (most requests ever in the
    running batch at once). `result` is the engine's result code.
    """

    status: np.ndarray
    ttft_us: np.ndarray
    e2e_us: np.ndarray
    itl_sum_us: np.ndarray
    num_itl: np.ndarray
    sched_delay_us: np.ndarray
    output_tokens: np.ndarray
    handled_by: np.ndarray
    itl_step_us: np.ndarray
    itl_runs: np.ndarray
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
    peak_batch_size: np.ndarray
    result: int = RESULT_OK
    gateway_delay_us: np.ndarray | None = None  # flow control: dispatch - enqueue per request, -1 if never dispatched
    hol_blocking_events: int = 0  # clusters: instances whose mean wait queue is > 2x the cross-instance mean
    instance_names: tuple[str, ...] | None = None  # per instance; None: instance_<k> (autoscaled clusters name theirs)
    cluster_log: tuple[tuple[int, str, str], ...] = ()  # (µs, level, message): what BLIS logs about scaling
    # autoscaled clusters: [I, S] the µs each instance entered each lifecycle state, -1 never (cluster/timeline.py)
    instance_entered: np.ndarray | None = None
    # LoRA (engine/lora.py): registry ids, and cold loads / evictions per instance and adapter [I, A]
    adapter_ids: tuple[str, ...] = ()
    adapter_loads: np.ndarray | None = None
    adapter_evictions: np.ndarray | None = None
    # warm-up (cluster/warm_up.py): the cluster-level TTFT of every request after the post-hoc
    # penalty (float64 µs); None: no penalty applied (then `ttft_us` is the cluster's too)
    ttft_adjusted_us: np.ndarray | None = None
    # drain policies (cluster/drain.py): arrivals at the cluster a request's status does not show
    # (a redirected request arrives again; a discarded one keeps no status), per request; they
    # count in goodput denominators as BLIS's per-class injected counter does. None: none
    extra_arrivals: np.ndarray | None = None
    # legacy CPU KV tier (engine/cpu_tier.py): (CPU misses, stores, evictions) per instance [I]
    cpu_tier_counts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # ... and its allocations that failed after reloading blocks from CPU, per instance [I]: BLIS
    # keeps the reloaded prefix held by the waiting request there, blis-jax does not (cpu_tier.py)
    cpu_reload_failures: np.ndarray | None = None
    # E/P/D (cluster/encode.py): each request's encode routing decision, the encode instance it
    # chose (-1: none made, or rejected); None without an encode pool or decider
    encode_by: np.ndarray | None = None
    # multi-tier KV offload chain (engine/offload.py): counters per instance [I] by name:
    # promotions_attempted / _refused (KV Thrashing Rate = refused / attempted), promotions_done,
    # promotion_blocks, cpu_stores, cpu_evictions, store_skips, cpu_reloads, writes, writes_done
    offload_counts: dict | None = None

    def __post_init__(self) -> None:
        for name, dtype in _PER_REQUEST.items():
            object.__setattr__(self, name, _frozen(np.asarray(getattr(self, name)).reshape(-1), dtype))
        # int32: each sample is one step time in µs
        object.__setattr__(self, "itl_step_us", _frozen(np.asarray(self.itl_step_us).reshape(-1), np.int32))
        object.__setattr__(self, "itl_runs", _frozen(np.asarray(self.itl_runs).reshape(-1, 3), np.int64))
        for name in _COUNTERS:
            object.__setattr__(self, name, _frozen(np.atleast_1d(np.asarray(getattr(self, name))), np.int64))
        object.__setattr__(self, "result", int(self.result))
        if self.gateway_delay_us is not None:
            delay = _frozen(np.asarray(self.gateway_delay_us).reshape(-1), np.int64)
            object.__setattr__(self, "gateway_delay_us", delay)
        if self.ttft_adjusted_us is not None:
            adjusted = _frozen(np.asarray(self.ttft_adjusted_us).reshape(-1), np.float64)
            if adjusted.shape != self.ttft_us.shape:
                raise ConfigError(f"SimOutput.ttft_adjusted_us: shape {adjusted.shape}, expected {self.ttft_us.shape}")
            object.__setattr__(self, "ttft_adjusted_us", adjusted)
        if self.extra_arrivals is not None:
            extra = _frozen(np.asarray(self.extra_arrivals).reshape(-1), np.int64)
            if extra.shape != self.ttft_us.shape:
                raise ConfigError(f"SimOutput.extra_arrivals: shape {extra.shape}, expected {self.ttft_us.shape}")
            object.__setattr__(self, "extra_arrivals", extra)
        if self.encode_by is not None:
            encode_by = _frozen(np.asarray(self.encode_by).reshape(-1), np.int32)
            if encode_by.shape != self.ttft_us.shape:
                raise ConfigError(f"SimOutput.encode_by: shape {encode_by.shape}, expected {self.ttft_us.shape}")
            object.__setattr__(self, "encode_by", encode_by)
        self.validate()

    @property
    def num_requests(self) -> int:
        return int(self.status.shape[0])

    @property
    def num_instances(self) -> int:
        return int(self.sim_end_us.shape[0])

    def validate(self) -> SimOutput:
        n, i = self.num_requests, self.num_instances
        for name in (*_PER_REQUEST, *(("gateway_delay_us",) if self.gateway_delay_us is not None else ())):
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
        req, first, last = self.itl_runs.T
        if np.any((req < 0) | (req >= n)) or np.any(~done[req]):
            raise ConfigError("SimOutput.itl_runs: a run belongs to a request that did not complete")
        if np.any((first < 0) | (last < first) | (last >= self.itl_step_us.shape[0])):
            raise ConfigError("SimOutput.itl_runs: a run lies outside the step log")
        covered = np.bincount(req, weights=last - first + 1, minlength=n).astype(np.int64)
        if np.any(covered[done] != self.num_itl[done]):
            raise ConfigError(f"SimOutput.itl_runs: runs cover {int(covered[done].sum())} samples, but completed "
                              f"requests have Σ num_itl = {int(self.num_itl[done].sum())}")
        if np.any(done & (self.e2e_us < 0)):
            raise ConfigError("SimOutput.e2e_us: a completed request has no E2E (-1)")
        return self

    @property
    def cluster_ttft_us(self) -> np.ndarray:
        """TTFT per request as the cluster-level figures read it (with the warm-up penalty)."""
        return self.ttft_us if self.ttft_adjusted_us is None else self.ttft_adjusted_us

    def completed_mask(self) -> np.ndarray:
        return is_completed(self.status)

    def take(self, rows: np.ndarray) -> SimOutput:
        """The outputs of requests `rows` (in that order), counters unchanged."""
        rows = np.asarray(rows, np.int64)
        new_index = np.full(self.num_requests, -1, np.int64)
        new_index[rows] = np.arange(rows.shape[0])
        runs = self.itl_runs[new_index[self.itl_runs[:, 0]] >= 0]
        runs = np.column_stack([new_index[runs[:, 0]], runs[:, 1:]])
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update({name: getattr(self, name)[rows] for name in _PER_REQUEST})
        if self.gateway_delay_us is not None:
            fields["gateway_delay_us"] = self.gateway_delay_us[rows]
        if self.ttft_adjusted_us is not None:
            fields["ttft_adjusted_us"] = self.ttft_adjusted_us[rows]
        if self.extra_arrivals is not None:
            fields["extra_arrivals"] = self.extra_arrivals[rows]
        if self.encode_by is not None:
            fields["encode_by"] = self.encode_by[rows]
        fields["itl_runs"] = runs
        return SimOutput(**fields)

    def itl_pool(self, requests: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Pooled ITL samples of the completed requests selected by the boolean mask `requests`
        (all if None) as (sample value, count) over the steps that have any."""
        runs = self.itl_runs if requests is None else self.itl_runs[np.asarray(requests, bool)[self.itl_runs[:, 0]]]
        steps = self.itl_step_us.shape[0]
        # difference array over steps: +1 where a run starts, -1 after it ends
        delta = (np.bincount(runs[:, 1], minlength=steps + 1)
                 - np.bincount(runs[:, 2] + 1, minlength=steps + 1))
        counts = np.cumsum(delta[:steps])
        used = counts > 0
        return self.itl_step_us[used], counts[used]

    def itl_samples(self) -> np.ndarray:
        """Every ITL sample of completed requests, in request row order and time order within a
        request (expanded: O(output tokens) memory, for small outputs and tests)."""
        runs = self.itl_runs[np.lexsort((self.itl_runs[:, 1], self.itl_runs[:, 0]))]
        parts = [self.itl_step_us[first : last + 1] for _, first, last in runs.tolist()]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def itl_from_samples(samples, status, num_itl) -> dict[str, np.ndarray]:
    """`itl_step_us` / `itl_runs` for given pooled samples (request row order, `num_itl[i]` per
    completed request), one step per sample: for outputs built outside the engine."""
    samples = np.asarray(samples, np.int64).reshape(-1)
    done = np.flatnonzero(is_completed(np.asarray(status)))
    owner = np.repeat(done, np.asarray(num_itl, np.int64)[done])
    if owner.shape[0] != samples.shape[0]:
        raise ConfigError(f"itl samples: {samples.shape[0]} given, but completed requests have "
                          f"Σ num_itl = {owner.shape[0]}")
    steps = np.arange(samples.shape[0], dtype=np.int64)
    return {"itl_step_us": samples, "itl_runs": np.stack([owner, steps, steps], axis=1)}


def _frozen(arr: np.ndarray, dtype) -> np.ndarray:
    # A read-only array of the right type that owns its data cannot change under us: keep it
    # (large outputs are not copied twice); copy anything else.
    if (isinstance(arr, np.ndarray) and arr.dtype == dtype and not arr.flags.writeable
            and arr.flags.owndata):
        return arr
    out = np.array(arr, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out
