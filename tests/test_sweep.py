"""`blis-jax sweep`: rows equal separate `blis-jax run`s, one compiled program for a grid that
varies only numbers (and a categorical model axis), strict grid validation, sharding over 4
host devices, the compile cache, plots; cluster scenarios (num-instances axis) equal separate
cluster runs and share one program per structural group.

In-process engine runs share two program shapes (the vmapped batch of 8 lanes, forced with
--max-batch 8 since CPU sweeps default to one lane per device, and the `run` driver's), also
shared with tests/test_plan.py: the grids fix total-kv-blocks and the lengths (same seed), and
max-num-seqs stays within one bucket. The 4-device subprocess runs the CPU default (one lane
per device, no vmap), so the two tables also compare the two batch programs. It starts first
so that its compilation overlaps the in-process tests.

The cluster tests use 128 requests (CLUSTER_BASE) and round-robin routing, which the sweep runs
as independent single-instance lanes (cluster/decompose.py); the separate runs' cluster program
has 4 instance slots.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import chex
import pytest
import yaml

from blis_jax.cli import main
from blis_jax.cluster import loop
from blis_jax.cluster import simulate as cluster_sim
from blis_jax.config import load_coefficients
from blis_jax.engine import simulate as sim
from blis_jax.errors import ConfigError
from blis_jax.sweep import batch
from blis_jax.sweep.grid import load_grid, parse_grid
from blis_jax.sweep.lane import InstanceLane
from blis_jax.sweep.runner import run_sweep
from blis_jax.sweep.table import METRICS

REPO = Path(__file__).resolve().parents[1]
MODELS = ["meta-llama/llama-3.1-8b-instruct", "qwen/qwen2.5-7b-instruct"]
# Small scenarios (24 requests) on one engine shape; max-num-seqs 4 saturates near 14 req/s.
BASE = {"num-requests": 24, "total-kv-blocks": 600, "max-num-seqs": 4, "max-num-batched-tokens": 512,
        "prompt-tokens": 150, "prompt-tokens-max": 300, "output-tokens": 30, "output-tokens-max": 60}
GRID = {"base": BASE,
        "axes": {"model": MODELS, "rate": [10, 40], "beta-scale": [1.0, 1.5]},
        "plots": [{"metric": "itl_p99_ms", "x": "beta-scale", "lines": "model"}]}
BASE_FLAGS = [f"--{k}={v}" for k, v in BASE.items()]
# Cluster scenarios: 128 requests; at 30 req/s one instance saturates, four do not.
CLUSTER_BASE = {**BASE, "num-requests": 128}
CLUSTER_GRID = {"base": CLUSTER_BASE, "axes": {"num-instances": [1, 4], "rate": [10, 30]}}


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def write_grid(path: Path, grid: dict) -> Path:
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory) -> Path:
    return write_grid(tmp_path_factory.mktemp("grid") / "small.yaml", GRID)


@pytest.fixture(scope="module")
def sharded_process(tmp_path_factory, grid_file):
    """The same sweep in a subprocess with 4 host devices and a fresh compile cache."""
    d = tmp_path_factory.mktemp("sharded")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "BLIS_JAX_COMPILE_CACHE": str(d / "cache"), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "blis_jax", "sweep", str(grid_file), "--output-dir",
                             str(d / "out"), "--no-plots", "--progress"],
                            cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc, d
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, grid_file, sharded_process):
    out_dir = tmp_path_factory.mktemp("sweep") / "out"
    rc, stdout, stderr = cli("sweep", grid_file, "--output-dir", out_dir, "--progress", "--max-batch", 8)
    assert rc == 0, stderr
    table = json.loads((out_dir / "table.json").read_text())
    return {"dir": out_dir, "table": table, "rows": table["rows"], "stdout": stdout, "stderr": stderr}


def run_metrics(tmp_path: Path, *flags, base=BASE) -> dict:
    """The --metrics-path block of a separate `blis-jax run` (per-request records dropped)."""
    path = tmp_path / "metrics.json"
    rc, _, err = cli("run", *[f"--{k}={v}" for k, v in base.items()], *flags, "--metrics-path", path)
    assert rc == 0, err
    metrics = json.loads(path.read_text())
    metrics.pop("requests")
    assert metrics.pop("instance_id") == "cluster"
    return metrics


def test_rows_equal_separate_runs(sweep, tmp_path):
    rows = sweep["rows"]
    assert [(r["model"], r["rate"], r["beta-scale"]) for r in rows] == [
        (m, rate, s) for m in MODELS for rate in (10, 40) for s in (1.0, 1.5)]  # product order, first axis slowest
    default = load_coefficients()
    scaled = ["--alpha-coeffs", ",".join(map(repr, default.alpha)),
              "--beta-coeffs", ",".join(repr(b * 1.5) for b in default.beta)]
    for row in rows:
        coeffs = scaled if row["beta-scale"] == 1.5 else []  # 1.0: the run's own default fit
        expected = run_metrics(tmp_path, "--model", row["model"], "--rate", row["rate"], *coeffs)
        assert row["result"] == "ok"
        assert {k: row[k] for k in expected} == expected, f"scenario {row['scenario']}"
        assert row["kv_allocation_failures"] == expected.get("kv_allocation_failures", 0)

    # every axis changes the outcome, so the comparison above covers all three
    def differ(key, a, b):
        return any(r[key] == a and s[key] == b and r["ttft_p99_ms"] != s["ttft_p99_ms"]
                   and all(r[k] == s[k] for k in ("model", "rate", "beta-scale") if k != key)
                   for r in rows for s in rows)
    assert differ("model", *MODELS) and differ("rate", 10, 40) and differ("beta-scale", 1.0, 1.5)


def test_table_files_and_columns(sweep):
    table, out_dir = sweep["table"], sweep["dir"]
    assert table["axes"] == ["model", "rate", "beta-scale"]
    assert table["metrics"] == list(METRICS)
    lines = (out_dir / "table.csv").read_text().splitlines()
    assert lines[0].split(",") == ["scenario", "model", "rate", "beta-scale", "result", *METRICS]
    assert len(lines) == 1 + 8
    # CSV cells hold the exact JSON values (shortest round-trip floats)
    first = dict(zip(lines[0].split(","), lines[1].split(",")))
    assert float(first["ttft_p99_ms"]) == table["rows"][0]["ttft_p99_ms"]
    assert "8/8 scenarios" in sweep["stderr"] and "ETA" in sweep["stderr"]
    assert "ttft_p99_ms" in sweep["stdout"] and "wrote" in sweep["stdout"]


def test_plots_written(sweep):
    # the grid's own plot: ITL vs beta-scale, one line per model (rate averaged, with a band)
    png = sweep["dir"] / "itl_p99_ms_vs_beta-scale_by_model.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert sorted(p.name for p in sweep["dir"].glob("*.png")) == [png.name]


def test_no_retrace_when_only_numbers_change(sweep, grid_file, monkeypatch):
    """Other rates, coefficients, batch limit and KV blocks within the same buckets: the grid
    runs on the already compiled program (tracing the engine now fails)."""
    compiled = batch.compiled_programs()
    monkeypatch.setattr(sim, "_body", chex.assert_max_traces(sim._body, n=0))
    chex.clear_trace_counter()
    other = {"base": {**BASE, "max-num-seqs": 6, "total-kv-blocks": 700},
             "axes": {"model": MODELS, "rate": [15, 30], "alpha-scale": [0.5, 2.0]}}
    table = run_sweep(parse_grid(other), max_batch=8)
    assert batch.compiled_programs() == compiled
    assert all(r["result"] == "ok" for r in table.rows)
    before = {r["ttft_p99_ms"] for r in sweep["rows"]}
    assert len({r["ttft_p99_ms"] for r in table.rows} - before) == 8, "the new numbers had no effect"


def test_sharded_equals_unsharded(sweep, sharded_process):
    proc, d = sharded_process
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "on 4 devices" in stderr
    assert (d / "out" / "table.csv").read_text() == (sweep["dir"] / "table.csv").read_text()
    assert (d / "out" / "table.json").read_text() == (sweep["dir"] / "table.json").read_text()
    # the CLI entry point filled the cache it was pointed at (the batch programs are kept whole,
    # compiled, beside it; they bypass JAX's own cache: blis_jax/executables.py)
    assert any((d / "cache-executables").iterdir())


# ------------------------------------------------------------------------------- clusters


@pytest.fixture(scope="module")
def cluster_sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("clusters")
    grid = write_grid(d / "instances.yaml", CLUSTER_GRID)
    compiled = cluster_sim.compiled_programs()
    rc, _, stderr = cli("sweep", grid, "--output-dir", d / "out", "--progress", "--no-plots")
    assert rc == 0, stderr
    return {"dir": d / "out", "rows": json.loads((d / "out" / "table.json").read_text())["rows"], "stderr": stderr,
            "cluster_programs": cluster_sim.compiled_programs() - compiled}


@pytest.mark.slow  # a compiled cluster program (the separate 4-instance runs)
def test_cluster_rows_equal_separate_runs(cluster_sweep, tmp_path):
    """num-instances 1 and 4 with round-robin routing: the sweep runs each instance as a
    single-instance lane (cluster/decompose.py, no cluster program), and every row equals a
    separate `blis-jax run --num-instances N` on the cluster engine."""
    rows = cluster_sweep["rows"]
    assert [(r["num-instances"], r["rate"]) for r in rows] == [(n, rate) for n in (1, 4) for rate in (10, 30)]
    assert cluster_sweep["cluster_programs"] == 0
    for row in rows:
        expected = run_metrics(tmp_path, "--num-instances", row["num-instances"], "--rate", row["rate"],
                               base=CLUSTER_BASE)
        assert row["result"] == "ok"
        assert {k: row[k] for k in expected} == expected, f"scenario {row['scenario']}"
        assert row["kv_allocation_failures"] == expected.get("kv_allocation_failures", 0)
    # the instance count changes the outcome (at 30 req/s: saturated, not at all)
    ttft = {(r["num-instances"], r["rate"]): r["ttft_p99_ms"] for r in rows}
    assert ttft[1, 30] > ttft[4, 30]
    assert "4/4 scenarios" in cluster_sweep["stderr"]


@pytest.mark.slow  # compiles a cluster program (the default run checks no-recompile on lanes)
def test_cluster_no_recompile_when_only_instances_and_numbers_change(monkeypatch):
    """Cluster scenarios that need the cluster engine (a routing latency couples the
    instances): instance counts 2 and 3 (within the 4 slots of the first grid's program), other
    rates, seed and signal delays run on the program compiled for the first grid (tracing the
    loop now fails)."""
    first = {"base": {**CLUSTER_BASE, "routing-latency": 50}, "axes": {"num-instances": [4], "rate": [20]}}
    assert run_sweep(parse_grid(first)).rows[0]["result"] == "ok"
    before = cluster_sim.compiled_programs()
    monkeypatch.setattr(loop, "run_cluster", chex.assert_max_traces(loop.run_cluster, n=0))
    chex.clear_trace_counter()
    other = {"base": {**CLUSTER_BASE, "seed": 7, "snapshot-refresh-interval": 10_000, "routing-latency": 30},
             "axes": {"num-instances": [3, 2], "rate": [15, 25]}}
    table = run_sweep(parse_grid(other))
    assert cluster_sim.compiled_programs() == before
    assert all(r["result"] == "ok" for r in table.rows)
    assert len({r["ttft_p99_ms"] for r in table.rows}) == 4
    assert {r["completed_requests"] for r in table.rows} == {128}


@pytest.mark.slow
def test_cluster_policies_equal_separate_runs(tmp_path):
    """Weighted, least-loaded, token-bucket admission (also on one instance, which is then a
    cluster scenario) and prefill/decode pools, at instance counts below their slots (3 of 4):
    rows equal separate runs. Slow: each policy is its own program, compiled for the sweep and
    for each run. (Several instance counts sharing one group's program: the no-recompile test
    above.)"""
    keys = ("num-instances", "routing-policy", "admission-policy", "prefill-instances", "decode-instances",
            "pd-decider")
    scenarios = [dict(zip(keys, values)) for values in (
        (3, "weighted", "always-admit", 0, 0, "never"),
        (3, "least-loaded", "always-admit", 0, 0, "never"),
        (1, "round-robin", "token-bucket", 0, 0, "never"),
        (3, "round-robin", "always-admit", 1, 2, "always"),
    )]
    base = {**CLUSTER_BASE, "rate": 30, "token-bucket-capacity": 3000, "token-bucket-refill-rate": 2000}
    table = run_sweep(parse_grid({"base": base, "scenarios": scenarios}))
    for row, scenario in zip(table.rows, scenarios):
        flags = [f"--{k}={v}" for k, v in scenario.items()]
        expected = run_metrics(tmp_path, *flags, base=base)
        assert row["result"] == "ok"
        assert {k: row[k] for k in expected} == expected, scenario
    assert table.rows[2]["completed_requests"] < 128  # the bucket rejected some


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("grid, fragments", [
    ({"base": BASE, "axes": {"rate": [1]}, "plot": []}, ["unknown key 'plot'", "did you mean plots"]),
    ({"axes": {"max-num-seq": [8]}}, ["axes.max-num-seq", "unknown setting", "did you mean max-num-seqs"]),
    ({"base": {"rate": "fast"}, "axes": {"seed": [1]}}, ["base.rate", "'fast' must be a finite number"]),
    ({"axes": {"max-num-seqs": [8, 16.5]}}, ["axes.max-num-seqs", "16.5 must be an integer"]),
    ({"axes": {"rate": []}}, ["axes.rate", "non-empty list"]),
    ({"axes": {"rate": 5}}, ["axes.rate", "non-empty list"]),
    ({"axes": {"rate": [5, 5]}}, ["axes.rate", "duplicate value(s) 5"]),
    ({"axes": {"rate": [1]}, "scenarios": [{"rate": 2}]}, ["one of `axes`", "`scenarios`", "not both"]),
    ({"base": [1]}, ["base", "must be a mapping"]),
    ([1, 2], ["the grid must be a mapping"]),
    ({"axes": {"num-instances": [1, 0]}}, ["axes.num-instances", ": 0:", "instances must be an integer in 1..1024"]),
    ({"base": {"num-instances": -1}, "axes": {"rate": [1]}}, ["base.num-instances", ": -1:", "1..1024"]),
    ({"axes": {"num-instances": [2, 2.5]}}, ["axes.num-instances", "2.5 must be an integer"]),
    ({"axes": {"routing-policy": ["weighted", "random"]}}, ["axes.routing-policy", "'random' is not one of",
                                                            "round-robin"]),
    ({"base": {"admission-policy": "token_bucket"}}, ["base.admission-policy", "'token_bucket' is not one of"]),
    ({"base": {"routing-scorers": "queue-depth:1"}, "axes": {"rate": [1]}},
     ["g.yaml: base: routing-scorers is used by routing-policy weighted only", "the policy is round-robin"]),
    ({"base": {"routing-scorers": "queue-depth:1"}, "axes": {"routing-policy": ["weighted", "least-loaded"]}},
     ["scenario 1 (routing-policy=least-loaded): routing-scorers", "routing-policy weighted only"]),
    ({"base": {"routing-policy": "weighted"}, "axes": {"routing-scorers": ["queue-depth:1", "bogus:1"]}},
     ["axes.routing-scorers", "unknown scorer 'bogus'"]),
    ({"axes": {"scheduler": ["fcfs", "lifo"]}}, ["axes.scheduler", "'lifo' is not one of"]),
    ({"axes": {"beta[11]": [1.0]}}, ["axes.beta[11]", "index 11 is out of range"]),
    ({"axes": {"alpha-scale": [1, "x"]}}, ["axes.alpha-scale", "'x' must be a finite number"]),
    ({"base": {"metrics-path": "m.json"}, "axes": {"rate": [1]}}, ["base.metrics-path", "output flag"]),
    ({"base": {"rate": 1}, "axes": {"rate": [2]}}, ["rate is both in base and an axis"]),
    ({"scenarios": [{"rate": 1}, {"seed": 2}]}, ["scenarios[1]", "every entry must set the same keys"]),
    ({"axes": {"rate": [1, 2]}, "plots": [{"metric": "ttft_p99", "x": "rate"}]},
     ["plots[0].metric", "'ttft_p99' is not a metric", "did you mean ttft_p99_ms"]),
    ({"axes": {"rate": [1, 2]}, "plots": [{"metric": "ttft_p99_ms", "x": "seed"}]},
     ["plots[0].x", "'seed' is not an axis", "rate"]),
    ({"axes": {"rate": [1, 2]}, "plots": [{"metric": "ttft_p99_ms", "x": "rate", "color": "red"}]},
     ["plots[0]", "unknown key 'color'"]),
])
def test_bad_grid_is_one_clear_error(grid, fragments):
    with pytest.raises(ConfigError) as e:
        parse_grid(grid, source="g.yaml")
    message = str(e.value)
    assert message.startswith("g.yaml"), message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_scenario_value_fails_before_simulating(monkeypatch):
    """Values that only the run resolution can judge (rate 0, a coefficient axis on roofline)
    fail before any batch is compiled or run, naming the scenario."""
    monkeypatch.setattr(batch, "run_lanes", lambda *a, **k: pytest.fail("simulated a bad grid"))
    with pytest.raises(ConfigError, match=r"scenario 1 \(rate=0\)\.rate 0\.0: must be"):
        run_sweep(parse_grid({"base": BASE, "axes": {"rate": [1, 0]}}))
    grid = parse_grid({"base": {**BASE, "latency-model": "roofline"}, "axes": {"beta-scale": [1.0, 2.0]}})
    with pytest.raises(ConfigError, match=r"scenario 0 \(beta-scale=1.0\): coefficient axes \(beta-scale\) need latency-model trained-physics"):
        run_sweep(grid)


def test_cli_errors_are_one_line(tmp_path):
    rc, out, err = cli("sweep", tmp_path / "missing.yaml")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "cannot read" in err
    bad = write_grid(tmp_path / "bad.yaml", {"axes": {"rate": [1]}, "bogus": 1})
    rc, _, err = cli("sweep", bad)
    assert rc == 2 and err.count("\n") == 1 and "unknown key 'bogus'" in err
    rc, _, err = cli("sweep", write_grid(tmp_path / "ok.yaml", {"axes": {"rate": [1, 2]}}), "--plot", "nope:rate")
    assert rc == 2 and "'nope' is not a metric" in err


def test_grid_file_settings_and_explicit_list(tmp_path):
    """Relative file settings resolve beside the grid; an explicit list keeps its order."""
    spec = tmp_path / "w.yaml"
    spec.write_text("x")
    path = write_grid(tmp_path / "g.yaml", {"base": {"workload-spec": "w.yaml", "max_num_seqs": 8},
                                            "scenarios": [{"rate": 3, "model": MODELS[1]}, {"rate": 1, "model": MODELS[0]}]})
    grid = load_grid(path)
    specs = grid.scenarios()
    assert grid.axes == ("rate", "model")
    assert [s.values for s in specs] == [{"rate": 3, "model": MODELS[1]}, {"rate": 1, "model": MODELS[0]}]
    assert specs[0].settings == {"workload-spec": str(spec), "max-num-seqs": 8, "rate": 3.0, "model": MODELS[1]}


def test_coefficient_axes_fold_into_run_flags():
    default = load_coefficients()
    grid = parse_grid({"axes": {"beta-scale": [2.0], "alpha[1]": [7.5]}})
    (spec,) = grid.scenarios()
    assert spec.settings["alpha-coeffs"] == (default.alpha[0], 7.5, default.alpha[2])
    assert spec.settings["beta-coeffs"] == tuple(b * 2.0 for b in default.beta)
    # blis-jax's first-token lag alpha[3]: a BLIS (3-value) alpha gains the 4th entry
    (spec,) = parse_grid({"axes": {"alpha[3]": [1.0]}}).scenarios()
    assert spec.settings["alpha-coeffs"] == (*default.alpha, 1.0)


@pytest.mark.slow
def test_overflowing_lane_is_rerun_with_grown_dims(tmp_path, monkeypatch):
    """A lane whose first run overflows (here: its in-flight window is made too small for its
    queue) is rerun with that capacity grown, and only that one, and its row equals a plain
    `blis-jax run`. Slow: new programs."""
    from blis_jax.engine.growth import Growth, as_growth

    original = InstanceLane.dims

    def tiny_window(self, growth=1):
        d = original(self, growth)
        return d if as_growth(growth).window > 1 else dataclasses.replace(d, window=4)

    monkeypatch.setattr(InstanceLane, "dims", tiny_window)
    runs = []
    real_collect = batch._collect

    def spy(lanes, chunk, order, state, plan, results, reduce):
        grow, grown = real_collect(lanes, chunk, order, state, plan, results, reduce)
        runs.append((plan.growth, plan.dims.window, len(grow), grown))
        return grow, grown

    monkeypatch.setattr(batch, "_collect", spy)
    (row,) = run_sweep(parse_grid({"base": {**BASE, "rate": 40}})).rows
    assert runs[0][:3] == (Growth(), 4, 1), f"the first run did not overflow: {runs}"
    assert runs[0][3] == Growth(window=4), "only the overflowed capacity grows"
    assert runs[-1][0] == Growth(window=4) and runs[-1][1] > 4 and runs[-1][2] == 0 and row["result"] == "ok"
    expected = run_metrics(tmp_path, "--rate", 40)
    assert {k: row[k] for k in expected} == expected


def test_example_grids_resolve():
    """Every configs/sweeps example is valid down to its resolved scenarios (nothing runs)."""
    from blis_jax.sweep import settings

    class Quiet:
        def warn(self, message):
            pass

    paths = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))
    assert len(paths) >= 4
    for path in paths:
        grid = load_grid(path)
        for spec in grid.scenarios():
            settings.resolve(spec.settings, Quiet(), f"{path.name}: {spec.label}")


def test_part_takes_every_nth_scenario(tmp_path):
    from blis_jax.sweep.runner import select_part

    specs = parse_grid({"axes": {"rate": [1, 2, 3, 4, 5, 6, 7]}}).scenarios()
    assert [s.values["rate"] for s in select_part(specs, (1, 3))] == [2, 5]
    rc, _, err = cli("sweep", write_grid(tmp_path / "g.yaml", {"axes": {"rate": [1]}}), "--part", "3/2")
    assert rc == 2 and "--part '3/2'" in err


@pytest.mark.slow  # three compiled programs (CI time)
def test_a_lane_that_fills_its_starting_batch_slots_is_rerun_wider():
    """Lanes start with few running-batch slots (`InstanceLane.batch_start`); a lane whose batch
    fills them while max-num-seqs allows more stops with BATCH_FULL and is rerun with 4x the
    slots, so its outputs equal a run at max-num-seqs slots."""
    from blis_jax.engine import results
    from blis_jax.engine.params import make_engine_params
    from blis_jax.workload.distribution import DistributionWorkload, GaussianLength, generate_distribution

    codes = []

    class NarrowLane(InstanceLane):
        @staticmethod
        def result_code(state) -> int:
            codes.append(int(state.result))
            return int(state.result)

    workload = DistributionWorkload(rate=40.0, num_requests=60, prompt=GaussianLength(150, 50, 20, 300),
                                    output=GaussianLength(40, 10, 10, 80))
    requests = generate_distribution(workload, seed=3)
    params = make_engine_params(max_num_seqs=32, total_kv_blocks=2000, max_num_batched_tokens=512)
    lane = NarrowLane(requests=requests, params=params, model=sim_model(), batch_start=8)  # the smallest bucket
    narrow = lane.dims()
    assert narrow.batch_slots == 8 and lane.dims(4).batch_slots == 32
    (out,) = batch.run_lanes([lane], lambda _, o: o)
    assert codes == [results.BATCH_FULL, 0]  # the batch wanted a 9th request: rerun with 32 slots
    want = sim.simulate_instance(requests, params, sim_model())
    assert out.result == 0
    for name in ("status", "ttft_us", "e2e_us", "itl_sum_us", "num_itl", "sched_delay_us", "output_tokens"):
        assert (getattr(out, name) == getattr(want, name)).all(), name
    assert (out.itl_pool()[0] == want.itl_pool()[0]).all() and (out.itl_pool()[1] == want.itl_pool()[1]).all()


def sim_model():
    from engine_helpers import latency_model
    return latency_model()


def test_switches_are_true_false_settings():
    """`run` switches (--flow-control, --queue-shedding, --pd-transfer-contention, ...) are
    settings with true / false values: true gives the flag, false leaves it out."""
    from blis_jax.scenario.settings import apply_settings

    grid = parse_grid({"base": {"saturation-detector": "concurrency"},
                       "axes": {"flow-control": [True], "queue-shedding": [False, "true"]}})
    specs = grid.scenarios()
    assert [s.settings["queue-shedding"] for s in specs] == [False, True]
    flows = [apply_settings(s.settings, "grid").cluster.flow_control for s in specs]
    assert [(f.queue_shedding, f.saturation_detector) for f in flows] == [
        (False, "concurrency"), (True, "concurrency")]
    with pytest.raises(ConfigError, match="flow-control: 'yes' must be true or false"):
        parse_grid({"axes": {"flow-control": ["yes"]}})


@pytest.mark.slow  # three cluster programs: 8 slots, the regrown 32, and max-num-seqs for the reference
def test_a_cluster_that_fills_its_starting_batch_slots_is_rerun_wider(monkeypatch):
    """A sweep's cluster scenario starts with few batch slots per instance; a full batch
    (BATCH_FULL) reruns the whole cluster wider, with outputs equal to a run at max-num-seqs."""
    from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster
    from blis_jax.engine import dims as engine_dims
    from blis_jax.engine.params import make_engine_params
    from blis_jax.workload.distribution import DistributionWorkload, GaussianLength, generate_distribution

    workload = DistributionWorkload(rate=80.0, num_requests=120, prompt=GaussianLength(150, 50, 20, 300),
                                    output=GaussianLength(40, 10, 10, 80))
    requests = generate_distribution(workload, seed=3)
    params = make_engine_params(max_num_seqs=32, total_kv_blocks=2000, max_num_batched_tokens=512)
    cluster = ClusterConfig(num_instances=2, routing_policy="weighted", routing_scorers="queue-depth:1",
                            snapshot_refresh_interval_us=0)
    slots = []
    choose = engine_dims.choose_dims

    def spy(*args, **kwargs):
        dims = choose(*args, **kwargs)
        slots.append(dims.batch_slots)
        return dims

    import blis_jax.cluster.simulate as cluster_simulate
    monkeypatch.setattr(cluster_simulate, "choose_dims", spy)
    narrow = simulate_cluster(requests, params, sim_model(), cluster, batch_start=8)
    assert slots == [8, 32], slots  # the first attempt filled its 8 slots
    wide = simulate_cluster(requests, params, sim_model(), cluster)
    assert narrow.result == wide.result == 0
    for name in ("status", "ttft_us", "e2e_us", "itl_sum_us", "num_itl", "sched_delay_us", "handled_by"):
        assert (getattr(narrow, name) == getattr(wide, name)).all(), name
