"""The instance wait queue, with O(1) work per operation for the default FCFS scheduler.

FCFS (BLIS's default): the queue is the enqueue order itself — positions
[fifo_head, enq_pos) of `enqueue_order` whose status is still QUEUED — plus a small stack of
preempted requests in front of it (a preempted request is put back at the head; the most
recently preempted is the new head). Timed-out entries in the FIFO part are skipped lazily.

priority-fcfs and sjf re-sort the whole queue every step by a static per-request key, so the
queue is a set ordered by `wait_rank` (computed host-side): a window of waiting requests whose
head is the minimum key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from blis_jax.engine import results
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.params import INF_TIME
from blis_jax.engine.state import QUEUED, EngineState, RequestArrays


def push_back(state: EngineState, dims: EngineDims, req: RequestArrays, r, active) -> EngineState:
    """A newly enqueued request joins the tail (its status must already be QUEUED).
    Every operation here is a no-op unless `active` (handlers are branch-free)."""
    state = dataclasses.replace(state, wait_len=state.wait_len + active)
    if dims.scheduler == "fcfs":
        return state  # already in the FIFO part at its enqueue position
    return _window_insert(state, dims, req, r, active)


def push_front(state: EngineState, dims: EngineDims, req: RequestArrays, r, active) -> EngineState:
    """A preempted request goes back to the head."""
    state = dataclasses.replace(state, wait_len=state.wait_len + active)
    if dims.scheduler != "fcfs":
        return _window_insert(state, dims, req, r, active)
    full = active & (state.front_len >= dims.preempted_slots)
    return dataclasses.replace(
        state,
        front=state.front.at[jnp.where(active, state.front_len, dims.preempted_slots)].set(r, mode="drop"),
        front_len=jnp.minimum(state.front_len + active, dims.preempted_slots),
        result=state.result | jnp.where(full, results.ROWS_FULL, 0).astype(jnp.int32),
    )


def _skip_gone(state: EngineState) -> EngineState:
    # The loop carries the whole state (unchanged but for fifo_head) rather than reading it by
    # closure: a closure capture of `status` would make XLA copy that per-request array.
    def gone(s, _):
        slot = s.fifo_head & (s.win_status.shape[0] - 1)
        if s.off is not None:  # an offload chain's skip-scan admits past the head (offload.py)
            return (s.fifo_head < s.enq_pos) & ((s.win_status[slot] != QUEUED) | s.off.taken[slot])
        return (s.fifo_head < s.enq_pos) & (s.win_status[slot] != QUEUED)

    def passed(s, _, on):
        if s.off is not None:   # the entry is behind the head now: clear its mark for the next use of the slot
            slot = jnp.where(on, s.fifo_head & (s.win_status.shape[0] - 1), s.win_status.shape[0])
            s = dataclasses.replace(s, off=dataclasses.replace(s.off, taken=s.off.taken.at[slot].set(False,
                                                                                                    mode="drop")))
        return dataclasses.replace(s, fifo_head=s.fifo_head + on)

    return masked_while(gone, passed, state)


def head(state: EngineState, dims: EngineDims):
    """(state, request at the head, whether the queue is non-empty)."""
    nonempty = state.wait_len > 0
    if dims.scheduler != "fcfs":
        slot = jnp.argmin(state.window_key)
        return state, state.window_req[slot], nonempty
    state = _skip_gone(state)
    from_front = state.front_len > 0
    fifo_r = state.enqueue_order[jnp.minimum(state.fifo_head, state.enqueue_order.shape[0] - 1)]
    r = jnp.where(from_front, state.front[jnp.maximum(state.front_len - 1, 0)], fifo_r)
    return state, r, nonempty


def pop_head(state: EngineState, dims: EngineDims, active) -> EngineState:
    """Remove the head (call right after `head`)."""
    state = dataclasses.replace(state, wait_len=state.wait_len - active)
    if dims.scheduler != "fcfs":
        slot = jnp.where(active, jnp.argmin(state.window_key), dims.wait_slots)
        return dataclasses.replace(
            state,
            window_key=state.window_key.at[slot].set(INF_TIME, mode="drop"),
            window_req=state.window_req.at[slot].set(-1, mode="drop"),
        )
    from_front = state.front_len > 0
    return dataclasses.replace(
        state,
        front_len=jnp.where(active & from_front, state.front_len - 1, state.front_len),
        fifo_head=jnp.where(active & ~from_front, state.fifo_head + 1, state.fifo_head),
    )


def remove(state: EngineState, dims: EngineDims, r, active) -> EngineState:
    """Take a waiting request out (timeout). FIFO entries are skipped lazily by status."""
    state = dataclasses.replace(state, wait_len=state.wait_len - active)
    if dims.scheduler != "fcfs":
        hit = active & (state.window_req == r)
        return dataclasses.replace(
            state,
            window_key=jnp.where(hit, INF_TIME, state.window_key),
            window_req=jnp.where(hit, -1, state.window_req),
        )
    idx = jnp.arange(dims.preempted_slots)
    keep = (idx < state.front_len) & ~(active & (state.front == r))
    dest = jnp.where(keep, jnp.cumsum(keep) - 1, dims.preempted_slots)
    front = jnp.full_like(state.front, -1).at[dest].set(state.front, mode="drop")
    # untouched when inactive (not even the dead entries past front_len): handlers are no-ops
    return dataclasses.replace(state, front=jnp.where(active, front, state.front),
                               front_len=jnp.where(active, jnp.sum(keep), state.front_len).astype(jnp.int32))


def _window_insert(state: EngineState, dims: EngineDims, req: RequestArrays, r, active) -> EngineState:
    free = state.window_req < 0
    slot = jnp.argmax(free)
    full = active & ~free[slot]
    slot = jnp.where(active & ~full, slot, dims.wait_slots)
    return dataclasses.replace(
        state,
        window_req=state.window_req.at[slot].set(r, mode="drop"),
        window_key=state.window_key.at[slot].set(req.wait_rank[r], mode="drop"),
        result=state.result | jnp.where(full, results.WAIT_WINDOW_FULL, 0).astype(jnp.int32),
    )
