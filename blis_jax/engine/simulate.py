"""Run one instance: a jitted `lax.while_loop` over events, driven in chunks from the host.

`simulate_instance` is the host entry point: it sizes the buffers (`choose_dims`), converts the
request set to arrays, runs the loop in chunks of events (a progress callback between chunks),
retries with larger buffers on an overflow result code, and returns a numpy `SimOutput`.
The jitted pieces (`start`, `advance`) are pure functions of arrays, so they `vmap` over
scenarios of one shape.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax import executables, latency
from blis_jax.engine import events, results
from blis_jax.engine.dims import EngineDims, choose_dims
from blis_jax.engine.growth import Growth, run_growing
from blis_jax.engine.itl_log import ItlLogReader
from blis_jax.engine.loops import masked_while
from blis_jax.engine.output import SimOutput
from blis_jax.engine.params import INF_TIME, EngineParams
from blis_jax.engine.state import EngineState, RequestArrays, init_state
from blis_jax.errors import ConfigError
from blis_jax.workload.requests import RequestSet
from blis_jax.workload.sessions import FOLLOW_UP_ARRIVAL, SessionLinks, settle_sessions


def wait_ranks(requests: RequestSet, scheduler: str) -> np.ndarray:
    """Static wait-queue order for schedulers that re-sort the queue every step.

    BLIS sorts stably by (priority, arrival, id) for priority-fcfs and by (input length,
    arrival, id) for sjf, where ids are the strings `request_<n>` (compared as strings).
    """
    n = len(requests)
    if scheduler == "fcfs" or n == 0:
        return np.zeros(n, np.int64)
    ids = np.array([f"request_{i}" for i in requests.request_id])
    first = requests.priority if scheduler == "priority-fcfs" else requests.input_len
    order = np.lexsort((ids, requests.arrival_us, first))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    return rank


def request_arrays(requests: RequestSet, dims: EngineDims, sessions: SessionLinks | None = None,
                   adapters: np.ndarray | None = None, *, on_device: bool = True) -> RequestArrays:
    """Pad the request set to `dims.num_requests` and move it to device arrays (`adapters`:
    each request's LoRA registry index, -1 none; lora.LoraConfig.adapter_index). `on_device=False`
    keeps NumPy arrays, for a caller that stacks lanes on the host: reading a fresh device
    array back waits for whatever program that device is running."""
    n, cap = len(requests), dims.num_requests
    links = sessions if sessions is not None else SessionLinks.none(n)
    to_array = jnp.asarray if on_device else np.asarray

    def pad(values, fill, dtype):
        out = np.full(cap, fill, dtype)
        out[:n] = values
        return to_array(out)

    grouped = requests.prefix_group >= 0
    shared = np.where(grouped, requests.prefix_len // dims.block_size, 0)
    return RequestArrays(
        arrival=pad(requests.arrival_us, 0, np.int64),
        input_len=pad(requests.input_len, 1, np.int64),
        output_len=pad(requests.output_len, 0, np.int64),
        deadline=pad(requests.deadline_us, 0, np.int64),
        prefix_group=pad(requests.prefix_group, -1, np.int32),
        shared_blocks=pad(shared, 0, np.int64),
        priority=pad(requests.priority, 0, np.int64),
        wait_rank=pad(wait_ranks(requests, dims.scheduler), INF_TIME, np.int64),
        follow_up=pad(links.follow_up, False, bool),
        next_round=pad(links.next_round, -1, np.int32),
        think_time=pad(links.think_time_us, 0, np.int64),
        follow_timeout=pad(links.timeout_us, 0, np.int64),
        session_slot=pad(links.session_slot, -1, np.int32),
        adapter=pad(np.full(n, -1, np.int32) if adapters is None else adapters, -1, np.int32),
        follow_budget=to_array(np.asarray(links.follow_budget, np.int64)),
        valid=pad(np.ones(n, bool), False, bool),
    )


@functools.partial(jax.jit, static_argnums=0)
def start(dims: EngineDims, params: EngineParams, req: RequestArrays, model) -> EngineState:
    enqueue_time = jnp.where(req.valid, req.arrival + latency.queueing_time_us(model, req.input_len), INF_TIME)
    state = init_state(dims, req, enqueue_time, params.horizon_us, params.total_kv_blocks)
    if dims.offload:
        from blis_jax.engine import offload

        state = dataclasses.replace(state, off=offload.init_state(dims, params.off))
    return state


def _body(state: EngineState, dims, params, req, model, active=True, until=INF_TIME) -> EngineState:
    """One engine step, after every enqueue and timeout event that comes before it; a no-op
    when `active` is False. Only events before `until` (exclusive) run: a cluster runs its
    instances up to its next cluster event, which goes first at equal times.

    Enqueues and timeouts are cheap; running them in an inner loop means the (vector-heavy)
    step logic executes once per step rather than once per event.
    """

    def before_step(s, ops):
        params, req, _, lane_active, until = ops
        kind, time = events.next_event(s, req)
        return lane_active & (kind != events.STEP) & _due(time, params, until) & ((s.result & results.growable(s)) == 0)

    def other_event(s, ops, on):
        params, req, model, _, _ = ops
        kind, _ = events.next_event(s, req)
        s = events.enqueue(s, dims, params, req, model, on & (kind == events.ENQUEUE))
        s = events.timeout(s, dims, params, req, model, on & (kind == events.TIMEOUT))
        s = events.lora_load_done(s, dims, on & (kind == events.LORA_LOAD))
        return dataclasses.replace(s, events=s.events + on)

    until = jnp.asarray(until, jnp.int64)
    state = masked_while(before_step, other_event, state, (params, req, model, jnp.asarray(active), until))
    kind, time = events.next_event(state, req)
    go = active & (kind == events.STEP) & _due(time, params, until) & ((state.result & results.growable(state)) == 0)
    state = events.step(state, dims, params, req, model, go, until)
    return dataclasses.replace(state, events=state.events + go)


def _due(time, params: EngineParams, until=INF_TIME):
    return (time <= params.horizon_us) & (time < INF_TIME) & (time < until)


def finished(state: EngineState, params: EngineParams, req: RequestArrays, until=INF_TIME):
    """No event left before `until` and the horizon (or a buffer overflowed)."""
    _, time = events.next_event(state, req)
    return ~_due(time, params, until) | ((state.result & results.growable(state)) != 0)


def run_until(dims: EngineDims, state: EngineState, params, req, model, event_limit, until=INF_TIME) -> EngineState:
    """Process events before `until` (and the horizon) until none is left or the state has
    counted `event_limit` events. Pure; `vmap`s over instances and scenarios."""
    def cond(s, ops):
        params, req, _, limit, until = ops
        return ~finished(s, params, req, until) & (s.events < limit)

    def body(s, ops, on):
        params, req, model, _, until = ops
        return _body(s, dims, params, req, model, on, until)

    return masked_while(cond, body, state, (params, req, model, event_limit, jnp.asarray(until, jnp.int64)))


_run = run_until


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def advance(dims: EngineDims, state: EngineState, params: EngineParams, req: RequestArrays, model, event_limit):
    """Process events until the run is over or `event_limit` events have been processed."""
    return _run(dims, state, params, req, model, event_limit)


_DRIVER_PROGRAMS: dict = {}  # EngineDims → the host driver's (start, chunk) jitted programs


def _driver_programs(dims: EngineDims):
    """The host driver's two programs for `dims`: (params, req, model) → initial state, and
    (state, (params, req, model), event limit) → (state after the chunk, run over?). Whether
    the run is over is computed inside the program: evaluated eagerly on device arrays it
    would compile a dozen one-op programs in every process."""
    programs = _DRIVER_PROGRAMS.get(dims)
    if programs is None:
        def begin(inputs):
            return start.__wrapped__(dims, *inputs)

        def chunk(state, inputs, event_limit):
            params, req, model = inputs
            state = _run(dims, state, params, req, model, event_limit)
            return state, finished(state, params, req)

        programs = _DRIVER_PROGRAMS[dims] = (jax.jit(begin), jax.jit(chunk, donate_argnums=0))
    return programs


def compiled_programs() -> int:
    """Programs the host driver has compiled in this process (no-recompile tests)."""
    return sum(p._cache_size() for pair in _DRIVER_PROGRAMS.values() for p in pair)


def run_to_end(dims: EngineDims, params: EngineParams, req: RequestArrays, model) -> EngineState:
    """Whole run in one traced function (for vmap over scenarios and for jit-vs-nojit tests)."""
    state = start.__wrapped__(dims, params, req, model)
    return _run(dims, state, params, req, model, jnp.asarray(INF_TIME, jnp.int64))


def simulate_instance(
    requests: RequestSet,
    params: EngineParams,
    model,
    *,
    block_size: int = 16,
    scheduler: str = "fcfs",
    preemption_policy: str = "fcfs",
    events_per_chunk: int = 200_000,
    progress: Callable[[int, int, int], None] | None = None,
    lora=None,
    cpu_tier=None,
    offload=None,
    seed: int = 0,
) -> SimOutput:
    """Simulate one instance serving `requests`; host-side driver around the jitted loop.

    `progress(done_requests, total_requests, sim_time_us)` is called between chunks.
    `offload`: a config.kv_offload.OffloadConfig (the multi-tier KV offload chain, offload.py);
    `seed`: the run's seed (the chain's jitter draws come from its `kv-offload` stream).
    """
    state, dims, code, itl_reader = _drive(requests, None, params, model, block_size=block_size, scheduler=scheduler,
                                           preemption_policy=preemption_policy, events_per_chunk=events_per_chunk,
                                           progress=progress, lora=lora, cpu_tier=cpu_tier, offload=offload,
                                           seed=seed)
    out = to_output(state, dims, params, requests, code, itl_reader)
    return out if lora is None else with_adapter_counts(out, lora, state.lora_loads, state.lora_evictions)


def with_adapter_counts(out: SimOutput, lora, loads, evictions) -> SimOutput:
    """`out` with the LoRA registry and per-instance, per-adapter load / eviction counts [I, A]."""
    a = len(lora.adapters)
    loads, evictions = (np.asarray(x).reshape(-1, np.shape(x)[-1])[:, :a] for x in (loads, evictions))
    return dataclasses.replace(out, adapter_ids=lora.ids, adapter_loads=loads, adapter_evictions=evictions)


def simulate_sessions(
    requests: RequestSet,
    sessions: SessionLinks,
    params: EngineParams,
    model,
    **kwargs,
) -> tuple[RequestSet, SimOutput]:
    """`simulate_instance` for a workload with closed-loop sessions (workload/sessions.py):
    returns the requests that existed (rounds generated by the loop, with their arrival times)
    and their outputs, in arrival order."""
    if kwargs.get("scheduler", "fcfs") != "fcfs":
        raise ConfigError("--scheduler: closed-loop sessions run with fcfs only for now (priority-fcfs and sjf "
                          "order the queue by arrival time, which a follow-up round only gets during the run)")
    state, dims, code, itl_reader = _drive(requests, sessions, params, model, **kwargs)
    out = to_output(state, dims, params, requests, code, itl_reader)
    if kwargs.get("lora") is not None:
        out = with_adapter_counts(out, kwargs["lora"], state.lora_loads, state.lora_evictions)
    arrival, follow_seq = (np.asarray(a)[: len(requests)] for a in jax.device_get((state.arrival, state.follow_seq)))
    rows, settled = settle_sessions(requests, sessions, arrival, follow_seq)
    return settled, out.take(rows)


def simulate_traced(
    requests: RequestSet,
    sessions: SessionLinks | None,
    params: EngineParams,
    model,
    *,
    events_per_chunk: int = 16_384,
    **kwargs,
):
    """`simulate_sessions` that also returns the step trace for fitting: (requests, outputs,
    (step start µs, step duration µs, latency basis [S, 11], first-token step per request))."""
    links = sessions if sessions is not None else SessionLinks.none(len(requests))
    state, dims, code, itl_reader = _drive(requests, links, params, model, events_per_chunk=events_per_chunk,
                                           trace_steps=True, **kwargs)
    out = to_output(state, dims, params, requests, code, itl_reader)
    host = jax.device_get((state.arrival, state.out_first_step, state.follow_seq))
    rows, settled = settle_sessions(requests, links, np.asarray(host[0])[: len(requests)],
                                    np.asarray(host[2])[: len(requests)])
    start, duration, basis = itl_reader.step_trace()
    return settled, out.take(rows), (start, duration, basis, np.asarray(host[1])[: len(requests)][rows])


def _drive(requests, sessions, params, model, *, block_size: int = 16, scheduler: str = "fcfs",
           preemption_policy: str = "fcfs", events_per_chunk: int = 200_000, progress=None,
           trace_steps: bool = False, lora=None, cpu_tier=None, offload=None, seed: int = 0):
    """Run to the end in chunks, rerunning with the overflowed buffers grown (growth.py).
    `lora`: a lora.LoraConfig, or None; `offload`: a config.kv_offload.OffloadConfig, or None
    (`seed` seeds its jitter). Returns (final state, dims, result code, ITL log reader)."""
    adapters = None
    if lora is not None:
        from blis_jax.engine import lora as lora_mod

        adapters = lora.adapter_index(lora_mod.adapter_labels(requests))
        params = lora_mod.with_params(params, lora)
    if offload is not None:
        if scheduler != "fcfs" or lora is not None or sessions is not None or trace_steps:
            raise ConfigError("kv_offload: the multi-tier KV offload chain runs with the fcfs scheduler, without "
                              "LoRA adapters, closed-loop sessions or a step trace for now")
    params = with_tier_params(params, block_size, cpu_tier, offload)
    for value, allowed, flag in ((scheduler, ("fcfs", "priority-fcfs", "sjf"), "--scheduler"),
                                 (preemption_policy, ("fcfs", "priority"), "--preemption-policy")):
        if value not in allowed:
            raise ConfigError(f"{flag} {value!r} is not supported; choose one of {', '.join(allowed)}")

    def attempt(growth: Growth):
        dims = choose_dims(
            input_len=requests.input_len,
            output_len=requests.output_len,
            prefix_group=requests.prefix_group,
            prefix_len=requests.prefix_len,
            max_num_seqs=int(params.max_num_seqs),
            max_num_batched_tokens=int(params.max_num_batched_tokens),
            total_kv_blocks=int(params.total_kv_blocks),
            block_size=block_size,
            scheduler=scheduler,
            preemption_policy=preemption_policy,
            growth=growth,
            step_log=events_per_chunk,  # read after every chunk, which has at most this many steps
            num_sessions=sessions.num_sessions if sessions is not None else 0,
            trace_steps=trace_steps,
            max_model_len=int(params.max_model_len),
        )
        dims = with_lora(dims, lora)
        if cpu_tier is not None:
            dims = with_cpu_tier(dims, cpu_tier)
        dims = with_offload(dims, offload, growth.offload)
        run_params = with_offload_params(params, dims, offload, seed)
        req = request_arrays(requests, dims, sessions, adapters)
        inputs = jax.device_put((run_params, req, model))
        start_program, chunk_program = _driver_programs(dims)
        state = executables.call(start_program, f"engine.start {dims}", inputs)
        itl_reader = ItlLogReader()
        limit = 0
        while True:
            limit += events_per_chunk
            state, done = executables.call(chunk_program, f"engine.advance {dims}", state, inputs,
                                           jnp.int64(limit))
            state = itl_reader.read(state)
            if progress is not None:
                progress(int(state.finished), len(requests), int(state.now))
            if bool(done):
                break
        code = int(state.result)
        return (state, dims, code, itl_reader), code

    return run_growing(attempt)


def with_tier_params(params: EngineParams, block_size: int, cpu_tier=None, offload=None) -> EngineParams:
    """`params` with the CPU store's settings of the legacy tier `cpu_tier` (cpu_tier.CpuTier) or
    of the offload chain `offload`'s staging tier (at most one of them; None: unchanged). The
    chain's own params (offload.make_params) depend on the run's dims: the driver adds them."""
    from blis_jax.engine import cpu_tier as cpu_mod

    if cpu_tier is not None and offload is not None:
        raise ConfigError("--kv-cpu-blocks and a kv_offload chain are two CPU tiers: configure one of them")
    if cpu_tier is not None:
        return dataclasses.replace(params, cpu=cpu_mod.make_params(cpu_tier.blocks, block_size, cpu_tier.bandwidth,
                                                                   cpu_tier.base_latency_us))
    if offload is not None:
        from blis_jax.engine import offload as offload_mod

        offload_mod.validate(offload)
        # its admission reloads the CPU continuation as the legacy tier does, free of step time
        return dataclasses.replace(params, cpu=cpu_mod.CpuTierParams(
            capacity=jnp.asarray(int(offload.cpu_blocks), jnp.int64), reload_us=jnp.asarray(0, jnp.int64)))
    return params


def with_offload_params(params: EngineParams, dims: EngineDims, offload, seed: int) -> EngineParams:
    """`params` with the offload chain's own figures for a run of `dims` (its jitter draws from the
    `kv-offload` stream of `seed`: every instance's the same, blis-rng §10.3); None: unchanged."""
    if offload is None:
        return params
    from blis_jax.engine import offload as offload_mod

    return dataclasses.replace(params, off=offload_mod.make_params(offload, dims, seed))


def with_lora(dims: EngineDims, lora) -> EngineDims:
    """`dims` with the LoRA sizes of `lora` (a LoraConfig; None: unchanged)."""
    from blis_jax.engine.lora import engine_sizes

    return dims if lora is None else dataclasses.replace(dims, **engine_sizes(lora))


def with_cpu_tier(dims: EngineDims, cpu) -> EngineDims:
    """`dims` with the CPU-tier sizes of `cpu` (a cpu_tier.CpuTier; None: unchanged)."""
    from blis_jax.engine import cpu_tier

    return dims if cpu is None else dataclasses.replace(dims, **cpu_tier.engine_sizes(dims, cpu.blocks))


def with_offload(dims: EngineDims, offload, growth: int = 1) -> EngineDims:
    """`dims` with the sizes of the KV offload chain `offload` (None: unchanged)."""
    from blis_jax.engine import offload as offload_mod

    return dims if offload is None else dataclasses.replace(dims, **offload_mod.engine_sizes(dims, offload, growth))


def in_flight(s, num_requests: int):
    """(enqueue positions, window slots, requests) of requests still queued or running, from a
    host copy `s` of the state (arrays)."""
    from blis_jax.engine import state as st

    w = s.win_status.shape[0]
    enq = int(s.enq_pos)
    pos = np.arange(max(0, enq - w), enq)
    slot = pos & (w - 1)
    r = np.asarray(s.enqueue_order)[pos]
    live = (r < num_requests) & np.isin(np.asarray(s.win_status)[slot], (st.QUEUED, st.RUNNING))
    return pos[live], slot[live], r[live]


def to_output(state: EngineState, dims: EngineDims, params: EngineParams, requests: RequestSet, code: int,
              itl_reader: ItlLogReader | None = None, *, clock_sees_arrivals: bool = True) -> SimOutput:
    """Device state → numpy SimOutput (per-request arrays trimmed to the request count).

    `itl_reader` holds the ITL log of earlier chunks; without it the state's own logs must
    hold the whole run (as after `run_to_end` with a result code free of *_LOG_FULL bits).
    `clock_sees_arrivals`: the end time is at least the last arrival before the horizon (a
    lone instance's clock is the cluster's; a cluster instance's own is set by its caller)."""
    from blis_jax.engine import state as st

    n = len(requests)
    s = jax.device_get(state)
    status = np.asarray(s.out_status[:n]).copy()
    ttft = np.asarray(s.out_ttft[:n]).copy()
    itl_sum = np.asarray(s.out_itl_sum[:n]).copy()
    num_itl = np.asarray(s.out_num_itl[:n]).copy()
    sched_delay = np.asarray(s.out_sched_delay[:n]).copy()
    _, slot, r = in_flight(s, n)
    status[r] = np.asarray(s.win_status)[slot]
    row = np.asarray(s.win_row)[slot]
    rr, row = r[row >= 0], row[row >= 0]
    ttft[rr], sched_delay[rr] = np.asarray(s.row_ttft)[row], np.asarray(s.row_sched_delay)[row]
    itl_sum[rr], num_itl[rr] = np.asarray(s.row_itl_sum)[row], np.asarray(s.row_num_itl)[row]
    output_status = status   # the engine's codes are the outputs' (engine/status.py)
    finished_ok = (status == st.COMPLETED) | (status == st.LENGTH_CAPPED)
    itl_step_us, itl_runs = (itl_reader or ItlLogReader()).finish(s, n, finished_ok)
    horizon = int(params.horizon_us)
    # a closed-loop follow-up's arrival is the one the loop gave it (-1: never generated)
    arrival = requests.arrival_us
    if n and arrival.max() == FOLLOW_UP_ARRIVAL:
        arrival = np.where(arrival == FOLLOW_UP_ARRIVAL, np.asarray(s.arrival[:n]), arrival)
    arrived = arrival[arrival <= horizon]
    sim_end = max(int(s.sim_end), int(arrived.max()) if len(arrived) and clock_sees_arrivals else 0)
    return SimOutput(
        status=output_status.astype(np.int8),
        ttft_us=ttft,
        e2e_us=np.where(finished_ok, np.asarray(s.out_e2e[:n]), -1),
        itl_sum_us=itl_sum,
        num_itl=num_itl,
        sched_delay_us=sched_delay,
        output_tokens=np.asarray(s.out_output_tokens[:n]),
        handled_by=np.zeros(n, np.int32),
        itl_step_us=itl_step_us,
        itl_runs=itl_runs,
        preemption_count=int(s.preemptions),
        kv_hits=int(s.kv_hits),
        kv_misses=int(s.kv_misses),
        dropped_unservable=int(s.dropped),
        timed_out=int(s.timed_out),
        length_capped=int(s.length_capped),
        total_input_tokens=int(s.total_input_tokens),
        sim_end_us=sim_end,
        still_queued=int(np.sum(status == st.QUEUED)),
        still_running=int(np.sum(status == st.RUNNING)),
        kv_allocation_failures=int(s.kv_alloc_failures),
        peak_batch_size=int(s.peak_batch_len),
        result=code,
        cpu_tier_counts=(np.array([int(s.cpu_misses)]), np.array([int(s.cpu_stores)]), np.array([int(s.cpu_evictions)]))
        if dims.cpu_blocks else None,
        cpu_reload_failures=np.array([int(s.cpu_reload_failures)]) if dims.cpu_blocks else None,
        offload_counts=offload_counts(s) if dims.offload else None,
    )


def offload_counts(s) -> dict:
    """Per-instance counters of the KV offload chain ([1] each) from a host copy of the state."""
    o = s.off
    return {name: np.array([int(v)]) for name, v in (
        ("promotions_attempted", o.attempted), ("promotions_refused", o.refused),
        ("promotions_done", o.promotions_done), ("promotion_blocks", o.promotion_blocks),
        ("cpu_stores", s.cpu_stores), ("cpu_evictions", s.cpu_evictions), ("store_skips", o.store_skips),
        ("cpu_reloads", o.cpu_reloads), ("writes", o.writes), ("writes_done", o.writes_done),
        ("warm_loads", o.warm_loads))}
