"""Many single-instance runs as one vmapped program, driven in chunks like `simulate_instance`.

Runs whose latency models share a tree structure (kind, beta mode, MoE communication) run in
one batch at dims covering all of them (larger capacities never change what is simulated).
The batch advances in chunks of events; between chunks every lane's ITL log is read, so the
step log stays one chunk long however long the runs are. A lane that overflows a buffer is
rerun alone with grown buffers (as `simulate_instance` does): no lane is silently wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections import defaultdict
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax.engine import results, simulate
from blis_jax.engine.dims import EngineDims, choose_dims, cover
from blis_jax.engine.itl_log import ItlLogReader
from blis_jax.engine.output import SimOutput
from blis_jax.workload.requests import RequestSet
from blis_jax.workload.sessions import SessionLinks, settle_sessions

_LOG_FIELDS = ("steps", "step_log_base", "step_sample", "run_len", "run_req", "run_first", "run_last",
               "step_start", "step_dur", "step_basis")


@functools.partial(jax.jit, static_argnums=0)
def _start(dims, params, req, model):
    return jax.vmap(functools.partial(simulate.start.__wrapped__, dims))(params, req, model)


# Not donated: `start` may return one buffer for two equal leaves (static_order and
# enqueue_order start equal), which donation rejects; a copy per chunk is negligible.
@functools.partial(jax.jit, static_argnums=0)
def _advance(dims, state, params, req, model, event_limit):
    return jax.vmap(functools.partial(simulate.advance.__wrapped__, dims), in_axes=(0, 0, 0, 0, None))(
        state, params, req, model, event_limit)


@jax.jit
def _finished(state, params, req):
    return jnp.all(jax.vmap(simulate.finished)(state, params, req))


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def simulate_many_sessions(
    lanes: Sequence[tuple[RequestSet, SessionLinks | None, object, object]],
    *,
    block_size: int = 16,
    events_per_chunk: int = 200_000,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[RequestSet, SimOutput]]:
    """[(requests that existed, outputs)] for lanes (requests, session links or None, params,
    latency model), in lane order; same results as one `simulate_sessions` per lane."""
    groups: dict = defaultdict(list)
    for k, (_, _, _, model) in enumerate(lanes):
        groups[jax.tree.structure(model)].append(k)
    out: list = [None] * len(lanes)
    for members in groups.values():
        for k, result in zip(members, _run_group([lanes[k] for k in members], block_size, events_per_chunk, progress)):
            out[k] = result
    return out


def _lane_dims(requests: RequestSet, links: SessionLinks | None, params, block_size: int, step_log: int) -> EngineDims:
    return choose_dims(input_len=requests.input_len, output_len=requests.output_len,
                       prefix_group=requests.prefix_group, prefix_len=requests.prefix_len,
                       max_num_seqs=int(params.max_num_seqs), max_num_batched_tokens=int(params.max_num_batched_tokens),
                       total_kv_blocks=int(params.total_kv_blocks), block_size=block_size, step_log=step_log,
                       num_sessions=links.num_sessions if links is not None else 0)


def _run_group(lanes, block_size: int, events_per_chunk: int, progress):
    dims = cover([_lane_dims(r, links, p, block_size, events_per_chunk) for r, links, p, _ in lanes])
    params = _stack([p for _, _, p, _ in lanes])
    req = _stack([simulate.request_arrays(r, dims, links) for r, links, _, _ in lanes])
    model = _stack([m for _, _, _, m in lanes])
    state = _start(dims, params, req, model)
    readers = [ItlLogReader() for _ in lanes]
    limit = 0
    while True:
        limit += events_per_chunk
        state = _advance(dims, state, params, req, model, jnp.int64(limit))
        logs = jax.device_get({name: getattr(state, name) for name in _LOG_FIELDS})
        for k, reader in enumerate(readers):
            reader._collect(types.SimpleNamespace(**{name: v[k] for name, v in logs.items()}))
        state = dataclasses.replace(state, step_log_base=state.steps, run_len=jnp.zeros_like(state.run_len))
        if progress is not None:
            done = int(jnp.sum(state.finished))
            progress(f"{len(lanes)} runs: {done}/{sum(len(r) for r, *_ in lanes)} requests finished, "
                     f"{int(limit)} events per run")
        if bool(_finished(state, params, req)):
            break
    host = jax.device_get(state)
    del state
    outputs = []
    for k, (requests, links, p, m) in enumerate(lanes):
        lane_state = jax.tree.map(lambda x, k=k: x[k], host)
        code = int(lane_state.result)
        if code & results.GROWABLE:
            # rare: rerun this lane alone, growing its buffers
            links = links if links is not None else SessionLinks.none(len(requests))
            outputs.append(simulate.simulate_sessions(requests, links, p, m, block_size=block_size,
                                                      events_per_chunk=events_per_chunk))
            continue
        sim_out = simulate.to_output(lane_state, dims, p, requests, code, readers[k])
        if links is None:
            outputs.append((requests, sim_out))
        else:
            rows, settled = settle_sessions(requests, links, np.asarray(lane_state.arrival)[: len(requests)],
                                            np.asarray(lane_state.pool_user)[: len(requests)])
            outputs.append((settled, sim_out.take(rows)))
    return outputs
