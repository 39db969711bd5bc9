"""`run_sweep`: grid → resolved scenarios → batched engine runs → `SweepTable`.

Every scenario is resolved (workload generated, latency model built) before anything is
simulated, so a bad value anywhere in the grid fails in seconds, not after the first batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from blis_jax.sweep import settings
from blis_jax.sweep.batch import run_lanes
from blis_jax.sweep.grid import Grid, ScenarioSpec
from blis_jax.sweep.lane import InstanceLane
from blis_jax.sweep.progress import SweepProgress
from blis_jax.sweep.table import SweepTable, make_row, scenario_metrics


class _OnceDiagnostics:
    """Forwards each distinct warning once (a grid repeats the same warning per scenario)."""

    def __init__(self, diag) -> None:
        self.diag, self.seen = diag, set()

    def warn(self, message: str) -> None:
        if self.diag is not None and message not in self.seen:
            self.seen.add(message)
            self.diag.warn(message)


def select_part(specs: list[ScenarioSpec], part: tuple[int, int] | None) -> list[ScenarioSpec]:
    """Scenarios of part k of n (index % n == k): one host's share in a multi-host sweep."""
    if part is None:
        return specs
    k, n = part
    return [s for s in specs if s.index % n == k]


def run_sweep(
    grid: Grid,
    *,
    diag=None,
    max_batch: int | None = None,
    memory_budget: int | None = None,
    devices: Sequence | None = None,
    progress: SweepProgress | None = None,
    part: tuple[int, int] | None = None,
) -> SweepTable:
    """Simulate every scenario of `grid` and tabulate the metrics (rows in scenario order)."""
    specs = select_part(grid.scenarios(), part)
    once = _OnceDiagnostics(diag)
    lanes, request_sets = [], []
    for spec in specs:
        scenario, requests, params = settings.resolve(spec.settings, once, f"{grid.source}: {spec.label}")
        lanes.append(InstanceLane(requests=requests, params=params, model=scenario.latency_model,
                                  block_size=scenario.block_size, scheduler=scenario.scheduler,
                                  preemption_policy=scenario.preemption_policy))
        request_sets.append(requests)
    if progress is not None:
        progress.total = len(lanes)

    def reduce(i: int, out):
        return out.result, scenario_metrics(out, request_sets[i])

    outcomes = run_lanes(lanes, reduce, max_batch=max_batch, memory_budget=memory_budget, devices=devices,
                         progress=progress)
    rows = tuple(make_row(spec.index, spec.values, code, metrics)
                 for spec, (code, metrics) in zip(specs, outcomes))
    return SweepTable(axes=grid.axes, rows=rows)
