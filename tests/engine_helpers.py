"""Shared drivers for the engine test suite (test_engine_parity / _invariants / _jax).

* blis-diff case inputs turned into engine inputs (`case_inputs`);
* `dims_floor`: run `simulate_instance` unchanged, but with every capacity raised to at least
  a given floor, so that scenarios of one group share one compiled program (compilation,
  ~10 s per program on 2 CPU cores, is the dominant cost of these tests);
* randomized small scenarios (`random_scenario`) on Llama-3.1-8B / H100 / trained-physics;
* an event-by-event driver over the jitted `start` / `advance` (`step_events`);
* the pure-Python oracle (tests/reference_engine.py) driven with blis_jax.latency step times,
  with its results mapped onto `SimOutput` conventions (`run_oracle`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from functools import cache
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax.config import load_gpu, load_model
from blis_jax.engine import output as so
from blis_jax.engine import simulate as sim
from blis_jax.engine.dims import CAPACITY_FIELDS, EngineDims
from blis_jax.engine.params import make_engine_params
from blis_jax.latency import build_latency_model
from blis_jax.workload.requests import RequestSet, make_request_set
from blis_jax.workload.tracev2 import read_trace

from shared_data import BLIS_DIFF as CASES_DIR  # noqa: E402
LLAMA8B = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK_SIZE = 16

# Capacities of EngineDims that may be raised without changing the simulated behaviour: every
# integer field but the block size (strings are structure: scheduler, preemption policy).
GROWABLE_FIELDS = CAPACITY_FIELDS


# ----------------------------------------------------------------------------- latency / params


@cache
def latency_model(model_id: str = LLAMA8B, hardware: str = "H100", tp: int = 1, kind: str = "trained-physics"):
    return build_latency_model(kind, load_model(model_id), load_gpu(hardware), tp=tp)


def params_from(settings: dict):
    """EngineParams from a settings dict with case.json key names."""
    return make_engine_params(
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        long_prefill_token_threshold=settings.get("long_prefill_token_threshold", 0),
        max_model_len=settings.get("max_model_len", 0),
        total_kv_blocks=settings["total_kv_blocks"],
        horizon_us=settings.get("horizon_us"),
    )


def natural_dims(requests: RequestSet, settings: dict, growth: int = 1) -> EngineDims:
    """The dims `simulate_instance` would choose itself."""
    return sim.choose_dims(
        input_len=requests.input_len, output_len=requests.output_len, prefix_group=requests.prefix_group,
        prefix_len=requests.prefix_len, max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"], total_kv_blocks=settings["total_kv_blocks"],
        block_size=BLOCK_SIZE, scheduler=settings.get("scheduler", "fcfs"),
        preemption_policy=settings.get("preemption_policy", "fcfs"), growth=growth,
    )


def raise_dims(dims: EngineDims, floor: EngineDims | None) -> EngineDims:
    """Every growable capacity of `dims` raised to at least `floor`'s (same structure)."""
    if floor is None:
        return dims
    assert (floor.block_size, floor.scheduler, floor.preemption_policy) == (
        dims.block_size, dims.scheduler, dims.preemption_policy)
    return dataclasses.replace(dims, **{f: max(getattr(dims, f), getattr(floor, f)) for f in GROWABLE_FIELDS})


def max_dims(dims_list) -> EngineDims:
    """Field-wise maximum of dims of one structure (scheduler / preemption policy)."""
    out = dims_list[0]
    for d in dims_list[1:]:
        out = raise_dims(out, d)
    return out


def small_dims(scheduler: str = "fcfs", preemption_policy: str = "fcfs") -> EngineDims:
    """One shared program shape for the small randomized scenarios of the invariants and JAX
    tests: up to 256 requests, prompt + output <= ~950 tokens, Σ output <= ~16k, max_num_seqs
    <= 64, max_num_batched_tokens <= 1024, total_kv_blocks <= 4096, 4 prefix groups of up to
    15 blocks. Built through `choose_dims`, so it follows the engine's own sizing rules."""
    n = 250
    return sim.choose_dims(
        input_len=np.full(n, 900), output_len=np.full(n, 48), prefix_group=np.arange(n) % 4,
        prefix_len=np.full(n, 15 * BLOCK_SIZE), max_num_seqs=64, max_num_batched_tokens=1024,
        total_kv_blocks=4096, block_size=BLOCK_SIZE, scheduler=scheduler, preemption_policy=preemption_policy)


@contextlib.contextmanager
def dims_floor(floors: dict):
    """While active, `simulate_instance` sizes its buffers as usual and then raises them to the
    floor registered for its (scheduler, preemption_policy); the engine code runs unchanged."""
    original = sim.choose_dims

    def choose(**kwargs):
        dims = original(**kwargs)
        return raise_dims(dims, floors.get((dims.scheduler, dims.preemption_policy)))

    with mock.patch.object(sim, "choose_dims", choose):
        yield


def simulate(requests: RequestSet, settings: dict, model, floors: dict | None = None) -> so.SimOutput:
    """`simulate_instance` with the settings dict (optionally under a dims floor)."""
    ctx = dims_floor(floors) if floors else contextlib.nullcontext()
    with ctx:
        return sim.simulate_instance(requests, params_from(settings), model,
                                     scheduler=settings.get("scheduler", "fcfs"),
                                     preemption_policy=settings.get("preemption_policy", "fcfs"))


# ----------------------------------------------------------------------------- blis-diff cases


@dataclasses.dataclass
class CaseInputs:
    case_id: str
    case: dict
    requests: RequestSet
    model: object
    results: dict  # request_id -> results.json entry
    metrics: dict  # metrics.json without "requests"
    request_metrics: dict  # request_id -> metrics.json["requests"] entry


def case_dir(case_id: str) -> Path:
    matches = [p for p in CASES_DIR.iterdir() if p.name.startswith(case_id) and (p / "case.json").is_file()]
    assert len(matches) == 1, f"{case_id}: {len(matches)} matching folders in {CASES_DIR}"
    return matches[0]


@cache
def case_inputs(case_id: str) -> CaseInputs:
    d = case_dir(case_id)
    case = json.loads((d / "case.json").read_text())
    assert case["block_size"] == BLOCK_SIZE and case["num_instances"] == 1
    _, requests = read_trace(d / "trace.yaml", d / "trace.csv")
    model = latency_model(case["model"], case["hardware"], int(case["tp"]), case["latency_model"])
    results = {int(r["request_id"]): r for r in json.loads((d / "results.json").read_text())}
    metrics = json.loads((d / "metrics.json").read_text())
    request_metrics = {int(r["requestID"].rsplit("_", 1)[1]): r for r in metrics.pop("requests")}
    return CaseInputs(case_id, case, requests, model, results, metrics, request_metrics)


# ----------------------------------------------------------------------------- random scenarios


def random_scenario(seed: int, *, n: int = 200, rate_rps: float = 20.0, input_range=(16, 400),
                    output_range=(1, 60), deadline_frac: float = 0.0, deadline_range_us=(1, 2_000_000),
                    num_groups: int = 0, prefix_range=(32, 160), num_priorities: int = 1,
                    zero_output_frac: float = 0.0, block_multiple_frac: float = 0.0,
                    burst_frac: float = 0.0) -> RequestSet:
    """Poisson arrivals with uniform lengths; optional deadlines (relative to arrival, some
    already past due at enqueue), prefix groups, SLO classes, zero outputs, prompts that are a
    whole number of blocks (fully cacheable after a preemption) and bursts of equal arrivals."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1e6 / rate_rps, n)
    gaps[rng.random(n) < burst_frac] = 0.0
    arrival = np.cumsum(gaps).astype(np.int64)
    input_len = rng.integers(input_range[0], input_range[1] + 1, n)
    whole = rng.random(n) < block_multiple_frac
    input_len = np.where(whole, np.maximum(input_len // BLOCK_SIZE, 1) * BLOCK_SIZE, input_len)
    output_len = rng.integers(output_range[0], output_range[1] + 1, n)
    output_len = np.where(rng.random(n) < zero_output_frac, 0, output_len)
    deadline = np.where(rng.random(n) < deadline_frac,
                        arrival + rng.integers(deadline_range_us[0], deadline_range_us[1] + 1, n), 0)
    groups = np.array([""] * n, dtype=object)
    prefix_len = np.zeros(n, np.int64)
    if num_groups:
        glen = rng.integers(prefix_range[0], prefix_range[1] + 1, num_groups)
        g = rng.integers(-1, num_groups, n)  # -1: no group
        for i in np.flatnonzero(g >= 0):
            groups[i] = f"g{g[i]}"
            prefix_len[i] = glen[g[i]]
            input_len[i] = glen[g[i]] + rng.integers(0, 120)
            if whole[i]:
                input_len[i] = max(input_len[i] // BLOCK_SIZE, 1) * BLOCK_SIZE
                prefix_len[i] = min(prefix_len[i], input_len[i])
    classes = np.array(["critical", "standard", "batch", "sheddable", "background"])[:num_priorities]
    slo = classes[rng.integers(0, len(classes), n)] if num_priorities > 1 else np.array([""] * n)
    return make_request_set(request_id=np.arange(n), arrival_us=arrival, input_len=input_len,
                            output_len=output_len, deadline_us=deadline, prefix_group=groups.astype(str),
                            prefix_len=prefix_len, slo_class=slo)


# ----------------------------------------------------------------------------- event stepping


def step_events(requests: RequestSet, settings: dict, model, dims: EngineDims, on_event, chunk: int = 1):
    """Run the jitted engine with `advance(..., event_limit = events + chunk)` per call, calling
    `on_event(host_state)` after the initial state and after every call. (`advance` always
    completes a step together with the enqueue / timeout events due before it, so one call
    may count more than `chunk` events.) Returns (final device state, req, params)."""
    params = params_from(settings)
    req = sim.request_arrays(requests, dims)
    state = sim.start(dims, params, req, model)
    on_event(jax.device_get(state))
    while True:
        before = int(state.events)
        state = sim.advance(dims, state, params, req, model, jnp.int64(before + chunk))
        if int(state.events) == before:
            break  # finished: nothing left before the horizon, or a result code stopped it
        on_event(jax.device_get(state))
    return state, req, params


# ----------------------------------------------------------------------------- oracle


@dataclasses.dataclass(frozen=True)
class OracleRequest:
    request_id: int
    arrival_us: int
    input_len: int
    output_len: int
    deadline_us: int
    prefix_group: str
    prefix_len: int
    priority: int


def oracle_requests(requests: RequestSet) -> list[OracleRequest]:
    names = requests.prefix_group_names
    return [OracleRequest(int(requests.request_id[i]), int(requests.arrival_us[i]), int(requests.input_len[i]),
                          int(requests.output_len[i]), int(requests.deadline_us[i]),
                          names[requests.prefix_group[i]] if requests.prefix_group[i] >= 0 else "",
                          int(requests.prefix_len[i]), int(requests.priority[i]))
            for i in range(len(requests))]


_ORACLE_SLOTS = 256


@cache
def _jitted_step_time():
    from blis_jax.latency import BatchFeatures, step_time_us

    @jax.jit
    def f(model, cols):  # rows: is_prefill, new_tokens, progress, input_len
        new = cols[1]
        feats = BatchFeatures(scheduled=new > 0, is_prefill=(cols[0] > 0) & (new > 0), new_tokens=new,
                              progress=cols[2], input_len=cols[3])
        return step_time_us(model, feats)

    return f


def oracle_hooks(model):
    """reference_engine.LatencyHooks backed by blis_jax.latency (integer µs exactly as BLIS)."""
    from reference_engine import LatencyHooks

    from blis_jax.latency import (
        output_token_time_us,
        post_decode_time_us,
        queueing_time_us,
    )

    f = _jitted_step_time()
    q_cache: dict[int, int] = {}

    def step_time(batch) -> int:
        n = len(batch)
        assert n <= _ORACLE_SLOTS
        cols = np.zeros((4, _ORACLE_SLOTS), dtype=np.int64)
        if n:
            cols[:, :n] = np.asarray(batch, dtype=np.int64).T
        return int(f(model, cols))

    def queueing_time(input_len: int) -> int:
        if input_len not in q_cache:
            q_cache[input_len] = int(queueing_time_us(model, jnp.int64(input_len)))
        return q_cache[input_len]

    return LatencyHooks(step_time=step_time, queueing_time=queueing_time,
                        output_token_time=int(output_token_time_us(model)),
                        post_decode_time=int(post_decode_time_us(model)))


ORACLE_STATUS = {"completed": so.COMPLETED, "length_capped": so.LENGTH_CAPPED, "timed_out": so.TIMED_OUT,
                 "dropped": so.DROPPED, "queued": so.QUEUED, "running": so.RUNNING, "arriving": so.NOT_ARRIVED}


def run_oracle(requests: RequestSet, settings: dict, model):
    """Oracle run mapped to SimOutput conventions: (per-request dict of arrays, counters)."""
    from reference_engine import EngineConfig
    from reference_engine import simulate as oracle_simulate

    cfg = EngineConfig(max_num_seqs=settings["max_num_seqs"],
                       max_num_batched_tokens=settings["max_num_batched_tokens"],
                       long_prefill_token_threshold=settings.get("long_prefill_token_threshold", 0),
                       total_kv_blocks=settings["total_kv_blocks"], block_size=BLOCK_SIZE,
                       max_model_len=settings.get("max_model_len", 0),
                       scheduler=settings.get("scheduler", "fcfs"),
                       preemption_policy=settings.get("preemption_policy", "fcfs"),
                       horizon_us=settings.get("horizon_us") or 2**62)
    res = oracle_simulate(oracle_requests(requests), cfg, oracle_hooks(model), record_steps=False)
    rows = [res.requests[int(rid)] for rid in requests.request_id]
    none = lambda v: -1 if v is None else int(v)
    per = {
        "status": np.array([ORACLE_STATUS[r["status"]] for r in rows]),
        "ttft_us": np.array([none(r["ttft_us"]) for r in rows], np.int64),
        "e2e_us": np.array([none(r["e2e_us"]) for r in rows], np.int64),
        "sched_delay_us": np.array([none(r["sched_delay_us"]) for r in rows], np.int64),
        "itl_sum_us": np.array([sum(r["itl"]) for r in rows], np.int64),
        "num_itl": np.array([len(r["itl"]) for r in rows], np.int64),
        "output_tokens": np.array([r["output_tokens"] if r["status"] in ("completed", "length_capped") else 0
                                   for r in rows], np.int64),
        "itl": [list(r["itl"]) for r in rows],
    }
    return per, res.counters


# ----------------------------------------------------------------------------- state views
# Mutable per-request state lives in an in-flight window indexed by enqueue position
# (`win_status`, `win_row`) with an output log (`out_status`) for requests that left; these views
# give per-request answers from a host (numpy) copy of the state.
from blis_jax.engine.simulate import in_flight as _in_flight  # noqa: E402


def request_status(s, n: int) -> np.ndarray:
    """Engine status code (blis_jax.engine.state) of each of the first n requests."""
    status = np.asarray(s.out_status[:n]).copy()
    _, slot, r = _in_flight(s, n)
    status[r] = np.asarray(s.win_status)[slot]
    return status


def request_rows(s, n: int) -> np.ndarray:
    """Block-table row held by each request (-1 if none)."""
    rows = np.full(n, -1, np.int64)
    _, slot, r = _in_flight(s, n)
    rows[r] = np.asarray(s.win_row)[slot]
    return rows
