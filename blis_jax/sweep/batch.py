"""Run many scenario lanes as few jitted, vmapped, sharded batches.

Lanes that can share a compiled program (equal `group_key()`) form a group. The group runs at
one shape that covers every member (`cover` of their own dims; larger capacities never
change what is simulated), split into equal chunks that fit the memory budget and are
sharded over the devices. A lane whose result code reports a buffer overflow is rerun, with
the group's other overflowing lanes, at grown dims (as `simulate_instance` does), so no row
is silently wrong. Outputs are reduced lane by lane (`reduce(index, SimOutput)`) so that only
one lane's SimOutput is alive at a time.

Nothing here knows the engine: lanes bring their dims, inputs, program and output conversion
(`lane.InstanceLane` for one instance; a cluster lane later).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from blis_jax.engine import results as result_codes
from blis_jax.sweep import memory, sharding
from blis_jax.sweep.progress import SweepProgress

MAX_GROWTH = 64  # as simulate_instance: buffers grow ×4 per retry, up to ×64

# Compiled batch programs by (lane program, dims, mesh): one jit object per shape, reused
# across sweeps in a process.
_PROGRAMS: dict[tuple, Callable] = {}


def _program(run: Callable, dims: Hashable, mesh, vectorize: bool) -> Callable:
    """`run(dims, inputs)` over the lanes of a chunk, sharded over the mesh: vmapped, or (one
    lane per device) called on the device's single lane, which XLA:CPU runs several times
    faster than a vmap of width 1 (batched scatters)."""
    key = (run, dims, mesh, vectorize)
    if key not in _PROGRAMS:

        def batched(inputs):
            if vectorize:
                return jax.vmap(lambda x: run(dims, x))(inputs)
            one = run(dims, jax.tree.map(lambda a: a[0], inputs))
            return jax.tree.map(lambda a: a[None], one)

        _PROGRAMS[key] = sharding.shard_batched(batched, mesh)
    return _PROGRAMS[key]


def compiled_programs() -> int:
    """Batch programs compiled so far in this process (for tests and benchmarks)."""
    return sum(fn._cache_size() for fn in _PROGRAMS.values())


@dataclasses.dataclass
class _Plan:
    """Lanes of one group to run at one dims, in chunks of `chunk` lanes."""

    lanes: list[int]
    dims: Hashable
    growth: int
    chunk: int


def run_lanes(
    lanes: Sequence,
    reduce: Callable[[int, Any], Any],
    *,
    max_batch: int | None = None,
    memory_budget: int | None = None,
    devices: Sequence | None = None,
    progress: SweepProgress | None = None,
) -> list:
    """Simulate every lane; returns `[reduce(i, SimOutput of lane i)]` in lane order.

    A lane whose result is still an overflow at the largest growth, or another failure code,
    is reduced with that code in `SimOutput.result` (callers must not use its numbers)."""
    mesh = sharding.scenario_mesh(devices)
    budget = memory_budget if memory_budget is not None else memory.default_budget(list(mesh.devices.flat))
    if max_batch is None and mesh.devices.flat[0].platform == "cpu":
        # XLA:CPU runs a vmapped engine slower than the same lanes one after another (batched
        # scatters; per 1k-request scenario: 13 s at width 8, 2.9 s at width 1, 0.8 s without
        # vmap), so on CPU each device runs one lane at a time; --max-batch overrides.
        max_batch = mesh.size
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, lane in enumerate(lanes):
        groups[lane.group_key()].append(i)
    queue = [_plan(lanes, members, 1, None, max_batch, budget, mesh.size) for members in groups.values()]
    results: list = [None] * len(lanes)
    batch_no = 0
    while queue:
        plan = queue.pop(0)
        retry: list[int] = []
        chunks = [plan.lanes[k:k + plan.chunk] for k in range(0, len(plan.lanes), plan.chunk)]
        for k, chunk in enumerate(chunks):
            batch_no += 1
            if progress is not None:
                later = len(chunks) - 1 - k + sum(math.ceil(len(p.lanes) / p.chunk) for p in queue)
                progress.batch(batch_no, batch_no + later, len(chunk), mesh.size)
            grow = _run_chunk(lanes, chunk, plan, mesh, results, reduce)
            retry += grow
            if progress is not None:
                progress.finished(sum(getattr(lanes[i], "share", 1.0) for i in chunk if i not in grow))
        if retry:
            queue.append(_plan(lanes, retry, plan.growth * 4, plan.dims, max_batch, budget, mesh.size))
    return results


def _plan(lanes, members: list[int], growth: int, floor, max_batch, budget, ndev) -> _Plan:
    """Dims covering `members` (and `floor`), and the chunk size the memory budget allows."""
    members = sorted(members, key=lambda i: lanes[i].work())
    kind = type(lanes[members[0]])
    dims = kind.cover([lanes[i].dims(growth) for i in members] + ([floor] if floor is not None else []))
    sample = lanes[members[-1]]
    per_lane = memory.COPIES_PER_LANE * kind.state_bytes(dims, sample.inputs(dims))
    fit = max(1, budget // max(per_lane, 1))
    if max_batch is not None:
        fit = min(fit, max_batch)
    per_device = max(1, fit // ndev)
    n_chunks = math.ceil(len(members) / (per_device * ndev))
    chunk = math.ceil(len(members) / n_chunks)
    chunk = math.ceil(chunk / ndev) * ndev  # every device gets the same number of lanes
    return _Plan(lanes=members, dims=dims, growth=growth, chunk=chunk)


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def _run_chunk(lanes, chunk: list[int], plan: _Plan, mesh, results: list, reduce) -> list[int]:
    """Run one chunk (padded to `plan.chunk` lanes with copies of its last lane, so that every
    chunk of a plan has one shape), reduce the lanes that are done, and return the lanes to
    rerun with grown buffers."""
    padded = chunk + [chunk[-1]] * (plan.chunk - len(chunk))
    kind = type(lanes[chunk[0]])
    inputs = _stack([lanes[i].inputs(plan.dims) for i in padded])
    state = _program(kind.run, plan.dims, mesh, plan.chunk > mesh.size)(sharding.put(inputs, mesh))
    host = jax.device_get(state)
    del state
    grow = []
    for j, i in enumerate(chunk):
        lane_state = jax.tree.map(lambda x, j=j: x[j], host)
        code = kind.result_code(lane_state)
        if code & result_codes.GROWABLE and plan.growth < MAX_GROWTH:
            grow.append(i)
            continue
        results[i] = reduce(i, lanes[i].output(lane_state, plan.dims, code))
    return grow
