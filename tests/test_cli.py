"""`blis-jax run` / `blis-jax replay`: BLIS flags, outputs, errors, determinism.

Most tests call `main([...])` in-process and share one compiled engine program: the default
scenario (run once per module, then replayed from its own trace and re-run for determinism).
The BLIS reference replays (A01, B06) read `../shared/reference/blis-diff` beside the clone.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blis_jax.cli.app import (
    DEFAULT_MODEL,
    Diagnostics,
    build_parser,
    main,
    resolve_scenario,
)
from blis_jax.workload.tracev2 import REQUIRED_COLUMNS
from blis_jax.scenario import simulate
from test_api_parity import case_config  # noqa: E402

from blis_diff import case_param  # noqa: E402
from shared_data import BLIS_DIFF  # noqa: E402
from shared_data import needs_blis_diff as needs_shared  # noqa: E402

# BLIS MetricsOutput fields of a plain single-instance run, in BLIS's order (spec §1.9).
BLIS_FIELDS = [
    "instance_id", "completed_requests", "still_queued", "still_running", "injected_requests",
    "total_input_tokens", "total_output_tokens", "vllm_estimated_duration_s", "responses_per_sec",
    "tokens_per_sec", "e2e_mean_ms", "e2e_p90_ms", "e2e_p95_ms", "e2e_p99_ms", "ttft_mean_ms",
    "ttft_p90_ms", "ttft_p95_ms", "ttft_p99_ms", "itl_mean_ms", "itl_p90_ms", "itl_p95_ms",
    "itl_p99_ms", "scheduling_delay_p99_ms", "preemption_count", "dropped_unservable",
    "length_capped_requests", "timed_out_requests",
]
HEADER = "=== Simulation Metrics ==="
DEFAULT_BETA = "0.152128,0.0,1.36252915,0.752037,32.0955,4.41684,126.0248,481.861,0.0,1.94710771,0.752037"


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def metrics_blocks(stdout: str) -> list[dict]:
    """Every `=== Simulation Metrics ===` JSON block of a stdout."""
    decoder, blocks, pos = json.JSONDecoder(), [], 0
    while (i := stdout.find(HEADER, pos)) >= 0:
        block, end = decoder.raw_decode(stdout, i + len(HEADER) + 1)
        blocks.append(block)
        pos = end
    return blocks


def assert_close(got, ref, path="metrics", rel=1e-3):
    """Counts exactly, floats within `rel` relative, recursively; same keys."""
    if isinstance(ref, dict):
        assert isinstance(got, dict) and set(got) == set(ref), f"{path}: keys {sorted(got)} != {sorted(ref)}"
        for k in ref:
            assert_close(got[k], ref[k], f"{path}.{k}", rel)
    elif isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref), f"{path}: length {len(got)} != {len(ref)}"
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_close(g, r, f"{path}[{i}]", rel)
    elif isinstance(ref, float) or isinstance(got, float):
        assert math.isclose(got, ref, rel_tol=rel, abs_tol=1e-9), f"{path}: {got} != {ref}"
    else:
        assert got == ref, f"{path}: {got!r} != {ref!r}"


# ------------------------------------------------------------------------ default scenario


@pytest.fixture(scope="module")
def smoke_process(tmp_path_factory):
    """`python -m blis_jax run --num-requests 20` in a subprocess, started early so that its
    engine compilation overlaps the in-process tests (`default_run` requests it first)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "blis_jax", "run", "--num-requests", "20"],
                            cwd=tmp_path_factory.mktemp("smoke"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, smoke_process):
    """`blis-jax run` with no scenario flags, writing every output file."""
    d = tmp_path_factory.mktemp("default_run")
    rc, out, err = cli("run", "--metrics-path", d / "metrics.json", "--results-path", d / "results.json",
                       "--trace-output", d / "trace")
    assert rc == 0, err
    return {"dir": d, "stdout": out, "stderr": err}


def test_default_run_prints_blis_block(default_run):
    out = default_run["stdout"]
    assert out.startswith(HEADER + "\n{\n")
    (block,) = metrics_blocks(out)
    assert list(block) == BLIS_FIELDS
    assert block["instance_id"] == "cluster"
    assert block["completed_requests"] == block["injected_requests"] == 100
    assert block["total_output_tokens"] > 0 and block["e2e_p99_ms"] >= block["e2e_mean_ms"] > 0
    assert default_run["stderr"] == ""  # not a terminal, no --progress: nothing on stderr


def test_default_run_files(default_run):
    d = default_run["dir"]
    metrics = json.loads((d / "metrics.json").read_text())
    block = metrics_blocks(default_run["stdout"])[0]
    assert {k: v for k, v in metrics.items() if k not in ("cache_hit_rate", "requests")} == block
    assert metrics["cache_hit_rate"] == 0 and len(metrics["requests"]) == 100
    results = json.loads((d / "results.json").read_text())
    assert [r["request_id"] for r in results] == list(range(100))
    assert set(results[0]) == {"request_id", "ttft_us", "e2e_us", "input_tokens", "output_tokens", "itl_mean_us"}
    header = (d / "trace.yaml").read_text()
    assert "mode: generated" in header and "workload_seed: 42" in header
    csv_lines = (d / "trace.csv").read_text().splitlines()
    assert csv_lines[0].split(",") == list(REQUIRED_COLUMNS) and len(csv_lines) == 101


@pytest.mark.slow  # 13 s; determinism stays in the default suite at engine and cluster level
def test_same_seed_same_bytes_other_seed_differs(default_run):
    rc, again, _ = cli("run")
    assert rc == 0 and again == default_run["stdout"]
    rc, other, _ = cli("run", "--seed", "43")
    assert rc == 0 and other != default_run["stdout"]
    assert metrics_blocks(other)[0]["completed_requests"] == 100


def test_trace_round_trip_and_progress(default_run, tmp_path):
    """run → TraceV2 → replay reproduces every request; --progress only touches stderr."""
    d = default_run["dir"]
    rc, out, err = cli("replay", "--trace-header", d / "trace.yaml", "--trace-data", d / "trace.csv",
                       "--results-path", tmp_path / "results.json", "--trace-output", tmp_path / "again",
                       "--progress")
    assert rc == 0, err
    assert (tmp_path / "results.json").read_text() == (d / "results.json").read_text()
    assert out == default_run["stdout"]
    assert "progress: 100/100 requests finished" in err and HEADER not in err
    assert "mode: replayed" in (tmp_path / "again.yaml").read_text()
    # Re-export keeps every record; only the mode changes.
    assert (tmp_path / "again.csv").read_text() == (d / "trace.csv").read_text()


def test_python_m_smoke(smoke_process):
    out, err = smoke_process.communicate(timeout=300)
    assert smoke_process.returncode == 0, err
    (block,) = metrics_blocks(out)
    assert block["completed_requests"] == 20 and list(block) == BLIS_FIELDS
    assert "Traceback" not in err and HEADER not in err


# ------------------------------------------------------------------- BLIS reference replays


def replay_case(case_id: str, tmp_path: Path):
    case_dir = next(BLIS_DIFF.glob(f"{case_id}_*"))
    args = json.loads((case_dir / "case.json").read_text())["blis_args"]
    mapped, i = [], 0
    while i < len(args):
        flag = args[i]
        if i + 1 == len(args) or args[i + 1].startswith("--"):  # a switch (--pd-transfer-contention)
            mapped.append(flag)
            i += 1
            continue
        value, i = args[i + 1], i + 2
        if flag in ("--results-path", "--metrics-path"):
            value = tmp_path / value
        elif flag in ("--trace-header", "--trace-data", "--lora-config", "--policy-config"):   # the case's files
            value = case_dir / value
        mapped += [flag, value]
    rc, out, err = cli("replay", *mapped)
    assert rc == 0, err
    return case_dir, out


@needs_shared
# B06: unservable drops (--max-model-len); slow (`pytest -m slow`) to keep the default suite under
# 10 minutes on 2 cores: its engine results are also checked by test_engine_parity's B06 case
@pytest.mark.parametrize("case_id", ["A01", pytest.param("B06", marks=pytest.mark.slow)])
def test_replay_matches_blis(case_id, tmp_path):
    case_dir, out = replay_case(case_id, tmp_path)
    ref_results = json.loads((case_dir / "results.json").read_text())
    got_results = json.loads((tmp_path / "results.json").read_text())
    assert got_results == ref_results  # every completed request, exactly
    ref_metrics = json.loads((case_dir / "metrics.json").read_text())
    got_metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert_close(got_metrics, ref_metrics)
    ref_stdout = (case_dir / "stdout.txt").read_text()
    assert_close(metrics_blocks(out), metrics_blocks(ref_stdout), "stdout")
    # Text sections after the JSON block (e.g. Anomaly Counters for B06's drops) verbatim.
    assert out[out.rindex("}"):] == ref_stdout[ref_stdout.rindex("}"):]
    if case_id == "B06":
        assert got_metrics["dropped_unservable"] > 0


@needs_shared
def test_run_with_generation_args_prints_blis_run(tmp_path):
    """A01's `generation_args` through `run`: BLIS's stdout and trace.csv / trace.yaml byte for
    byte (its replay equals the generating run). Every other case -m slow: after its replay below,
    or in tests/test_run_blis_diff.py. After the A01 replay above, this reuses its compiled
    program (same shapes)."""
    from test_run_blis_diff import assert_run_equals_blis

    assert_run_equals_blis("A01", tmp_path)


def _cluster_cases() -> list[str]:
    """Reference cases whose routing is deterministic (round-robin) or that admit by token
    bucket: BLIS's output is reproducible byte for byte. Also the weighted LoRA case (J02): its
    lora-affinity routing breaks ties with BLIS's router stream, reproduced exactly too; and the
    shared prefill-decode pool cases (H): their pool scorers break ties with BLIS's Go streams."""
    def selected(c: dict) -> bool:
        pool_scorers = any(k in c["other_flags"] for k in ("prefill_routing_scorers", "decode_routing_scorers"))
        lora_weighted = c["routing_policy"] == "weighted" and "lora_config" in c["other_flags"]
        deterministic = (c["routing_policy"] == "round-robin" or lora_weighted) and not pool_scorers
        shared_pods = "prefill_decode_instances" in c["other_flags"]
        return (c["num_instances"] > 1 or c["admission_policy"] != "always-admit") and (deterministic or shared_pods)

    return _case_ids(selected)


def _case_ids(selected) -> list:
    """Short ids (`A01`) of the `replay` reference cases whose case.json satisfies `selected`
    (strict xfails where a case needs a feature not built yet). Run-only cases (BLIS's `replay`
    refuses their node pools) are checked by generating their workload, not here."""
    if not BLIS_DIFF.is_dir():
        return []
    cases = (json.loads(p.read_text()) for p in sorted(BLIS_DIFF.glob("*/case.json")))
    return [case_param(c["id"].split("_")[0], c) for c in cases
            if c.get("command", "replay") == "replay" and selected(c)]


@needs_shared
@pytest.mark.slow
@pytest.mark.parametrize("case_id", _cluster_cases())
def test_replay_cluster_cases_byte_identical(case_id, tmp_path):
    """Clusters and admission through the CLI with BLIS's own flags: stdout (per-instance blocks,
    cluster block, anomaly counters), --metrics-path and --results-path byte for byte. Then
    `run` with the case's generation_args (see run_after_the_replay)."""
    case_dir, out = replay_case(case_id, tmp_path)
    assert out == (case_dir / "stdout.txt").read_text()
    assert simulate(case_config(case_dir)).report() == out   # the library API, configured in Python
    for name in ("metrics.json", "results.json"):
        assert (tmp_path / name).read_text() == (case_dir / name).read_text(), name
    run_after_the_replay(case_id, tmp_path)


def _single_instance_cases() -> list[str]:
    return _case_ids(lambda c: c["num_instances"] == 1 and c["admission_policy"] == "always-admit")


@needs_shared
@pytest.mark.slow
@pytest.mark.parametrize("case_id", _single_instance_cases())
def test_replay_all_single_instance_cases(case_id, tmp_path):
    """Every single-instance, always-admit reference case through the CLI: results exactly,
    aggregates and per-request records (keyed by id) within 1e-3. Then `run` with the case's
    generation_args (see run_after_the_replay)."""
    case_dir, out = replay_case(case_id, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == \
        json.loads((case_dir / "results.json").read_text())
    got = json.loads((tmp_path / "metrics.json").read_text())
    ref = json.loads((case_dir / "metrics.json").read_text())
    got_requests = {r["requestID"]: r for r in got.pop("requests")}
    ref_requests = {r["requestID"]: r for r in ref.pop("requests")}
    assert_close(got_requests, ref_requests, "requests")
    assert_close(got, ref)
    assert_close(metrics_blocks(out), metrics_blocks((case_dir / "stdout.txt").read_text()), "stdout")
    said = []
    result = simulate(case_config(case_dir), warn=said.append)
    assert result.report() == out   # the library API, configured in Python
    # a case as BLIS has none of the CPU tier's allocations known to differ (G02: test_cpu_tier.py)
    assert result.output.cpu_reload_failures is None or not result.output.cpu_reload_failures.any()
    assert not [w for w in said if "CPU tier" in w], said
    run_after_the_replay(case_id, tmp_path)


def run_after_the_replay(case_id: str, tmp_path: Path) -> None:
    """`run` with the case's generation_args equals BLIS's run (tests/test_run_blis_diff.py, which
    leaves the replayed cases to this module): right after the replay, it reuses the replay's
    compiled program (the same shapes). A01's: the default suite's test above."""
    from test_run_blis_diff import assert_run_equals_blis, run_in_test_cli

    if case_id != "A01" and case_id in run_in_test_cli():
        (tmp_path / "run").mkdir()
        assert_run_equals_blis(case_id, tmp_path / "run")


# ---------------------------------------------------------------------------------- errors


def _write_trace(tmp_path: Path, drop_column: str | None = None, **cells) -> list[str]:
    columns = [c for c in REQUIRED_COLUMNS if c != drop_column]
    row = {c: "" for c in columns} | {
        "request_id": "0", "client_id": "c", "round_index": "0", "prefix_length": "0", "streaming": "false",
        "input_tokens": "100", "output_tokens": "10", "text_tokens": "0", "image_tokens": "0",
        "audio_tokens": "0", "video_tokens": "0", "reason_ratio": "0", "deadline_us": "0",
        "server_input_tokens": "0", "arrival_time_us": "1000", "send_time_us": "1000", "status": "ok",
    } | cells
    (tmp_path / "t.yaml").write_text("trace_version: 3\ntime_unit: microseconds\nmode: generated\n")
    (tmp_path / "t.csv").write_text(",".join(columns) + "\n" + ",".join(row[c] for c in columns) + "\n")
    return ["replay", "--trace-header", str(tmp_path / "t.yaml"), "--trace-data", str(tmp_path / "t.csv")]


ERROR_CASES = {
    "unknown scheduler": (["run", "--scheduler", "lottery"], "--scheduler"),
    "negative rate": (["run", "--rate", "-1"], "--rate"),
    "unknown model": (["run", "--model", "acme/imaginary-7b"], "`blis-jax models` lists them"),
    "alpha without beta": (["run", "--alpha-coeffs", "1,2,3"], "--beta-coeffs"),
    "NaN coefficient": (["run", "--alpha-coeffs", "nan,777.35,45.91", "--beta-coeffs", DEFAULT_BETA],
                        "--alpha-coeffs"),
    "too few betas": (["run", "--alpha-coeffs", "1,2,3", "--beta-coeffs", "1,2"], "--beta-coeffs"),
    "negative first-token lag": (["run", "--alpha-coeffs", "1,2,3,-1", "--beta-coeffs", DEFAULT_BETA],
                                 "--alpha-coeffs"),
    "five alphas": (["run", "--alpha-coeffs", "1,2,3,4,5", "--beta-coeffs", DEFAULT_BETA], "--alpha-coeffs"),
    "beta with roofline": (["run", "--latency-model", "roofline", "--alpha-coeffs", "1,2,3",
                            "--beta-coeffs", DEFAULT_BETA], "--beta-coeffs"),
    "zero timeout": (["run", "--timeout", "0"], "--timeout"),
    "negative prompt length": (["run", "--prompt-tokens", "-5"], "--prompt-tokens"),
    "min above max": (["run", "--output-tokens-min", "50", "--output-tokens-max", "10"], "--output-tokens"),
    "no instances": (["run", "--num-instances", "0"], "--num-instances"),
    "scorers without weighted": (["run", "--routing-scorers", "queue-depth:1"], "--routing-scorers"),
    "unknown scorer": (["run", "--routing-policy", "weighted", "--routing-scorers", "fastest:1"], "fastest"),
    "negative signal delay": (["run", "--cache-signal-delay", "-1"], "--cache-signal-delay"),
    "zero token bucket": (["run", "--admission-policy", "token-bucket", "--token-bucket-capacity", "0"],
                          "--token-bucket-capacity"),
    "unknown GPU": (["run", "--hardware", "TPUv9"], "H100"),
    "unsupported flag": (["run", "--routing-policy", "busiest-ever"], "--routing-policy"),
    "replay without data": (["replay", "--trace-header", "t.yaml"], "--trace-data"),
    "missing trace file": (["replay", "--trace-header", "/nonexistent/t.yaml", "--trace-data", "x.csv"],
                           "--trace-header"),
    "max-model-len above capacity": (["run", "--total-kv-blocks", "10", "--max-model-len", "4096"],
                                     "--max-model-len"),
    "output directory missing": (["run", "--metrics-path", "/nonexistent/dir/m.json"], "--metrics-path"),
}


def _assert_one_error_line(rc, out, err, needle):
    assert rc == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("blis-jax") and "error:" in lines[0] and "Traceback" not in err
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_input_one_line_exit_2(name, capsys):
    argv, needle = ERROR_CASES[name]
    rc = main(argv)
    captured = capsys.readouterr()
    _assert_one_error_line(rc, captured.out, captured.err, needle)


def test_unknown_model_points_to_the_models_command(capsys):
    main(["run", "--model", "acme/imaginary-7b"])
    err = capsys.readouterr().err
    assert "unknown model" in err and "14 bundled models" in err and len(err) < 250
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen3-14B" in out and "meta-llama/Llama-3.1-8B-Instruct" in out and "H100" in out


@pytest.mark.parametrize("drop, cells, needle", [
    ("output_tokens", {}, "output_tokens"),
    (None, {"input_tokens": "-3"}, "input_tokens"),
    (None, {"arrival_time_us": "soon"}, "arrival_time_us"),
])
def test_bad_trace_one_line_exit_2(drop, cells, needle, tmp_path, capsys):
    rc = main(_write_trace(tmp_path, drop, **cells))
    captured = capsys.readouterr()
    _assert_one_error_line(rc, captured.out, captured.err, needle)


# ------------------------------------------------------------------- flags and defaults


def test_help_mentions_default_model(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert DEFAULT_MODEL in out and "BLIS requires --model" in out.replace("\n", " ").replace("  ", " ")


def test_blis_aliases_and_defaults():
    args = build_parser().parse_args(["run", "--max-num-running-reqs", "8", "--max-num-scheduled-tokens", "512"])
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (8, 512)
    args = build_parser().parse_args(["run"])
    assert (args.seed, args.rate, args.block_size_in_tokens) == (42, 1.0, 16)
    # --num-requests / --timeout stay unset (a workload spec keeps its own values unless they are
    # given); distribution mode resolves them to BLIS's defaults
    assert (args.num_requests, args.timeout) == (None, None)
    from blis_jax.cli.scenario_flags import workload as workload_of

    workload = workload_of(args)
    assert (workload.num_requests, workload.timeout_s) == (100, 300.0)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.long_prefill_token_threshold) == (256, 2048, 0)
    assert (args.scheduler, args.preemption_policy, args.workload, args.gpu_memory_utilization) == \
        ("fcfs", "fcfs", "distribution", 0.9)


def test_model_defaults_and_auto_capacity():
    """Hardware / TP come from the model's BLIS defaults; KV blocks and max-model-len are
    auto-derived (A01 values: 26312 blocks, 131072 tokens) unless given."""
    diag = Diagnostics(io.StringIO())
    scenario = resolve_scenario(build_parser().parse_args(["run"]), diag, None)
    assert (scenario.hardware, scenario.tp, scenario.latency_kind) == ("H100", 1, "trained-physics")
    assert (scenario.total_kv_blocks, scenario.max_model_len) == (26312, 131072)
    code = resolve_scenario(build_parser().parse_args(["run", "--model", "codellama/CodeLlama-34b-Instruct-hf"]),
                            diag, None)
    assert code.tp == 2
    explicit = resolve_scenario(build_parser().parse_args(
        ["run", "--tp", "2", "--total-kv-blocks", "100", "--latency-model", "roofline"]), diag, None)
    assert (explicit.tp, explicit.total_kv_blocks, explicit.max_model_len, explicit.latency_kind) == \
        (2, 100, 1600, "roofline")


@needs_shared
@pytest.mark.slow  # a spec drives `run` in the default suite too: C06's generating run (test_sessions)
def test_workload_spec_run_overrides_num_requests():
    """--workload-spec: a v2 spec drives `run` (--num-requests overrides the spec)."""
    spec = BLIS_DIFF / "C01_multiclient_poisson_gamma_weibull" / "workload.yaml"
    rc, out, err = cli("run", "--workload-spec", str(spec), "--num-requests", "40", "--max-num-seqs", "256")
    assert rc == 0, err
    block = metrics_blocks(out)[-1]
    assert block["injected_requests"] == 40 and block["completed_requests"] == 40


@needs_shared
def test_workload_spec_bad_key(tmp_path, capsys):
    """An unknown key in a --workload-spec is one error line naming it."""
    spec = BLIS_DIFF / "C01_multiclient_poisson_gamma_weibull" / "workload.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec.read_text() + "\nbogus_key: 1\n")
    rc, out, err = cli("run", "--workload-spec", str(bad))
    _assert_one_error_line(rc, out, err, "bogus_key")
