"""A cluster instance's inbox: requests routed to it that await their enqueue.

A single instance knows its whole arrival sequence up front (`static_order`, sorted by enqueue
time at `start`). In a cluster the router decides at run time which instance serves a request,
so an instance starts with an empty static order and the router appends to it (`inject`).
The enqueue time is the routing time plus the latency model's queueing delay, which may depend
on the prompt length (roofline's α1), so a later routing can enqueue first: `inject` inserts
into the pending part (positions `static_pos..num_static`) in (enqueue time, routing order)
order, BLIS's event-heap order for same-instance QueuedEvents. The pending part is short (the
requests routed within one queueing delay); more than `dims.inbox` pending is an overflow
result (the driver regrows), never a misordering.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from blis_jax.engine import results
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.state import EngineState


def empty(state: EngineState) -> EngineState:
    """An instance that has been routed nothing yet (its deadline order stays global: a
    timeout of a request served elsewhere is discarded like that of a finished one)."""
    return dataclasses.replace(state, num_static=jnp.asarray(0, jnp.int32))


def inject(state: EngineState, dims: EngineDims, r, enqueue_time, active) -> EngineState:
    """Request `r`, routed here, will enqueue at `enqueue_time`."""
    n, p = state.static_order.shape[0], dims.inbox
    k = jnp.arange(p)
    pos = state.static_pos + k
    pending = state.num_static - state.static_pos
    old = state.static_order[jnp.minimum(pos, n - 1)]
    old_t = jnp.where(k < pending, state.enqueue_time[old], jnp.iinfo(jnp.int64).max)
    at = jnp.sum(old_t <= enqueue_time)  # after every pending request due at the same time
    shifted = jnp.concatenate([old[:1], old[:-1]])
    new = jnp.where(k < at, old, jnp.where(k == at, r, shifted)).astype(jnp.int32)
    full = active & (pending >= p)
    ok = active & ~full
    write = jnp.where(ok & (k <= pending), pos, n)
    return dataclasses.replace(
        state,
        static_order=state.static_order.at[write].set(new, mode="drop"),
        num_static=state.num_static + ok,
        enqueue_time=state.enqueue_time.at[jnp.where(ok, r, n)].set(enqueue_time, mode="drop"),
        result=state.result | jnp.where(full, results.INBOX_FULL, 0).astype(jnp.int32),
    )
