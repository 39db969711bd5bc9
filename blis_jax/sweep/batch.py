"""Run many scenario lanes as few jitted, vmapped, sharded batches.

Lanes that can share a compiled program (equal `group_key()`) form a group. The group runs at
one shape that covers every member (`cover` of their own dims; larger capacities never
change what is simulated), split into chunks that fit the memory budget and are sharded over
the devices: vmapped on accelerators, several lanes one after another per device on CPU. The
next chunk is dispatched before the last one's outputs are read. A lane whose result code
reports a buffer overflow is rerun, with the group's other overflowing lanes, at grown dims
(as `simulate_instance` does), so no row is silently wrong. Outputs are reduced lane by lane
(`reduce(index, SimOutput)`) so that only one lane's SimOutput is alive at a time.

Nothing here knows the engine: lanes bring their dims, inputs, program and output conversion
(`lane.InstanceLane` for one instance; a cluster lane later).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from blis_jax import executables
from blis_jax.engine.growth import Growth
from blis_jax.sweep import memory, sharding
from blis_jax.sweep.progress import SweepProgress


# Compiled batch programs by (lane program, dims, mesh): one jit object per shape, reused
# across sweeps in a process.
_PROGRAMS: dict[tuple, Callable] = {}
_LANE_PROGRAMS: dict[tuple, Callable] = {}


def _program(run: Callable, dims: Hashable, mesh, mode: str) -> Callable:
    """`run(dims, inputs)` over the lanes of a chunk, sharded over the mesh: vmapped
    (`"vmap"`), or run one after another on each device (`"map"`; `"one"` for one lane per
    device), which XLA:CPU runs several times faster than a vmap (batched scatters), with one
    dispatch per chunk."""
    key = (run, dims, mesh, mode)
    if key not in _PROGRAMS:
        # one jit per lane program, so that the programs of one dims trace the engine once
        if (run, dims) not in _LANE_PROGRAMS:
            _LANE_PROGRAMS[(run, dims)] = jax.jit(functools.partial(run, dims))
        lane = _LANE_PROGRAMS[(run, dims)]

        def batched(inputs):
            if mode == "vmap":
                return jax.vmap(lane)(inputs)
            if mode == "one":  # the device's single lane, without a loop around it
                return jax.tree.map(lambda a: a[None], lane(jax.tree.map(lambda a: a[0], inputs)))
            return jax.lax.map(lane, inputs)

        _PROGRAMS[key] = sharding.shard_batched(batched, mesh)
    return _PROGRAMS[key]


def compiled_programs() -> int:
    """Batch programs compiled (or loaded from disk) so far in this process (for tests and
    benchmarks)."""
    return sum(fn._cache_size() for fn in _PROGRAMS.values()) + executables.loaded_programs()


@dataclasses.dataclass
class _Plan:
    """Lanes of one group to run at one dims, in chunks of `chunk` lanes (vmapped or mapped)."""

    lanes: list[int]
    dims: Hashable
    growth: Growth
    chunk: int
    mode: str


# XLA:CPU runs a vmapped engine slower than the same lanes one after another (batched
# scatters; per 1k-request scenario: 13 s at width 8, 2.9 s at width 1, 0.8 s without vmap), so
# on CPU each device runs its lanes of a chunk one after another, this many per chunk (unless
# the lane type sets `cpu_lanes_per_device`): enough that the per-chunk dispatch, transfer and
# lockstep wait are shared by several lanes.
CPU_LANES_PER_DEVICE = 8


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
    mode = "vmap"
    if max_batch is None and mesh.devices.flat[0].platform == "cpu":  # --max-batch asks for a vmap
        mode = "map"
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, lane in enumerate(lanes):
        groups[lane.group_key()].append(i)
    queue = [_plan(lanes, members, Growth(), None, max_batch, budget, mesh.size, mode) for members in groups.values()]
    results: list = [None] * len(lanes)
    batch_no = progress.batches if progress is not None else 0  # numbering goes on across calls
    while queue:
        plan = queue.pop(0)
        retry: list[int] = []
        retry_growth = plan.growth
        chunks = _chunks(plan)
        in_flight = None
        # The next chunk is dispatched before the last one's outputs are read, so the host's
        # work on outputs overlaps the devices' simulation.
        for k, chunk in enumerate(chunks + [None]):
            launched = None
            if chunk is not None:
                batch_no += 1
                if progress is not None:
                    later = len(chunks) - 1 - k + sum(len(_chunks(p)) for p in queue)
                    progress.batch(batch_no, batch_no + later, len(chunk), mesh.size)
                launched = _launch(lanes, chunk, plan, mesh)
            if in_flight is not None:
                done_chunk = in_flight[0]
                grow, grown = _collect(lanes, *in_flight, plan, results, reduce)
                retry += grow
                retry_growth = retry_growth.join(grown)
                if progress is not None:
                    progress.finished(sum(getattr(lanes[i], "share", 1.0) for i in done_chunk if i not in grow))
            in_flight = launched
        if retry:
            queue.append(_plan(lanes, retry, retry_growth, plan.dims, max_batch, budget, mesh.size, plan.mode))
    return results


def _plan(lanes, members: list[int], growth: Growth, floor, max_batch, budget, ndev, mode) -> _Plan:
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
    if mode == "map":  # a fixed number of lanes per device (one program; the last chunk is padded)
        per_device = min(per_device, getattr(kind, "cpu_lanes_per_device", CPU_LANES_PER_DEVICE))
        return _Plan(lanes=members, dims=dims, growth=growth, chunk=per_device * ndev, mode="map")
    n_chunks = math.ceil(len(members) / (per_device * ndev))
    chunk = math.ceil(len(members) / n_chunks)
    chunk = math.ceil(chunk / ndev) * ndev  # every device gets the same number of lanes
    return _Plan(lanes=members, dims=dims, growth=growth, chunk=chunk, mode="vmap" if chunk > ndev else "map")


def _chunks(plan: _Plan) -> list[list[int]]:
    return [plan.lanes[k:k + plan.chunk] for k in range(0, len(plan.lanes), plan.chunk)]


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def _launch(lanes, chunk: list[int], plan: _Plan, mesh):
    """Dispatch one chunk, padded to `plan.chunk` lanes so that every chunk of a plan has one
    shape: vmapped, with copies of its last lane (a vmapped loop runs until its slowest lane
    anyway); mapped, with idle lanes (no requests: done at once). Returns (chunk, the lane of
    each position or None for an idle one, device state)."""
    ndev = mesh.size
    pad = plan.chunk - len(chunk)
    if plan.mode == "vmap":
        padded = chunk + [chunk[-1]] * pad
        # position k·ndev + d of the sorted chunk goes to device d, or to device ndev-1-d in odd
        # rounds (a snake: no device gets the longer lane of every round)
        order = [padded[k * ndev + (d if k % 2 == 0 else ndev - 1 - d)] for d in range(ndev)
                 for k in range(plan.chunk // ndev)]
    else:
        order = _deal_longest_first(lanes, chunk, ndev, plan.chunk // ndev)
    kind = type(lanes[chunk[0]])
    built = {i: lanes[i].inputs(plan.dims) for i in chunk}
    idle = kind.idle(built[chunk[-1]]) if None in order else None
    inputs = _stack([built[i] if i is not None else idle for i in order])
    mode = "one" if plan.mode == "map" and plan.chunk == ndev else plan.mode
    name = f"{kind.run.__module__}.{kind.run.__qualname__} {plan.dims!r} {mode}"
    state = executables.call(_program(kind.run, plan.dims, mesh, mode), name, sharding.put(inputs, mesh))
    return chunk, order, state


def _deal_longest_first(lanes, chunk: list[int], ndev: int, per_device: int) -> list[int | None]:
    """Positions of a mapped chunk (device d runs positions d·per_device onwards, one lane after
    another, independently of the other devices): each lane, longest first by `work()`, goes
    to the device with the least work so far that has a free position; the rest are idle. A
    snake deal of the sorted chunk can leave one long lane on top of an even share (the golden
    set: docs/ACCURACY.md)."""
    work = {i: lanes[i].work() for i in chunk}
    load = [0.0] * ndev
    dealt: list[list[int | None]] = [[] for _ in range(ndev)]
    for i in sorted(chunk, key=work.__getitem__, reverse=True):
        d = min((d for d in range(ndev) if len(dealt[d]) < per_device), key=lambda d: load[d])
        dealt[d].append(i)
        load[d] += work[i]
    return [pos for device in dealt for pos in device + [None] * (per_device - len(device))]


def _collect(lanes, chunk: list[int], order: list[int], state, plan: _Plan, results: list,
             reduce) -> tuple[list[int], Growth]:
    """Reduce the lanes of a launched chunk that are done; returns the lanes to rerun with
    grown buffers, and the growth that covers what each of them overflowed."""
    host = jax.device_get(state)
    del state
    kind = type(lanes[chunk[0]])
    position = {i: j for j, i in reversed(list(enumerate(order))) if i is not None}
    grow, grown = [], plan.growth
    for i in chunk:
        lane_state = jax.tree.map(lambda x, j=position[i]: x[j], host)
        code = kind.result_code(lane_state)
        after = plan.growth.after(code)
        if after is not None:
            grow.append(i)
            grown = grown.join(after)
            continue
        results[i] = reduce(i, lanes[i].output(lane_state, plan.dims, code))
    return grow, grown
