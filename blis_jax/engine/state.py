"""Engine state of one vLLM-like instance: an immutable pytree of padded arrays.

Three groups of buffers, each with a fixed capacity from `EngineDims`:

* per request (N): read-only inputs, and an output log (`out_*`) written once when a request
  leaves (completes, times out, is dropped) and never read inside the loop, so XLA updates it
  in place. Mutable per-request state lives in a window of W slots indexed by enqueue position
  (requests in flight span at most W consecutive positions), so per-event work and memory
  traffic do not grow with N.
* per block-table row (rows = batch slots + preempted slots): the running batch's requests
  (progress, allocated tokens, block table). A preempted request keeps its row until it is
  re-admitted, so it can re-hit its own surviving prefix blocks.
* per KV block (K): reference count, content key (hash stand-in), and the LRU free list
  (never-used blocks first, then a FIFO ring of released blocks).

Dimension names of the field annotations (each one `EngineDims` capacity; tests check them):
N requests (`num_requests`), W in-flight window (`window`), U closed-loop session slots
(`sessions`), S running-batch slots (`batch_slots`), R block-table rows (`rows`), B blocks per
row (`blocks_per_request`), P preempted slots (`preempted_slots`), Q wait-window slots
(`wait_slots`), E exit log (`exit_log`), K KV blocks (`kv_blocks`), F free ring (`free_ring`),
G prefix groups (`prefix_groups`), PB blocks per prefix group (`prefix_blocks`), L step log
(`step_log`), RL run log (`run_log`), T step trace (`trace_log`), C LoRA slots (`lora_slots`),
A LoRA adapters (`lora_adapters`),
CB CPU-tier slots (`cpu_blocks`), KS content keys (`cpu_keys`, 0 without a CPU tier),
RA block-table rows with a CPU tier (`cpu_rows`). The multi-tier KV offload chain's state is
`off` (offload.OffloadState, its own dimension names there), None without a chain.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int32, Int64

from blis_jax.engine import cpu_tier
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.params import INF_TIME

# Request status codes: the one enumeration (engine arrays and outputs).
from blis_jax.engine.status import (  # noqa: E402,F401
    COMPLETED,
    DROPPED,
    LENGTH_CAPPED,
    NOT_ARRIVED,
    QUEUED,
    RUNNING,
    TIMED_OUT,
)

# Block-table row states.
ROW_FREE = 0
ROW_RUNNING = 1
ROW_PREEMPTED = 2
ROW_RESERVED = 3  # blocks reserved for a request whose prompt KV arrives from a prefill instance (transfer.py)

NO_KEY = -1
NOT_ENQUEUED = (1 << 31) - 1  # enqueue_rank of a request not enqueued yet


class RequestArrays(eqx.Module):
    """Engine input: the request set as device arrays, padded to dims.num_requests."""

    arrival: Int64[Array, " N"]
    input_len: Int64[Array, " N"]
    output_len: Int64[Array, " N"]
    deadline: Int64[Array, " N"]  # absolute µs, 0 = none (follow-up rounds: see sessions.deadline_of)
    prefix_group: Int32[Array, " N"]  # -1 = none
    shared_blocks: Int64[Array, " N"]  # full blocks shared with the prefix group
    priority: Int64[Array, " N"]  # vLLM convention: lower = more urgent
    wait_rank: Int64[Array, " N"]  # static wait-queue order for priority-fcfs / sjf
    # closed-loop sessions (sessions.py): round r+1 arrives think_time after round r completes
    follow_up: Bool[Array, " N"]  # arrival set by the loop (a later round of a closed-loop session)
    next_round: Int32[Array, " N"]  # row of this request's next round, -1 none
    think_time: Int64[Array, " N"]  # completion → next round's arrival (µs)
    follow_timeout: Int64[Array, " N"]  # follow-up deadline relative to its arrival (µs), 0 none
    session_slot: Int32[Array, " N"]  # session of the request, -1 none
    adapter: Int32[Array, " N"]  # LoRA adapter (registry index, lora.py), -1 the base model
    follow_budget: Int64[Array, ""]  # follow-ups the loop may generate in all (concurrency users), -1 no limit
    valid: Bool[Array, " N"]


class EngineState(eqx.Module):
    # clock and event bookkeeping
    now: Int64[Array, ""]
    step_pending: Bool[Array, ""]
    next_step: Int64[Array, ""]
    sim_end: Int64[Array, ""]
    enq_pos: Int32[Array, ""]  # enqueue events processed
    static_pos: Int32[Array, ""]  # of those, from the static arrival order
    dl_pos: Int32[Array, ""]  # timeout events processed (index into deadline order)
    static_order: Int32[Array, " N"]  # requests with a known arrival, in enqueue order
    num_static: Int32[Array, ""]
    enqueue_order: Int32[Array, " N"]  # request at each enqueue position (written at enqueue)
    enqueue_rank: Int32[Array, " N"]  # enqueue position of each request (NOT_ENQUEUED before)
    enqueue_time: Int64[Array, " N"]  # static requests: arrival + queueing delay (follow-ups: INF; see sessions.py)
    arrival: Int64[Array, " N"]  # injection time; a follow-up round's is set when it is generated (-1 before)
    deadline_order: Int32[Array, " N"]  # static deadlines (follow-ups' are in the session slots)
    num_deadlines: Int32[Array, ""]

    # closed-loop session slots: a pending next round, or the in-flight round's timeout
    sess_enqueue: Int64[Array, " U"]  # enqueue time of the pending round, INF none
    sess_req: Int32[Array, " U"]
    sess_seq: Int64[Array, " U"]  # generation order (same-tick tie-break)
    sess_deadline: Int64[Array, " U"]  # timeout of the in-flight follow-up, INF none
    sess_live: Int32[Array, " U"]
    follow_ups: Int64[Array, ""]  # rounds generated so far
    follow_seq: Int64[Array, " N"]  # generation order of each follow-up generated, -1 none (write-only)

    # in-flight requests, by enqueue position modulo W
    win_status: Int32[Array, " W"]
    win_row: Int32[Array, " W"]  # block-table row of a running or preempted request, else -1

    # output log, per request (write-only inside the loop)
    out_status: Int32[Array, " N"]
    out_ttft: Int64[Array, " N"]
    out_e2e: Int64[Array, " N"]
    out_itl_sum: Int64[Array, " N"]
    out_num_itl: Int64[Array, " N"]
    out_sched_delay: Int64[Array, " N"]
    out_output_tokens: Int64[Array, " N"]
    out_admit_step: Int64[Array, " N"]  # step of the last admission (ITL samples start after it)
    out_run_first: Int64[Array, " N"]  # the open decode run at exit: first and last step, -1 none
    out_run_last: Int64[Array, " N"]
    out_first_step: Int64[Array, " N"]  # step that produced the first token (step trace)
    finished: Int64[Array, ""]  # requests that left (completed, timed out, dropped)
    exit_req: Int32[Array, " E"]  # completed requests by completion index modulo E (dims.exit_log;
    #   read by a PD cluster to start KV transfers; one dummy entry otherwise)
    exit_count: Int64[Array, ""]

    # block-table rows
    row_req: Int32[Array, " R"]
    row_state: Int32[Array, " R"]
    row_progress: Int64[Array, " R"]  # ProgressIndex
    row_kv_tokens: Int64[Array, " R"]  # tokens with an allocated KV slot
    row_offset: Int64[Array, " R"]  # token position of the row's first block (see kv.py)
    row_new: Int64[Array, " R"]  # NumNewTokens this step
    row_ttft: Int64[Array, " R"]  # -1 until the first token (cleared by preemption)
    row_itl_sum: Int64[Array, " R"]
    row_num_itl: Int64[Array, " R"]
    row_sched_delay: Int64[Array, " R"]
    row_admit_step: Int64[Array, " R"]
    row_run_first: Int64[Array, " R"]  # current decode run (consecutive decoding steps), -1 none
    row_run_last: Int64[Array, " R"]
    row_first_step: Int64[Array, " R"]
    row_nblocks: Int32[Array, " R"]
    row_blocks: Int32[Array, "R B"]

    # running batch (ordered row ids) and wait queue
    batch_rows: Int32[Array, " S"]
    batch_len: Int32[Array, ""]
    peak_batch_len: Int32[Array, ""]  # largest batch_len so far (sweeps share runs it never reached max-num-seqs in)
    wait_depth_sum: Int64[Array, ""]  # Σ over steps of the wait-queue length after batch formation (HOL blocking)
    fifo_head: Int32[Array, ""]  # fcfs: first enqueue-order position that may still wait
    front: Int32[Array, " P"]  # fcfs: preempted requests, stack top = queue head
    front_len: Int32[Array, ""]
    window_req: Int32[Array, " Q"]  # priority-fcfs / sjf: waiting requests
    window_key: Int64[Array, " Q"]
    wait_len: Int32[Array, ""]

    # KV blocks
    block_key: Int64[Array, " K"]
    block_ref: Int32[Array, " K"]
    block_free: Bool[Array, " K"]
    ring: Int32[Array, " F"]
    ring_pos: Int64[Array, " K"]
    ring_head: Int64[Array, ""]
    ring_tail: Int64[Array, ""]
    fresh_next: Int32[Array, ""]
    free_count: Int64[Array, ""]
    group_block: Int32[Array, "G PB"]

    # ITL log (itl_log.py): every step's ITL sample value, and decode runs closed by a gap
    step_sample: Int32[Array, " L"]  # by step index modulo L
    step_log_base: Int64[Array, ""]  # first step the host has not read yet
    run_req: Int32[Array, " RL"]
    run_first: Int64[Array, " RL"]
    run_last: Int64[Array, " RL"]
    run_len: Int32[Array, ""]  # entries since the last host read
    # step trace (dims.trace_steps; one dummy entry otherwise), by step index modulo L
    step_start: Int64[Array, " T"]
    step_dur: Int64[Array, " T"]
    step_basis: Float64[Array, "T 11"]

    # LoRA resident set (lora.py): C slots, A adapters (both 0 without adapters)
    lora_slot: Int32[Array, " C"]  # adapter in each slot, -1 empty
    lora_ready: Bool[Array, " C"]  # loaded (False while its load is in flight)
    lora_used: Int64[Array, " C"]  # LRU stamp
    lora_pins: Int32[Array, " A"]  # requests holding each adapter (running, or preempted)
    lora_loads: Int64[Array, " A"]
    lora_evictions: Int64[Array, " A"]
    lora_loading: Int32[Array, ""]  # slot whose load is in flight, -1 none
    lora_done: Int64[Array, ""]  # its completion time, INF_TIME none
    lora_tick: Int64[Array, ""]  # LRU clock

    # legacy CPU KV tier (cpu_tier.py): CB store slots, KS content keys (both 0 without it)
    cpu_slot_key: Int64[Array, " CB"]  # content key in each slot, -1 empty
    cpu_slot_stamp: Int64[Array, " CB"]  # LRU stamp
    cpu_key_slot: Int32[Array, " KS"]  # slot of each content key, -1 not on CPU
    cpu_tick: Int64[Array, ""]
    cpu_count: Int64[Array, ""]
    cpu_stores: Int64[Array, ""]
    cpu_evictions: Int64[Array, ""]
    cpu_misses: Int64[Array, ""]
    cpu_reload_failures: Int64[Array, ""]  # allocations that failed after reloading from CPU
    cpu_pending_us: Int64[Array, ""]  # reload time added to the step being formed
    # KV tokens a row holds past its progress + this step's tokens: blocks reloaded beyond an
    # admission's prefill chunk (BLIS then appends the next chunks after them); R rows, 0 without
    row_ahead: Int64[Array, " RA"]

    # counters
    preemptions: Int64[Array, ""]
    kv_hits: Int64[Array, ""]
    kv_misses: Int64[Array, ""]
    kv_alloc_failures: Int64[Array, ""]
    dropped: Int64[Array, ""]
    timed_out: Int64[Array, ""]
    length_capped: Int64[Array, ""]
    total_input_tokens: Int64[Array, ""]
    steps: Int64[Array, ""]
    coasted_steps: Int64[Array, ""]  # of those, run inside decode runs (coast.py)
    events: Int64[Array, ""]
    result: Int32[Array, ""]
    # multi-tier KV offload chain (offload.OffloadState); None without one (nothing traced)
    off: object = None


def init_state(
    dims: EngineDims, req: RequestArrays, enqueue_time: Int64[Array, " N"], horizon: Int64[Array, ""],
    total_kv_blocks: Int64[Array, ""],
) -> EngineState:
    """Empty instance at time 0 with the event orders of this request set."""
    n, r, s = dims.num_requests, dims.rows, dims.batch_slots
    idx = jnp.arange(n, dtype=jnp.int32)
    # Queued events fire in (time, push order) order; pushes happen in arrival order.
    static = req.valid & ~req.follow_up
    enq_t = jnp.where(static, enqueue_time, INF_TIME)
    enqueue_order = jnp.lexsort((idx, enq_t)).astype(jnp.int32)
    # Timeout events exist for 0 < deadline <= horizon, pushed at enqueue.
    enq_rank = jnp.zeros(n, jnp.int32).at[enqueue_order].set(idx)
    has_dl = static & (req.deadline > 0) & (req.deadline <= horizon)
    dl_t = jnp.where(has_dl, req.deadline, INF_TIME)
    deadline_order = jnp.lexsort((enq_rank, dl_t)).astype(jnp.int32)
    w = dims.window
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    i64 = lambda v: jnp.asarray(v, jnp.int64)  # noqa: E731
    k = dims.kv_blocks
    return EngineState(
        now=i64(0),
        step_pending=jnp.asarray(False),
        next_step=i64(INF_TIME),
        sim_end=i64(0),
        enq_pos=i32(0),
        static_pos=i32(0),
        dl_pos=i32(0),
        static_order=enqueue_order,
        num_static=jnp.sum(static).astype(jnp.int32),
        enqueue_order=enqueue_order,
        enqueue_rank=jnp.full(n, NOT_ENQUEUED, jnp.int32),
        enqueue_time=enq_t,
        arrival=jnp.where(req.follow_up, -1, req.arrival),
        deadline_order=deadline_order,
        num_deadlines=jnp.sum(has_dl).astype(jnp.int32),
        sess_enqueue=jnp.full(dims.sessions, INF_TIME, jnp.int64),
        sess_req=jnp.full(dims.sessions, -1, jnp.int32),
        sess_seq=jnp.zeros(dims.sessions, jnp.int64),
        sess_deadline=jnp.full(dims.sessions, INF_TIME, jnp.int64),
        sess_live=jnp.full(dims.sessions, -1, jnp.int32),
        follow_ups=i64(0),
        follow_seq=jnp.full(n, -1, jnp.int64),
        win_status=jnp.zeros(w, jnp.int32),
        win_row=jnp.full(w, -1, jnp.int32),
        out_status=jnp.zeros(n, jnp.int32),
        out_ttft=jnp.full(n, -1, jnp.int64),
        out_e2e=jnp.full(n, -1, jnp.int64),
        out_itl_sum=jnp.zeros(n, jnp.int64),
        out_num_itl=jnp.zeros(n, jnp.int64),
        out_sched_delay=jnp.full(n, -1, jnp.int64),
        out_output_tokens=jnp.zeros(n, jnp.int64),
        out_admit_step=jnp.full(n, -1, jnp.int64),
        out_run_first=jnp.full(n, -1, jnp.int64),
        out_run_last=jnp.full(n, -1, jnp.int64),
        out_first_step=jnp.full(n, -1, jnp.int64),
        finished=i64(0),
        exit_req=jnp.full(dims.exit_log, -1, jnp.int32),
        exit_count=i64(0),
        row_req=jnp.full(r, -1, jnp.int32),
        row_state=jnp.zeros(r, jnp.int32),
        row_progress=jnp.zeros(r, jnp.int64),
        row_kv_tokens=jnp.zeros(r, jnp.int64),
        row_offset=jnp.zeros(r, jnp.int64),
        row_new=jnp.zeros(r, jnp.int64),
        row_ttft=jnp.full(r, -1, jnp.int64),
        row_itl_sum=jnp.zeros(r, jnp.int64),
        row_num_itl=jnp.zeros(r, jnp.int64),
        row_sched_delay=jnp.full(r, -1, jnp.int64),
        row_admit_step=jnp.full(r, -1, jnp.int64),
        row_run_first=jnp.full(r, -1, jnp.int64),
        row_run_last=jnp.full(r, -1, jnp.int64),
        row_first_step=jnp.full(r, -1, jnp.int64),
        row_nblocks=jnp.zeros(r, jnp.int32),
        row_blocks=jnp.full((r, dims.blocks_per_request), -1, jnp.int32),
        batch_rows=jnp.full(s, -1, jnp.int32),
        batch_len=i32(0),
        peak_batch_len=i32(0),
        wait_depth_sum=jnp.int64(0),
        fifo_head=i32(0),
        front=jnp.full(dims.preempted_slots, -1, jnp.int32),
        front_len=i32(0),
        window_req=jnp.full(dims.wait_slots, -1, jnp.int32),
        window_key=jnp.full(dims.wait_slots, INF_TIME, jnp.int64),
        wait_len=i32(0),
        block_key=jnp.full(k, NO_KEY, jnp.int64),
        block_ref=jnp.zeros(k, jnp.int32),
        block_free=jnp.arange(k) < total_kv_blocks,
        ring=jnp.full(dims.free_ring, -1, jnp.int32),
        ring_pos=jnp.full(k, -1, jnp.int64),
        ring_head=i64(0),
        ring_tail=i64(0),
        fresh_next=i32(0),
        free_count=total_kv_blocks.astype(jnp.int64),
        group_block=jnp.full((dims.prefix_groups, dims.prefix_blocks), -1, jnp.int32),
        step_sample=jnp.zeros(dims.step_log, jnp.int32),
        step_log_base=i64(0),
        run_req=jnp.full(dims.run_log, -1, jnp.int32),
        run_first=jnp.zeros(dims.run_log, jnp.int64),
        run_last=jnp.zeros(dims.run_log, jnp.int64),
        run_len=i32(0),
        step_start=jnp.zeros(dims.trace_log, jnp.int64),
        step_dur=jnp.zeros(dims.trace_log, jnp.int64),
        step_basis=jnp.zeros((dims.trace_log, 11), jnp.float64),
        lora_slot=jnp.full(dims.lora_slots, -1, jnp.int32),
        lora_ready=jnp.zeros(dims.lora_slots, bool),
        lora_used=jnp.zeros(dims.lora_slots, jnp.int64),
        lora_pins=jnp.zeros(dims.lora_adapters, jnp.int32),
        lora_loads=jnp.zeros(dims.lora_adapters, jnp.int64),
        lora_evictions=jnp.zeros(dims.lora_adapters, jnp.int64),
        lora_loading=i32(-1),
        lora_done=i64(INF_TIME),
        lora_tick=i64(0),
        **cpu_tier.init_arrays(dims),
        row_ahead=jnp.zeros(dims.cpu_rows, jnp.int64),
        preemptions=i64(0),
        kv_hits=i64(0),
        kv_misses=i64(0),
        kv_alloc_failures=i64(0),
        dropped=i64(0),
        timed_out=i64(0),
        length_capped=i64(0),
        total_input_tokens=i64(0),
        steps=i64(0),
        coasted_steps=i64(0),
        events=i64(0),
        result=i32(0),
    )



def window_slot(state: EngineState, r):
    """Window slot of request r (its enqueue position modulo W)."""
    return state.enqueue_rank[r] & (state.win_status.shape[0] - 1)


def status_of(state: EngineState, r):
    return state.win_status[window_slot(state, r)]


def set_status(state: EngineState, r, value, active) -> EngineState:
    slot = jnp.where(active, window_slot(state, r), state.win_status.shape[0])
    return dataclasses.replace(state, win_status=state.win_status.at[slot].set(value, mode="drop"))


def row_of(state: EngineState, r):
    return state.win_row[window_slot(state, r)]


def set_row(state: EngineState, r, row, active) -> EngineState:
    slot = jnp.where(active, window_slot(state, r), state.win_row.shape[0])
    return dataclasses.replace(state, win_row=state.win_row.at[slot].set(row, mode="drop"))


def log_exit(state: EngineState, dims: EngineDims, r, status, active, *, row=None, e2e=-1, output_tokens=0):
    """Write a leaving request's record to the output log (its row's metrics, if it has one)."""
    at = jnp.where(active, r, dims.num_requests)
    upd = dict(
        out_status=state.out_status.at[at].set(status, mode="drop"),
        out_e2e=state.out_e2e.at[at].set(e2e, mode="drop"),
        out_output_tokens=state.out_output_tokens.at[at].set(output_tokens, mode="drop"),
        finished=state.finished + active,
    )
    if row is not None:
        has_row = active & (row >= 0)
        safe = jnp.maximum(row, 0)
        at_row = jnp.where(has_row, r, dims.num_requests)
        upd.update(
            out_ttft=state.out_ttft.at[at_row].set(state.row_ttft[safe], mode="drop"),
            out_itl_sum=state.out_itl_sum.at[at_row].set(state.row_itl_sum[safe], mode="drop"),
            out_num_itl=state.out_num_itl.at[at_row].set(state.row_num_itl[safe], mode="drop"),
            out_sched_delay=state.out_sched_delay.at[at_row].set(state.row_sched_delay[safe], mode="drop"),
            out_admit_step=state.out_admit_step.at[at_row].set(state.row_admit_step[safe], mode="drop"),
            out_run_first=state.out_run_first.at[at_row].set(state.row_run_first[safe], mode="drop"),
            out_run_last=state.out_run_last.at[at_row].set(state.row_run_last[safe], mode="drop"),
            out_first_step=state.out_first_step.at[at_row].set(state.row_first_step[safe], mode="drop"),
        )
    return dataclasses.replace(state, **upd)
