"""Scenario grids (`blis-jax sweep`) and capacity plans (`blis-jax plan`).

    grid YAML ──grid──▶ ScenarioSpec (run settings) ──settings──▶ resolved like `blis-jax run`
        ──lane──▶ InstanceLane ──batch──▶ jitted, vmapped, sharded chunks ─┐
        ──clusters──▶ ClusterScenario ──▶ simulate_cluster, one program per group ─┴─table──▶ SweepTable
        ──▶ CSV / JSON (table), PNG (plots), SLO answers (plan)

See docs/SWEEPS.md.
"""

from blis_jax.sweep.batch import run_lanes as run_lanes
from blis_jax.sweep.clusters import ClusterScenario as ClusterScenario
from blis_jax.sweep.grid import Grid as Grid
from blis_jax.sweep.grid import load_grid as load_grid
from blis_jax.sweep.grid import parse_grid as parse_grid
from blis_jax.sweep.lane import InstanceLane as InstanceLane
from blis_jax.sweep.plan import evaluate as evaluate
from blis_jax.sweep.plan import parse_slo as parse_slo
from blis_jax.sweep.runner import run_sweep as run_sweep
from blis_jax.sweep.table import SweepTable as SweepTable
