"""The three instance events and the choice of which one fires next.

BLIS orders same-tick events Queued < Step < Timeout (blis-features §2.1); at most one step
is pending; an enqueue on an idle instance starts a step at the same tick. Each handler is a
pure function state -> state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from blis_jax import latency
from blis_jax.engine import batch, coast, cpu_tier, itl_log, kv, lora, offload, results, sessions, transfer, waitqueue
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.params import INF_TIME, EngineParams
from blis_jax.engine.state import (
    COMPLETED,
    DROPPED,
    LENGTH_CAPPED,
    QUEUED,
    ROW_FREE,
    ROW_RESERVED,
    RUNNING,
    TIMED_OUT,
    EngineState,
    RequestArrays,
    log_exit,
    row_of,
    set_row,
    set_status,
    status_of,
)

ENQUEUE, STEP, TIMEOUT, LORA_LOAD = 0, 1, 2, 3


def _next_static_enqueue(state: EngineState):
    n = state.static_order.shape[0]
    r = state.static_order[jnp.minimum(state.static_pos, n - 1)]
    return r, jnp.where(state.static_pos < state.num_static, state.enqueue_time[r], INF_TIME)


def _next_static_timeout(state: EngineState, req: RequestArrays):
    n = state.deadline_order.shape[0]
    r = state.deadline_order[jnp.minimum(state.dl_pos, n - 1)]
    return r, jnp.where(state.dl_pos < state.num_deadlines, req.deadline[r], INF_TIME)


def _next_enqueue_and_timeout(state: EngineState, req: RequestArrays):
    """Times of the next enqueue and of the next timeout (INF_TIME when none)."""
    return (jnp.minimum(_next_static_enqueue(state)[1], sessions.next_pending_round(state)[1]),
            jnp.minimum(_next_static_timeout(state, req)[1], sessions.next_follow_up_timeout(state)[1]))


def next_event(state: EngineState, req: RequestArrays):
    """(kind, time) of the next event; time is INF_TIME when nothing is left. Same-tick order:
    enqueue, LoRA load completion, step, timeout."""
    t_enqueue, t_timeout = _next_enqueue_and_timeout(state, req)
    t_step = jnp.where(state.step_pending, state.next_step, INF_TIME)
    kind = jnp.where(
        (t_enqueue <= t_step) & (t_enqueue <= t_timeout), ENQUEUE, jnp.where(t_step <= t_timeout, STEP, TIMEOUT)
    )
    time = jnp.minimum(jnp.minimum(t_enqueue, t_step), t_timeout)
    if state.lora_slot.shape[0]:
        t_load = state.lora_done
        load_first = (t_load < t_enqueue) & (t_load <= t_step) & (t_load <= t_timeout)
        kind = jnp.where(load_first, LORA_LOAD, kind)
        time = jnp.minimum(time, t_load)
    return kind, time


def lora_load_done(state, dims: EngineDims, active) -> EngineState:
    """AdapterLoadCompletionEvent: the adapter is resident; an idle instance with work steps now."""
    if not dims.lora_slots:
        return state
    state = _advance_clock(state, state.lora_done, active)
    return _ensure_step(lora.load_done(state, active), active)


def _ensure_step(state: EngineState, active) -> EngineState:
    """Work conservation: an idle instance with work starts a step now."""
    start = active & ~state.step_pending & ((state.wait_len > 0) | (state.batch_len > 0))
    return dataclasses.replace(
        state, step_pending=state.step_pending | start, next_step=jnp.where(start, state.now, state.next_step)
    )


def _detach_step_log(state: EngineState):
    """Take the step log (up to megabytes) out of the state while nested loops run: a loop
    carrying it would copy it on entry."""
    return dataclasses.replace(state, step_sample=jnp.zeros((0,), jnp.int32)), state.step_sample


def _advance_clock(state: EngineState, now, active) -> EngineState:
    return dataclasses.replace(
        state,
        now=jnp.where(active, now, state.now),
        sim_end=jnp.where(active, jnp.maximum(state.sim_end, now), state.sim_end),
    )


# Handlers are branch-free: each takes `active` and is a no-op when it is False. The loop body
# runs all three with one of them active, instead of lax.switch/cond, because a conditional
# would copy the whole state (the logs are megabytes) on every event.


def enqueue(state, dims: EngineDims, params: EngineParams, req: RequestArrays, model, active) -> EngineState:
    """QueuedEvent: enqueue guards, then the request joins the wait queue. The request is the
    next static arrival or a session's pending round, whichever comes first (static first on
    a tie: BLIS pushes every static arrival before any follow-up)."""
    n = state.enqueue_order.shape[0]
    pos = jnp.minimum(state.enq_pos, n - 1)
    r_static, t_static = _next_static_enqueue(state)
    round_slot, t_round = sessions.next_pending_round(state)
    from_static = t_static <= t_round
    r = jnp.where(from_static, r_static, state.sess_req[round_slot])
    now = jnp.minimum(t_static, t_round)
    # The request takes window slot pos % W: the slot must not hold a request in flight, and
    # (fcfs) the FIFO part of the queue must span fewer than W positions.
    slot_busy = (state.win_status[pos & (dims.window - 1)] == QUEUED) | (
        state.win_status[pos & (dims.window - 1)] == RUNNING
    )
    if dims.scheduler == "fcfs":
        slot_busy = slot_busy | (state.enq_pos - state.fifo_head >= dims.window)
    overflow = active & slot_busy
    active = active & ~overflow
    state = _advance_clock(state, now, active)
    state = dataclasses.replace(
        state,
        enq_pos=state.enq_pos + active,
        static_pos=state.static_pos + (active & from_static),
        enqueue_order=state.enqueue_order.at[jnp.where(active, pos, n)].set(r, mode="drop"),
        enqueue_rank=state.enqueue_rank.at[jnp.where(active, r, n)].set(pos, mode="drop"),
        result=state.result | jnp.where(overflow, results.WINDOW_FULL, 0).astype(jnp.int32),
    )
    state = sessions.take_pending_round(state, round_slot, active & ~from_static)
    input_len, output_len = req.input_len[r], req.output_len[r]
    # A PD decode sub-request (its prompt's KV reserved here) bypasses the guards (transfer.py).
    held, prefilled = transfer.held_row(state, r) if dims.transfers else (jnp.int32(-1), jnp.asarray(False))
    prefilled = active & prefilled
    mml = params.max_model_len
    too_long = (mml > 0) & ((input_len >= mml) | ((output_len > 0) & (input_len + output_len > mml)))
    too_big = (input_len + dims.block_size - 1) // dims.block_size > params.total_kv_blocks
    dropped = active & ~prefilled & (too_long | too_big)
    deadline = sessions.deadline_of(state, req, r)
    past_due = active & ~prefilled & ~dropped & (deadline > 0) & (deadline <= now)
    queued = active & ~dropped & ~past_due
    status = jnp.where(dropped, DROPPED, jnp.where(past_due, TIMED_OUT, QUEUED))
    state = set_status(state, r, status, active)
    state = set_row(state, r, jnp.where(prefilled, held, -1), active)
    state = log_exit(state, dims, r, status, dropped | past_due)
    state = dataclasses.replace(
        state,
        dropped=state.dropped + dropped,
        timed_out=state.timed_out + past_due,
        total_input_tokens=state.total_input_tokens + jnp.where(active & ~dropped & ~prefilled, input_len, 0),
    )
    state = waitqueue.push_back(state, dims, req, r, queued)
    state = sessions.arm_timeout(state, params, req, r, queued)
    return _ensure_step(state, active)


def timeout(state, dims: EngineDims, params: EngineParams, req: RequestArrays, model, active) -> EngineState:
    """TimeoutEvent: a waiting or running request past its deadline leaves and frees its KV.
    A timeout for a finished (or not yet enqueued) request is discarded without a clock tick.
    The request is the next static deadline or an in-flight follow-up's, ties in enqueue order."""
    r_static, t_static = _next_static_timeout(state, req)
    follow_slot, t_follow = sessions.next_follow_up_timeout(state)
    r_follow = jnp.maximum(state.sess_live[follow_slot], 0)
    from_static = (t_static < t_follow) | (
        (t_static == t_follow) & (state.enqueue_rank[r_static] <= state.enqueue_rank[r_follow]))
    r = jnp.where(from_static, r_static, r_follow)
    state = sessions.disarm_timeout(state, follow_slot, active & ~from_static)
    state, step_sample = _detach_step_log(dataclasses.replace(state, dl_pos=state.dl_pos + (active & from_static)))
    # A request not yet enqueued has no window slot (its slot may hold an older request), and
    # one enqueued W or more positions ago has lost its slot to a newer request: it finished
    # long ago (the enqueue guard keeps in-flight requests within W positions).
    rank = state.enqueue_rank[r]
    enqueued = (rank < state.enq_pos) & (state.enq_pos - rank <= dims.window)
    status = status_of(state, r)
    row = row_of(state, r)
    waiting = active & enqueued & (status == QUEUED)
    running = active & enqueued & (status == RUNNING)
    fires = waiting | running
    has_row = fires & (row >= 0)
    state = _advance_clock(state, sessions.deadline_of(state, req, r), fires)
    state = waitqueue.remove(state, dims, r, waiting)
    reserved = waiting & (row >= 0) & (state.row_state[jnp.maximum(row, 0)] == ROW_RESERVED)
    state = kv.release_row(state, dims, row, running | reserved)
    in_batch = (jnp.arange(dims.batch_slots) < state.batch_len) & (state.batch_rows == row) & has_row
    state = batch.remove_batch_slots(state, dims, in_batch)
    state = log_exit(state, dims, r, TIMED_OUT, fires, row=jnp.where(has_row, row, -1))
    if dims.lora_slots:  # a request admitted once (running or preempted) holds its adapter
        state = lora.pin(state, req.adapter[r], -1, has_row & ~reserved)
    at_row = jnp.where(has_row, row, dims.rows)
    state = dataclasses.replace(
        state,
        timed_out=state.timed_out + fires,
        row_state=state.row_state.at[at_row].set(ROW_FREE, mode="drop"),
        row_req=state.row_req.at[at_row].set(-1, mode="drop"),
        step_sample=step_sample,
    )
    state = set_row(set_status(state, r, TIMED_OUT, fires), r, -1, fires)
    return _ensure_step(state, fires)


def _step_features(state: EngineState, dims: EngineDims, req: RequestArrays):
    slots = jnp.arange(dims.batch_slots)
    valid = slots < state.batch_len
    rows = jnp.maximum(state.batch_rows, 0)
    r = jnp.maximum(state.row_req[rows], 0)
    progress = state.row_progress[rows]
    new = jnp.where(valid, state.row_new[rows], 0)
    return latency.BatchFeatures(
        scheduled=valid & (new > 0),
        is_prefill=progress < req.input_len[r],
        new_tokens=new,
        progress=progress,
        input_len=req.input_len[r],
    )


def _execute(state: EngineState, step_sample, dims: EngineDims, params: EngineParams, req: RequestArrays, model,
             active):
    """Run the formed batch: advance progress, stamp TTFT, log the step's ITL sample."""
    slots = jnp.arange(dims.batch_slots)
    valid = active & (slots < state.batch_len)
    rows = jnp.maximum(state.batch_rows, 0)
    r = jnp.maximum(state.row_req[rows], 0)
    feats = _step_features(state, dims, req)
    step_us = latency.step_time_us(model, feats)
    if dims.lora_slots:   # BLIS: the (integer) step time × the adapter factor, truncated, floor 1
        factor = lora.step_factor(params, req.adapter[r], feats.scheduled)
        step_us = jnp.maximum(jnp.int64(1), latency.truncate_us(step_us.astype(jnp.float64) * factor))
    if dims.cpu_blocks:  # blocks reloaded from the CPU tier while forming this batch
        step_us = step_us + state.cpu_pending_us
        state = dataclasses.replace(state, cpu_pending_us=jnp.where(active, 0, state.cpu_pending_us))
    token_us = latency.output_token_time_us(model)
    progress = state.row_progress[rows]
    input_len = req.input_len[r]
    in_prefill = valid & (progress < input_len)
    decoded = valid & ~in_prefill & (feats.new_tokens > 0)
    prefilled_to = state.row_kv_tokens[rows]
    if dims.cpu_blocks:
        prefilled_to = prefilled_to - state.row_ahead[rows]
    new_progress = jnp.where(in_prefill, prefilled_to, jnp.where(decoded, progress + 1, progress))
    first_token = valid & (new_progress == input_len) & (state.row_ttft[rows] < 0)
    sample = step_us + token_us
    drop_row = lambda mask: jnp.where(mask, rows, dims.rows)  # noqa: E731
    state = dataclasses.replace(
        state,
        row_progress=state.row_progress.at[drop_row(valid)].set(new_progress, mode="drop"),
        row_ttft=state.row_ttft.at[drop_row(first_token)].set(
            state.now + sample + latency.first_token_lag_us(model, step_us) - state.arrival[r], mode="drop"),
        row_first_step=state.row_first_step.at[drop_row(first_token)].set(state.steps, mode="drop"),
        row_num_itl=state.row_num_itl.at[drop_row(decoded)].add(1, mode="drop"),
        row_itl_sum=state.row_itl_sum.at[drop_row(decoded)].add(sample, mode="drop"),
    )
    state, step_sample = itl_log.record_step(state, step_sample, dims, rows, r, decoded, sample, active)
    if dims.trace_steps and model.kind == "trained-physics":
        state = _log_trace(state, dims, model, feats, step_us, active)
    return dataclasses.replace(state, steps=state.steps + active), step_us, step_sample


def _log_trace(state: EngineState, dims: EngineDims, model, feats, step_us, active):
    """Step trace for fitting (fit/schedule.py): start, duration and latency basis per step."""
    at = jnp.where(active, state.steps % dims.trace_log, dims.trace_log)
    return dataclasses.replace(
        state,
        step_start=state.step_start.at[at].set(state.now, mode="drop"),
        step_dur=state.step_dur.at[at].set(step_us, mode="drop"),
        step_basis=state.step_basis.at[at].set(latency.trained_physics_basis_vector(model, feats), mode="drop"),
    )


def _finish_requests(state: EngineState, dims: EngineDims, params: EngineParams, req: RequestArrays, model, step_us,
                     active):
    """Completions (and max_model_len caps), in batch order: final token slot, free KV, E2E."""
    slots = jnp.arange(dims.batch_slots)
    valid = active & (slots < state.batch_len)
    rows = jnp.maximum(state.batch_rows, 0)
    r = jnp.maximum(state.row_req[rows], 0)
    progress = state.row_progress[rows]
    input_len, output_len = req.input_len[r], req.output_len[r]
    done = valid & (progress >= input_len + jnp.maximum(output_len, 1) - 1)
    mml = params.max_model_len
    capped = valid & ~done & (mml > 0) & (progress >= mml - 1)
    leaving = done | capped
    # leaving slots in batch order, compacted to the front
    order = jnp.full(dims.batch_slots, dims.batch_slots).at[
        jnp.where(leaving, jnp.cumsum(leaving) - 1, dims.batch_slots)
    ].set(slots, mode="drop")
    n_leaving = jnp.sum(leaving)
    def more(c, ops):
        return c[0] < ops[0]

    def body(c, ops, on):
        _, params, req, model, order, rows, r, done, progress, input_len, output_len, step_us = ops
        mml, post_us = params.max_model_len, latency.post_decode_time_us(model)
        k, state = c
        slot = jnp.minimum(order[k], dims.batch_slots - 1)
        row, rq = rows[slot], r[slot]
        is_done = done[slot]
        prog = progress[slot]
        out = output_len[slot]
        final_slot = is_done & (out > 0) & (prog < input_len[slot] + out)
        need = kv.blocks_needed(dims, state.row_nblocks[row], state.row_kv_tokens[row], 1, state.row_offset[row])
        can = on & final_slot & (need <= state.free_count)
        state = kv.allocate_rows(state, dims, req, row[None], jnp.ones(1, jnp.int64), can[None], params.total_kv_blocks)
        state = kv.release_row(state, dims, row, on)
        generated = prog - input_len[slot]
        tokens = jnp.where(is_done, generated + (generated < out), mml - 1 - input_len[slot])
        e2e = state.row_ttft[row] + state.row_itl_sum[row] + jnp.where(out > 0, post_us, 0)
        status = jnp.where(is_done, COMPLETED, LENGTH_CAPPED)
        state = log_exit(state, dims, rq, status, on, row=row, e2e=e2e, output_tokens=tokens)
        if dims.lora_slots:
            state = lora.pin(state, req.adapter[rq], -1, on)
        state = set_row(set_status(state, rq, status, on), rq, -1, on)
        state = sessions.on_completion(state, params, req, model, rq, state.now + step_us, on)
        if dims.exit_log > 1:  # a PD cluster starts the KV transfer of a finished prefill (no output)
            logged = on & is_done & (out == 0)
            at = jnp.where(logged, state.exit_count % dims.exit_log, dims.exit_log)
            state = dataclasses.replace(state, exit_req=state.exit_req.at[at].set(rq.astype(jnp.int32), mode="drop"),
                                        exit_count=state.exit_count + logged)
        at_row = jnp.where(on, row, dims.rows)
        return k + on, dataclasses.replace(
            state,
            length_capped=state.length_capped + (on & ~is_done),
            kv_alloc_failures=state.kv_alloc_failures + (on & final_slot & ~can),
            row_state=state.row_state.at[at_row].set(ROW_FREE, mode="drop"),
            row_req=state.row_req.at[at_row].set(-1, mode="drop"),
        )

    _, state = masked_while(more, body, (jnp.int32(0), state),
                            (n_leaving, params, req, model, order, rows, r, done, progress, input_len, output_len,
                             step_us))
    state = batch.remove_batch_slots(state, dims, leaving)
    left_at = state.now + step_us
    return dataclasses.replace(
        state,
        sim_end=jnp.where((n_leaving > 0) & (left_at <= params.horizon_us), jnp.maximum(state.sim_end, left_at), state.sim_end),
    )


def step(state, dims: EngineDims, params: EngineParams, req: RequestArrays, model, active, until=INF_TIME
         ) -> EngineState:
    """StepEvent: form the batch, run it, finish requests, schedule the next step. The plain
    decode steps that follow, before the next other event and `until`, run with it (coast.py)."""
    now = state.next_step
    state = _advance_clock(state, now, active)
    state = dataclasses.replace(state, step_pending=state.step_pending & ~active)
    run = active & ((state.batch_len > 0) | (state.wait_len > 0))
    state = dataclasses.replace(state, row_new=jnp.where(run, 0, state.row_new))
    state, step_sample = _detach_step_log(state)
    if dims.lora_slots:  # the cold-load gate, on the wait-queue head (after ordering, before batching)
        state, head, nonempty = waitqueue.head(state, dims)
        state = lora.gate(state, params, req.adapter[head], run & nonempty)
    state, budget, preempted = batch.schedule_running(state, dims, params, req, run)
    state = batch.admit_waiting(state, dims, params, req, budget, preempted, run)
    # BLIS samples |WaitQ| after batch formation, every step (blis-features §2.4)
    state = dataclasses.replace(state, wait_depth_sum=state.wait_depth_sum + jnp.where(run, state.wait_len, 0))
    state, step_us, step_sample = _execute(state, step_sample, dims, params, req, model, run)
    if dims.offload:  # the offload chain's I/O completions and stores (offload.py)
        state = offload.after_execution(state, dims, params, req, run)
    elif dims.cpu_blocks:  # write-through of the batch's hashed blocks (BLIS MirrorToCPU)
        state = cpu_tier.mirror(state, dims, params, run)
    state = _finish_requests(state, dims, params, req, model, step_us, run)
    waiting = state.wait_len > 0
    if dims.lora_slots:  # an idle instance waits for the adapter load (its completion starts a step)
        waiting = waiting & (state.lora_loading < 0)
    more = run & ((state.batch_len > 0) | waiting)
    following = now + step_us
    if dims.coast_steps > 1 and not dims.trace_steps:  # the step trace logs each step's basis
        t_enqueue, t_timeout = _next_enqueue_and_timeout(state, req)
        t_limit = jnp.minimum(jnp.minimum(t_timeout, until), params.horizon_us + 1)
        state, step_sample, following = coast.decode_run(state, step_sample, dims, params, req, model, following,
                                                         t_enqueue, t_limit, more)
    state = dataclasses.replace(state, step_sample=step_sample)
    return dataclasses.replace(
        state,
        step_pending=state.step_pending | more,
        next_step=jnp.where(more, following, jnp.where(active, INF_TIME, state.next_step)),
    )
