"""A cluster instance's inbox: requests routed to it that await their enqueue.

A single instance knows its whole arrival sequence up front (`static_order`, sorted by enqueue
time at `start`). In a cluster the router decides at run time which instance serves a request,
so an instance starts with an empty static order and the router appends to it (`inject`).
The enqueue time is the routing time plus the latency model's queueing delay, which may depend
on the prompt length (roofline's α1), so a later routing can enqueue first: `inject` keeps the
pending part (positions `static_pos..num_static`) in (enqueue time, routing order) order,
BLIS's event-heap order for same-instance QueuedEvents. The common case (enqueue times that do
not decrease in routing order, e.g. a constant queueing delay) appends; otherwise the request
is inserted among the last `dims.inbox` pending ones, and one that would have to go further
back is an overflow result (the driver regrows), never a misordering.
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
    end = state.num_static
    # the window: the last p pending positions (fewer when fewer are pending)
    first = jnp.maximum(end - p, state.static_pos)
    k = jnp.arange(p)
    pos = first + k
    in_window = pos < end
    old = state.static_order[jnp.clip(pos, 0, n - 1)]
    old_t = jnp.where(in_window, state.enqueue_time[old], jnp.iinfo(jnp.int64).min)
    later = in_window & (old_t > enqueue_time)  # it goes before these (after equal times)
    at = jnp.where(jnp.any(later), jnp.argmax(later), end - first)
    too_far = active & jnp.any(later) & (at == 0) & (first > state.static_pos) \
        & (state.enqueue_time[state.static_order[jnp.clip(first - 1, 0, n - 1)]] > enqueue_time)
    ok = active & ~too_far
    # positions first..end: entries before `at` stay, r goes to `at`, the rest shift by one
    shifted = jnp.concatenate([old[:1], old[:-1]])
    window_new = jnp.where(k < at, old, jnp.where(k == at, r, shifted)).astype(jnp.int32)
    write = jnp.where(ok & (pos <= end), pos, n)
    last_new = jnp.where(at < end - first, old[jnp.clip(end - first - 1, 0, p - 1)], r).astype(jnp.int32)
    # the entry pushed out of the window's top lands at `end` (when the window is full)
    spill = jnp.where(ok & (end - first >= p), end, n)
    return dataclasses.replace(
        state,
        static_order=state.static_order.at[write].set(window_new, mode="drop").at[spill].set(last_new, mode="drop"),
        num_static=state.num_static + ok,
        enqueue_time=state.enqueue_time.at[jnp.where(ok, r, n)].set(enqueue_time, mode="drop"),
        result=state.result | jnp.where(too_far, results.INBOX_FULL, 0).astype(jnp.int32),
    )
