"""engine/inbox.py: a cluster instance's routed requests stay in (enqueue time, routing order)
order, whatever order their enqueue times come in; one that would have to go further back
than the insertion window is an overflow result, not a misordering."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.engine import inbox, results
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.params import INF_TIME
from blis_jax.engine.state import RequestArrays, init_state

N = 64


def empty_instance(window: int):
    dims = EngineDims(num_requests=N, batch_slots=8, preempted_slots=8, kv_blocks=16, blocks_per_request=4,
                      alloc_blocks=16, row_alloc_blocks=8, free_ring=32, prefix_groups=1, prefix_blocks=1,
                      step_log=8, run_log=8, block_size=16, inbox=window)
    z = jnp.zeros(N, jnp.int64)
    values = dict(arrival=z, input_len=z + 1, output_len=z, deadline=z, prefix_group=jnp.full(N, -1, jnp.int32),
                  shared_blocks=z, priority=z, wait_rank=z, follow_up=jnp.zeros(N, bool),
                  next_round=jnp.full(N, -1, jnp.int32), think_time=z, follow_timeout=z,
                  session_slot=jnp.full(N, -1, jnp.int32), follow_budget=jnp.asarray(-1, jnp.int64),
                  adapter=jnp.full(N, -1, jnp.int32), valid=jnp.ones(N, bool))
    req = RequestArrays(**{f.name: values[f.name] for f in dataclasses.fields(RequestArrays)})
    state = init_state(dims, req, jnp.full(N, INF_TIME, jnp.int64), jnp.asarray(INF_TIME), jnp.asarray(16))
    return dims, inbox.empty(state)


def pending(state) -> list[int]:
    return np.asarray(state.static_order)[int(state.static_pos):int(state.num_static)].tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_arrival_order_gives_the_sorted_order(seed):
    dims, state = empty_instance(window=64)
    times = np.random.default_rng(seed).integers(0, 20, 40)  # many ties: routing order breaks them
    inject = jax.jit(inbox.inject, static_argnums=1)
    for r, t in enumerate(times):
        state = inject(state, dims, jnp.int32(r), jnp.int64(t), jnp.asarray(True))
    assert int(state.result) == 0
    assert pending(state) == sorted(range(len(times)), key=lambda r: (times[r], r))


def test_monotone_times_append_past_the_window():
    dims, state = empty_instance(window=4)
    for r in range(30):
        state = inbox.inject(state, dims, jnp.int32(r), jnp.int64(10 * r), jnp.asarray(True))
    assert int(state.result) == 0 and pending(state) == list(range(30))


def test_insertion_inside_the_window_then_overflow_beyond_it():
    dims, state = empty_instance(window=4)
    for r in range(10):
        state = inbox.inject(state, dims, jnp.int32(r), jnp.int64(10 * r), jnp.asarray(True))
    state = inbox.inject(state, dims, jnp.int32(10), jnp.int64(65), jnp.asarray(True))  # among the last 4
    assert int(state.result) == 0
    assert pending(state) == [0, 1, 2, 3, 4, 5, 6, 10, 7, 8, 9]
    state = inbox.inject(state, dims, jnp.int32(11), jnp.int64(5), jnp.asarray(True))  # far back
    assert int(state.result) & results.INBOX_FULL
    assert 11 not in pending(state)
