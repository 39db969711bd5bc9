"""`run_sweep`: grid → resolved scenarios → batched engine runs → `SweepTable`.

Every scenario is resolved (workload generated, latency model built) before anything is
simulated, so a bad value anywhere in the grid fails in seconds, not after the first batch.
Single-instance scenarios with always-admit (`ResolvedScenario.single_instance`, as
`blis-jax run` decides) run as lanes of batched programs, and so do the instances of a cluster whose instances
never interact (round-robin, always-admit, no latencies, no PD pools: `cluster/decompose.py`),
merged afterwards; the others run on the cluster engine (`clusters.py`), grouped so that each
structural group compiles once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blis_jax.cluster import decompose, timeline
from blis_jax.engine.params import INF_TIME
from blis_jax.sweep import settings
from blis_jax.sweep.batch import run_lanes
from blis_jax.sweep.clusters import ClusterScenario, run_clusters
from blis_jax.sweep.grid import Grid, ScenarioSpec
from blis_jax.sweep.lane import InstanceLane
from blis_jax.sweep.scaling_batch import simulate_batched
from blis_jax.sweep.progress import SweepProgress
from blis_jax.sweep.shared_runs import run_lanes_shared
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
    shared_runs: bool = True,
) -> SweepTable:
    """Simulate every scenario of `grid` and tabulate the metrics (rows in scenario order).
    `shared_runs`: lanes that differ only in a max-num-seqs their batch never reached are
    simulated once (`shared_runs.py`; identical rows, fewer runs)."""
    specs = select_part(grid.scenarios(), part)
    once = _OnceDiagnostics(diag)
    lanes, clusters, scaled = [], [], []  # (position in specs, lane / cluster scenario / autoscaled scenario)
    split: dict[int, tuple] = {}  # position → (handled_by, members) of a cluster run as independent instances
    request_sets = []
    for k, spec in enumerate(specs):
        scenario = settings.resolve(spec.settings, once, f"{grid.source}: {spec.label}")
        requests = scenario.requests
        if scenario.single_instance:
            lanes.append((k, InstanceLane.of(scenario)))
        elif decompose.independent(scenario.cluster.validate(), requests):
            n = scenario.cluster.num_instances
            horizon = int(scenario.params.horizon_us)
            handled = decompose.route(requests, n, horizon if horizon < INF_TIME else None)
            members = [np.flatnonzero(handled == i) for i in range(n)]
            split[k] = (handled, members)
            for idx in members:
                if len(idx):
                    part = decompose.instance_requests(requests, idx)
                    lanes.append((k, InstanceLane.of(scenario, part, share=1 / n)))
        elif scenario.cluster.validate().effective_autoscaler() is not None and scenario.lora is None:
            scaled.append((k, scenario))  # batched: a grid of autoscaler policies is one program
        else:
            clusters.append((k, ClusterScenario(scenario)))
        request_sets.append(requests)
    if progress is not None:
        progress.total = len(specs)

    def reducer(positions):
        def reduce(i: int, out):
            if positions[i] in split:  # one instance of a cluster: merged below
                return out
            return out.result, scenario_metrics(out, request_sets[positions[i]])
        return reduce

    outcomes: list = [None] * len(specs)
    if lanes:
        positions = [k for k, _ in lanes]
        run = run_lanes_shared if shared_runs else run_lanes
        done = run([lane for _, lane in lanes], reducer(positions), max_batch=max_batch,
                         memory_budget=memory_budget, devices=devices, progress=progress)
        instance_outputs: dict[int, list] = {k: [] for k in split}
        for k, outcome in zip(positions, done):
            if k in split:
                instance_outputs[k].append(outcome)
            else:
                outcomes[k] = outcome
        for k, (handled, members) in split.items():
            out = decompose.merge(iter(instance_outputs[k]), members, handled)
            outcomes[k] = out.result, scenario_metrics(out, request_sets[k])
    if clusters:
        positions = [k for k, _ in clusters]
        done = run_clusters([c for _, c in clusters], reducer(positions), progress=progress,
                            names=[specs[k].index for k in positions], shared_runs=shared_runs)
        for k, outcome in zip(positions, done):
            outcomes[k] = outcome
    timelines = {}
    if scaled:
        for (k, scenario), out in zip(scaled, simulate_batched([s for _, s in scaled], max_batch=max_batch)):
            outcomes[k] = out.result, scenario_metrics(out, request_sets[k])
            if out.instance_entered is not None and out.result == 0:
                timelines[specs[k].index] = timeline.counts(out.instance_entered, int(out.sim_end_us.max(initial=0)))
            if progress is not None:
                progress.finished(1)
    rows = tuple(make_row(spec.index, spec.values, code, metrics)
                 for spec, (code, metrics) in zip(specs, outcomes))
    return SweepTable(axes=grid.axes, rows=rows, timelines=timelines)
