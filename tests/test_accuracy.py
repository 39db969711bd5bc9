"""Real-trace accuracy (`blis_jax/fit/real_traces.py`, `benchmarks/accuracy.py`): pairing,
per-stage statistics, the cache-fill step and the issue-22 loss, on a slice of the real codegen
trace (rows 0-149 of stage 0 and 3000-3049 of stage 1), checked against numpy computations made
here from the raw CSV; the real runs as `fit` observations. The replay test (slow) simulates the
slice with iter29 (the engine `replay` runs) and checks the lane the benchmark uses gives the same
per-request times.
"""

from __future__ import annotations

import csv
import json
import math
import shutil

import numpy as np
import pytest
from shared_data import REFERENCE, needs

from blis_jax import calibrate
from blis_jax.errors import ConfigError
from blis_jax.fit import real_traces

RUNS = REFERENCE / "observed" / "requests"
CODEGEN = RUNS / "20260217-155451-llama-2-7b-tp1-codegen"
SLICE = [*range(0, 150), *range(3000, 3050)]
pytestmark = needs(CODEGEN, "real request traces")


@pytest.fixture(scope="module")
def slice_folder(tmp_path_factory):
    """A run folder holding the slice: case.json and trace.yaml as they are, 200 CSV rows."""
    folder = tmp_path_factory.mktemp("codegen-slice")
    shutil.copy(CODEGEN / "case.json", folder / "case.json")
    shutil.copy(CODEGEN / "trace.yaml", folder / "trace.yaml")
    lines = (CODEGEN / "trace.csv").read_text().splitlines()
    (folder / "trace.csv").write_text("\n".join([lines[0], *(lines[1 + i] for i in SLICE)]) + "\n")
    return folder


@pytest.fixture(scope="module")
def raw(slice_folder):
    """The slice read with the csv module: observed TTFT / E2E in ms, stage, prompt length."""
    with open(slice_folder / "trace.csv") as f:
        rows = list(csv.DictReader(f))
    send = np.array([int(r["send_time_us"]) for r in rows])
    return {"id": np.array([int(r["request_id"]) for r in rows]), "send": send,
            "ttft": (np.array([int(r["first_chunk_time_us"]) for r in rows]) - send) / 1000.0,
            "e2e": (np.array([int(r["last_chunk_time_us"]) for r in rows]) - send) / 1000.0,
            "stage": np.array([r["client_id"] for r in rows]),
            "input": np.array([int(r["input_tokens"]) for r in rows])}


def _pct(values, q):
    """Linear-interpolation percentile by hand: rank q/100·(n−1)."""
    v = np.sort(values)
    rank = q / 100 * (len(v) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def _expected_row(obs: dict, sim: dict, rows: np.ndarray) -> dict:
    out = {"pairs": int(rows.sum())}
    for m in ("ttft", "e2e"):
        o, s = obs[m][rows], sim[m][rows]
        out[f"{m}_mean_obs_ms"], out[f"{m}_mean_sim_ms"] = o.sum() / len(o), s.sum() / len(s)
        for q in (50, 90, 99):
            out[f"{m}_p{q}_obs_ms"], out[f"{m}_p{q}_sim_ms"] = _pct(o, q), _pct(s, q)
        out[f"{m}_mape_pct"] = 100.0 * np.mean(np.abs(s - o) / o)
    return out


def _check_row(row: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-12, abs=1e-9), key


# ------------------------------------------------------------------- pairing and statistics


def test_pairing_and_stage_statistics_match_a_computation_from_the_csv(slice_folder, raw):
    """A made-up simulation (shuffled, with missing and extra requests) of the real slice:
    every figure of every row equals numpy on the raw CSV columns."""
    run = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml", prefix_mode="none")
    n = len(raw["id"])
    rng = np.random.default_rng(7)
    sim_ttft = raw["ttft"] * rng.uniform(0.5, 1.5, n)
    sim_e2e = raw["e2e"] * rng.uniform(0.8, 1.3, n)
    missing = np.zeros(n, dtype=bool)
    missing[[3, 120, 170]] = True  # never completed in the "simulation"
    order = rng.permutation(np.flatnonzero(~missing))
    ids = np.concatenate([raw["id"][order], [999_999]])  # plus one request the trace does not have
    sim = calibrate.SimResults(
        request_id=ids, ttft_us=np.concatenate([sim_ttft[order] * 1000, [1.0]]),
        e2e_us=np.concatenate([sim_e2e[order] * 1000, [2.0]]),
        input_tokens=np.concatenate([raw["input"][order], [1]]), output_tokens=np.full(len(ids), 247))
    rows = real_traces.score_run(run, sim)
    assert sorted(rows) == ["all", "stage-0", "stage-1"]
    obs, simulated = {"ttft": raw["ttft"], "e2e": raw["e2e"]}, {"ttft": sim_ttft, "e2e": sim_e2e}
    for name, sel in (("all", ~missing), ("stage-0", ~missing & (raw["stage"] == "stage-0")),
                      ("stage-1", ~missing & (raw["stage"] == "stage-1"))):
        _check_row(rows[name], _expected_row(obs, simulated, sel))
    assert rows["all"]["observed_ok"] == 200 and rows["stage-1"]["pairs"] == 49
    # cache-fill step: requests 50-99 minus 100-149 (none of them missing but 120)
    before = (raw["id"] >= 50) & (raw["id"] < 100)
    after = (raw["id"] >= 100) & (raw["id"] < 150) & ~missing
    step = rows["all"]["ttft_cache_fill_step"]
    assert step["obs_ms"] == pytest.approx(raw["ttft"][before].mean() - raw["ttft"][after].mean(), rel=1e-12)
    assert step["sim_ms"] == pytest.approx(sim_ttft[before].mean() - sim_ttft[after].mean(), rel=1e-12)


def test_skip_first_seconds_drops_the_early_requests(slice_folder, raw):
    run = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml", prefix_mode="none")
    sim = calibrate.SimResults(request_id=raw["id"], ttft_us=raw["ttft"] * 2000, e2e_us=raw["e2e"] * 1000,
                               input_tokens=raw["input"], output_tokens=np.full(len(raw["id"]), 247))
    rows = real_traces.score_run(run, sim, skip_first_s=10.0)
    kept = raw["send"] >= raw["send"][0] + 10_000_000
    assert rows["all"]["pairs"] == int(kept.sum()) < 200
    assert rows["all"]["ttft_mean_obs_ms"] == pytest.approx(raw["ttft"][kept].mean(), rel=1e-12)
    assert rows["all"]["ttft_mape_pct"] == pytest.approx(100.0, rel=1e-12)  # sim = 2 × real
    assert rows["all"]["e2e_mape_pct"] == pytest.approx(0.0, abs=1e-12)


# ------------------------------------------------------------------------------------ loss


def test_loss_is_the_rmse_of_the_mean_apes_over_runs():
    """Means chosen so that the APEs are 20, 10, 0 % (TTFT) and 30, 40, 0 % (E2E)."""
    rows = [{"pairs": 5, "ttft_mean_obs_ms": 25.0, "ttft_mean_sim_ms": 30.0, "e2e_mean_obs_ms": 2000.0,
             "e2e_mean_sim_ms": 1400.0, "ttft_mape_pct": 21.0, "e2e_mape_pct": 31.0},
            {"pairs": 5, "ttft_mean_obs_ms": 27.0, "ttft_mean_sim_ms": 24.3, "e2e_mean_obs_ms": 2100.0,
             "e2e_mean_sim_ms": 2940.0, "ttft_mape_pct": 12.0, "e2e_mape_pct": 41.0},
            {"pairs": 5, "ttft_mean_obs_ms": 45.0, "ttft_mean_sim_ms": 45.0, "e2e_mean_obs_ms": 3500.0,
             "e2e_mean_sim_ms": 3500.0, "ttft_mape_pct": 3.0, "e2e_mape_pct": 2.0}]
    loss = real_traces.real_trace_loss(rows)
    assert loss["ttft_rmse"] == pytest.approx(math.sqrt(500 / 3), rel=1e-12)
    assert loss["e2e_rmse"] == pytest.approx(math.sqrt(2500 / 3), rel=1e-12)
    assert loss["loss"] == pytest.approx(12.909944487358056 + 28.867513459481287, rel=1e-12)
    assert (loss["ttft_mape"], loss["e2e_mape"], loss["n"]) == (pytest.approx(12.0), pytest.approx(74 / 3), 3)
    with pytest.raises(ConfigError, match="no run"):
        real_traces.real_trace_loss([])


# ---------------------------------------------------------------------------- prefix groups


def test_pool_entries_undo_swapped_neighbours():
    usual = np.array([500, 510, 520, 530])
    ids = np.arange(12)
    lengths = usual[ids % 4].copy()
    lengths[[5, 6]] = lengths[[6, 5]]  # requests 5 and 6 sent in swapped order
    lengths[9] = 777  # a length no entry has: stays at its own entry
    entries = real_traces.pool_entries(ids, lengths, 4)
    assert entries.tolist() == [0, 1, 2, 3, 0, 2, 1, 3, 0, 1, 2, 3]


def test_prompt_groups_share_each_prompt_but_its_last_token(slice_folder, raw):
    run = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml")
    r = run.requests
    assert run.prefix_mode == "prompt"
    assert r.request_id.tolist() == raw["id"].tolist() and r.input_len.tolist() == raw["input"].tolist()
    names = np.array(r.prefix_group_names)[r.prefix_group]
    # the slice's entries by hand: request_id mod 100, rows whose length is that of the other
    # neighbour's entry swapped back (the slice has one such pair: 18 and 19)
    entry = raw["id"] % 100
    assert raw["input"][18] == raw["input"][119] and raw["input"][19] == raw["input"][118]
    entry[[18, 19]] = [19, 18]
    assert names.tolist() == [f"prompt-{e}" for e in entry]
    for e in np.unique(entry):
        members = entry == e
        assert np.all(r.prefix_len[members] == raw["input"][members].min() - 1)
    system = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml", prefix_mode="system").requests
    assert np.all(system.prefix_len == 100)
    assert np.array(system.prefix_group_names)[system.prefix_group].tolist() == \
        [f"system-{i % 100 // 10}" for i in raw["id"]]


def test_load_run_resolves_the_replay_arguments_of_case_json(slice_folder):
    run = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml")
    case = json.loads((slice_folder / "case.json").read_text())
    s = run.scenario
    assert (s.model_id, s.tp, s.max_num_seqs, s.max_num_batched_tokens, s.total_kv_blocks) == \
        (case["model"], 1, 128, 2048, 7463)
    assert not run.overloaded
    with pytest.raises(ConfigError, match="prefix mode"):
        real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml", prefix_mode="whole")


def test_replay_args_are_read_through_the_table_of_known_flags(slice_folder):
    case = json.loads((slice_folder / "case.json").read_text())
    fields = real_traces.replay_fields(case, slice_folder)
    assert fields == {"deployment.model": "meta-llama/Llama-2-7b-hf", "deployment.hardware": "H100", "deployment.tp": 1,
                      "deployment.latency_model": "trained-physics", "engine.max_num_seqs": 128,
                      "engine.max_num_batched_tokens": 2048, "deployment.total_kv_blocks": 7463,
                      "workload.header": slice_folder / "trace.yaml", "workload.data": slice_folder / "trace.csv"}
    for args, message in (([*case["replay_args"], "--seed", "7"], r"replay_args: unexpected flag '--seed'"),
                          (["--tp", "one"], r"replay_args: --tp 'one' is not an integer"),
                          (["--model", "m", "--tp"], r"replay_args: --tp has no value"),
                          (["--model", "m"], r"replay_args: --trace-header is missing")):
        with pytest.raises(ConfigError, match=message):
            real_traces.replay_fields({**case, "replay_args": args}, slice_folder)


def test_a_bad_replay_value_is_reported_with_its_flag(slice_folder, tmp_path):
    folder = tmp_path / "bad-tp"
    shutil.copytree(slice_folder, folder)
    case = json.loads((folder / "case.json").read_text())
    args = case["replay_args"]
    args[args.index("--tp") + 1] = "-1"
    (folder / "case.json").write_text(json.dumps(case))
    with pytest.raises(ConfigError, match=r"^real run bad-tp: --tp -1: the tensor-parallel degree must be >= 1"):
        real_traces.load_run(folder, "fits/trained-physics-iter29.yaml")


# ---------------------------------------------------------------------------------- replay


@pytest.mark.slow  # two engine compilations: ~25 s alone, 60 s on the shared 2-core box
def test_replaying_the_slice_pairs_every_request_with_the_engine_times(slice_folder, raw):
    """The benchmark's lane and `simulate_instance` (what `replay` runs) give the same times;
    the rows are numpy on those times and the raw CSV."""
    from blis_jax.engine.simulate import simulate_instance
    from blis_jax.sweep.batch import run_lanes

    run = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml")
    s = run.scenario
    direct = simulate_instance(run.requests, s.params, s.latency_model, block_size=s.block_size)
    [laned] = run_lanes([real_traces.lane(run)], lambda _, out: real_traces.sim_results(out, run.requests))
    assert np.array_equal(np.asarray(direct.ttft_us), laned.ttft_us)  # every request completed
    assert np.array_equal(np.asarray(direct.e2e_us), laned.e2e_us)
    assert np.asarray(direct.kv_hits).sum() > 0  # the repeats from request 100 on hit the cache
    rows = real_traces.score_run(run, laned)
    sim = {"ttft": np.asarray(direct.ttft_us) / 1000.0, "e2e": np.asarray(direct.e2e_us) / 1000.0}
    obs = {"ttft": raw["ttft"], "e2e": raw["e2e"]}
    _check_row(rows["all"], _expected_row(obs, sim, np.ones(200, dtype=bool)))
    _check_row(rows["stage-1"], _expected_row(obs, sim, raw["stage"] == "stage-1"))


# ------------------------------------------------------------------------ fit observations


def test_a_real_run_is_a_fit_observation_scored_on_its_run_means(slice_folder, raw):
    run = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml")
    p = real_traces.fit_observation(run)
    assert p.id == run.name and p.model == "meta-llama/Llama-2-7b-hf"  # one model for --cv lomo
    assert p.obs.ttft_mean_ms == pytest.approx(raw["ttft"].mean(), rel=1e-12)
    assert p.obs.e2e_mean_ms == pytest.approx(raw["e2e"].mean(), rel=1e-12)
    assert p.scenario is run.scenario and p.scenario.requests is run.requests and p.scenario.sessions is None
    assert real_traces.summary_id(run) == "20260217-155451"


def test_an_overloaded_run_is_not_fitted():
    run = real_traces.load_run(RUNS / "20260217-170634-llama-2-7b-tp1-reasoning", "fits/trained-physics-iter29.yaml")
    assert run.overloaded
    with pytest.raises(ConfigError, match="overloaded"):
        real_traces.fit_observation(run)


def test_fit_needs_some_observations():
    import io

    from blis_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    assert main(["fit", "--outer", "0"], stdout=out, stderr=err) == 2
    assert "error:" in err.getvalue() and "--real-traces" in err.getvalue()


@pytest.mark.slow  # one traced simulation of the slice and its compilation
def test_fit_evaluates_a_real_trace_on_its_replay_means(slice_folder, raw, tmp_path):
    """`fit --real-traces DIR --outer 0` simulates the (sliced) run as `replay` does and scores it
    on the observed means taken here from the raw CSV."""
    import io

    from blis_jax.cli import main
    from blis_jax.engine.simulate import simulate_instance

    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(slice_folder, runs / "codegen-slice")
    out, err = io.StringIO(), io.StringIO()
    report = tmp_path / "report"
    code = main(["fit", "--real-traces", str(runs), "--start", "fits/trained-physics-iter29.yaml", "--outer", "0",
                 "--report", str(report), "--quiet"], stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    rep = json.loads((report / "report.json").read_text())
    [row] = rep["experiments"]
    assert row["id"] == "codegen-slice"
    assert row["observed"]["ttft_mean_ms"] == pytest.approx(raw["ttft"].mean(), rel=1e-12)
    run = real_traces.load_run(runs / "codegen-slice", "fits/trained-physics-iter29.yaml")
    s = run.scenario
    direct = simulate_instance(run.requests, s.params, s.latency_model, block_size=s.block_size)
    sim_ttft, sim_e2e = np.asarray(direct.ttft_us).mean() / 1000, np.asarray(direct.e2e_us).mean() / 1000
    assert row["start"]["ttft_mean_ms"] == pytest.approx(sim_ttft, abs=1e-4)  # the report rounds to 4 digits
    assert row["start"]["e2e_mean_ms"] == pytest.approx(sim_e2e, abs=1e-4)
    ape_t = 100 * abs(sim_ttft - raw["ttft"].mean()) / raw["ttft"].mean()
    ape_e = 100 * abs(sim_e2e - raw["e2e"].mean()) / raw["e2e"].mean()
    assert rep["loss"]["start"]["loss_pct"] == pytest.approx(ape_t + ape_e, abs=1e-4)


def test_the_exported_trace_replays_with_the_prefix_groups_and_keeps_the_observations(slice_folder, tmp_path):
    """What `benchmarks/accuracy.py --export-traces` writes for `replay` + `calibrate`."""
    from blis_jax.workload.tracev2 import read_trace

    run = real_traces.load_run(slice_folder, "fits/trained-physics-iter29.yaml")
    yaml_path, csv_path = real_traces.export_trace(run, tmp_path / "slice")
    _, back = read_trace(yaml_path, csv_path)
    r = run.requests
    for field in ("request_id", "arrival_us", "input_len", "output_len", "deadline_us", "prefix_len"):
        assert np.array_equal(getattr(back, field), getattr(r, field)), field
    assert np.array_equal(np.array(back.prefix_group_names)[back.prefix_group],
                          np.array(r.prefix_group_names)[r.prefix_group])
    observed = calibrate.observed_from_trace(back)
    for field in ("send_us", "first_chunk_us", "last_chunk_us", "ok", "input_tokens"):
        assert np.array_equal(getattr(observed, field), getattr(run.observed, field)), field
