"""`blis-jax observe` end to end against the local test server running in its own process
(127.0.0.1 only): flag validation, timing accuracy against the server's own log, client
timeouts, Ctrl+C, and the observe → replay → calibrate loop."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from blis_jax import calibrate
from blis_jax.cli import main
from blis_jax.workload.tracev2 import read_trace

REPO = Path(__file__).resolve().parents[1]


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def server_process(*flags):
    """The test server in its own process on a free 127.0.0.1 port; yields its URL. Run as a
    file: it needs only aiohttp, and skipping the package import (JAX) saves ~3 s a start."""
    proc = subprocess.Popen([sys.executable, str(REPO / "blis_jax" / "observe" / "testserver.py"), "--port", "0",
                             *map(str, flags)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        yield line.split()[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_log(url: str) -> dict:
    with urllib.request.urlopen(url + "/debug/requests", timeout=10) as resp:
        return json.loads(resp.read())


def rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def observe_args(url, tmp_path, *extra):
    return ["observe", "--server-url", url, "--model", "test-model", "--trace-header", tmp_path / "t.yaml",
            "--trace-data", tmp_path / "t.csv", *extra]


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("argv, message", [
    ([], "--server-url is required"),
    (["--server-url", "http://127.0.0.1:9"], "--model is required"),
    (["--server-url", "u", "--model", "m", "--trace-header", "h"], "--trace-data is required"),
    (["--record-itl", "--no-streaming", "--rate", "1"], "--record-itl and --no-streaming are mutually exclusive"),
    ([], "Either --workload, --workload-spec, --rate, or --concurrency is required"),
    (["--workload", "chatbot", "--workload-spec", "w.yaml"], "--workload and --workload-spec are mutually exclusive"),
    (["--workload", "chatbot"], '--workload "chatbot" requires --rate'),
    (["--concurrency", "2", "--rate", "1"], "--concurrency and --rate are mutually exclusive"),
    (["--rate", "1", "--think-time-dist", "constant:value=1s"], "--think-time-dist requires --concurrency"),
    (["--concurrency", "2", "--think-time-dist", "weird:x=1"],
     '--think-time-dist: unsupported think-time-dist type "weird"'),
    (["--rate", "1", "--max-concurrency", "0"], "--max-concurrency must be > 0, got 0"),
    (["--rate", "1", "--prewarm-duration", "5"], "--prewarm-duration: time: missing unit"),
    (["--rate", "-1"], "--rate must be a finite value > 0, got -1"),
    (["--rate", "1", "--api-format", "responses"], "--api-format must be 'completions' or 'chat', got \"responses\""),
    (["--rate", "1", "--timeout", "0"], "--timeout must be between 1 and 86400 seconds"),
    (["--rate", "1", "--slo-ttft", "critical=10"], '--slo-ttft: unparseable duration in pair "critical=10"'),
    (["--workload", "chat", "--rate", "1"], 'Undefined workload "chat"'),
    (["--rate", "1"], "Workload requires either num_requests"),
    (["--rate", "1", "--num-requests", "2", "--detectors", "slope"], "--detectors: BLIS's post-hoc saturation"),
    (["--rate", "1", "--num-requests", "2", "--trace-data", "/nonexistent/dir/t.csv"], "does not exist"),
])
def test_bad_flags_fail_before_sending(argv, message, tmp_path):
    full = ["observe", *argv]
    if "--server-url" not in argv and message != "--server-url is required":  # the required flags, valid
        full = ["observe", "--server-url", "http://127.0.0.1:9", "--model", "m", "--trace-header",
                str(tmp_path / "t.yaml"), "--trace-data", str(tmp_path / "t.csv"), *argv]
    rc, out, err = cli(*full)
    assert rc == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "t.csv").exists()


# ------------------------------------------------------------------------- timing accuracy


def _timing_run(tmp_path, n: int, within_5ms: float) -> None:
    """Observe n requests at 20 req/s against a server with known token timing; the recorded
    TTFT and E2E must agree with the server's own log (request received → first / last chunk
    written) within 5 ms for a fraction `within_5ms` of the requests."""
    ttft_ms, itl_ms = 30.0, 4.0
    with server_process("--ttft-ms", ttft_ms, "--itl-ms", itl_ms) as url:
        # its own process, as a user runs it (not inside pytest's heap and threads)
        argv = observe_args(url, tmp_path, "--rate", 20, "--num-requests", n, "--record-itl", "--prompt-tokens", 64,
                            "--prompt-tokens-stdev", 16, "--output-tokens", 8, "--output-tokens-stdev", 2,
                            "--output-tokens-min", 2, "--output-tokens-max", 16)
        done = subprocess.run([sys.executable, "-m", "blis_jax", *map(str, argv)], cwd=REPO, capture_output=True,
                              text=True, timeout=120 + n / 10, env={**os.environ, "BLIS_JAX_COMPILE_CACHE": "0"})
        truth = server_log(url)
    assert done.returncode == 0, done.stderr
    recorded = rows(tmp_path / "t.csv")
    assert len(recorded) == n and all(r["status"] == "ok" for r in recorded)
    client_ttft, server_ttft, client_e2e, server_e2e = [], [], [], []
    for r in recorded:
        t = truth[r["x_request_id"]]
        send, first, last = int(r["send_time_us"]), int(r["first_chunk_time_us"]), int(r["last_chunk_time_us"])
        client_ttft.append(first - send)
        client_e2e.append(last - send)
        server_ttft.append(t["first_us"] - t["received_us"])
        server_e2e.append(t["last_us"] - t["received_us"])
        # the server's own timing is the configured one (1 chunk per token, usage chunk last)
        assert t["first_us"] - t["received_us"] >= ttft_ms * 1000
    ttft_err = np.abs(np.array(client_ttft) - np.array(server_ttft)) / 1000
    e2e_err = np.abs(np.array(client_e2e) - np.array(server_e2e)) / 1000
    print(f"n={n}: |TTFT error| p50 {np.median(ttft_err):.3f} ms p99 {np.percentile(ttft_err, 99):.3f} ms max "
          f"{ttft_err.max():.3f} ms; |E2E error| p50 {np.median(e2e_err):.3f} ms p99 {np.percentile(e2e_err, 99):.3f} "
          f"ms max {e2e_err.max():.3f} ms; within 5 ms: TTFT {np.mean(ttft_err <= 5):.4f}, "
          f"E2E {np.mean(e2e_err <= 5):.4f}")
    assert np.mean(ttft_err <= 5) >= within_5ms and np.mean(e2e_err <= 5) >= within_5ms
    assert np.median(ttft_err) < 2 and np.median(e2e_err) < 2
    # and against the configured timing: TTFT = 30 ms, E2E = 30 + 4·(n_tokens − 1) ms
    expected_e2e = np.array([ttft_ms + itl_ms * (int(r["output_tokens"]) - 1) for r in recorded])
    assert np.median(np.abs(np.array(client_ttft) / 1000 - ttft_ms)) < 5
    assert np.median(np.abs(np.array(client_e2e) / 1000 - expected_e2e)) < 5
    itl = rows(tmp_path / "t.itl.csv")
    assert len(itl) == sum(int(r["num_chunks"]) for r in recorded)


def test_recorded_ttft_and_e2e_match_the_server(tmp_path):
    # The default suite runs on shared 2-core machines: with a load average of ~10 the kernel
    # delays one of the two processes by ~10 ms for a few percent of the requests (a bare
    # aiohttp client shows the same; measured 82-99 % within 5 ms at load averages of 8-13,
    # 68 % at a load average above 12), hence 60 % here plus the median bound, which a
    # systematic timing error breaks.
    _timing_run(tmp_path, 100, within_5ms=0.6)


@pytest.mark.slow
@pytest.mark.timing
def test_recorded_ttft_and_e2e_match_the_server_500_requests(tmp_path):
    # The target; needs a machine that is not oversubscribed (CI runs it alone: beside a
    # second xdist worker compiling, 98.2 % of TTFTs came within 5 ms).
    _timing_run(tmp_path, 500, within_5ms=0.99)


# --------------------------------------------------------------------- timeouts and Ctrl+C


def test_stalled_request_is_recorded_as_timeout(tmp_path):
    # receipt ordinal 0 is the tokens-per-word probe; 2 is the second workload request
    with server_process("--ttft-ms", 5, "--itl-ms", 1, "--stall", 2) as url:
        t = time.monotonic()
        rc, out, err = cli(*observe_args(url, tmp_path, "--rate", 50, "--num-requests", 4, "--timeout", 1,
                                         "--output-tokens", 4, "--output-tokens-stdev", 0, "--stream"))
        took = time.monotonic() - t
    assert rc == 0, err
    recorded = {int(r["request_id"]): r for r in rows(tmp_path / "t.csv")}
    assert sorted(recorded) == [0, 1, 2, 3]
    stalled = recorded[1]
    assert stalled["status"] == "timeout" and stalled["error_message"].startswith("HTTP timeout: ")
    assert (stalled["first_chunk_time_us"], stalled["num_chunks"]) == ("0", "0")
    assert all(recorded[i]["status"] == "ok" for i in (0, 2, 3))
    # --stream (blis-jax): every request streams, without an ITL file
    assert all(r["streaming"] == "true" and int(r["num_chunks"]) in (0, 5) for r in recorded.values())
    assert not (tmp_path / "t.itl.csv").exists()
    assert took >= 1.0
    assert '"completed_requests": 3' in out


def test_ctrl_c_leaves_a_readable_trace(tmp_path):
    with server_process("--ttft-ms", 400, "--itl-ms", 1) as url:
        cmd = [sys.executable, "-m", "blis_jax", "observe", "--server-url", url, "--model", "m",
               "--trace-header", str(tmp_path / "t.yaml"), "--trace-data", str(tmp_path / "t.csv"),
               "--rate", "10", "--num-requests", "1000", "--output-tokens", "4", "--output-tokens-stdev", "0"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "BLIS_JAX_COMPILE_CACHE": "0"})
        try:
            for line in proc.stderr:  # wait until dispatching has begun
                if "Calibrated tokens-per-word ratio" in line:
                    break
            time.sleep(1.5)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    header, requests = read_trace(tmp_path / "t.yaml", tmp_path / "t.csv")
    assert header.mode == "real" and 3 <= len(requests) < 1000
    recorded = rows(tmp_path / "t.csv")
    statuses = {r["status"] for r in recorded}
    assert "ok" in statuses
    aborted = [r for r in recorded if r["status"] == "error"]
    assert aborted and all(r["error_message"] == "HTTP error: context canceled" for r in aborted)
    assert "=== Simulation Metrics ===" in out


# --------------------------------------------------------------- observe → replay → calibrate


@pytest.mark.slow
def test_observe_replay_calibrate_loop(tmp_path):
    with server_process("--ttft-ms", 20, "--itl-ms", 3, "--slowdown", 0.05) as url:
        rc, out, err = cli(*observe_args(url, tmp_path, "--rate", 20, "--num-requests", 40, "--record-itl",
                                         "--warmup-requests", 5, "--rtt-ms", 0.5, "--prompt-tokens", 128,
                                         "--prompt-tokens-stdev", 32, "--output-tokens", 16,
                                         "--output-tokens-stdev", 4, "--slo-ttft", "default=50ms"))
    assert rc == 0, err
    rc, _, err = cli("replay", "--trace-header", tmp_path / "t.yaml", "--trace-data", tmp_path / "t.csv",
                     "--results-path", tmp_path / "sim.json")
    assert rc == 0, err
    rc, out, err = cli("calibrate", "--trace-header", tmp_path / "t.yaml", "--trace-data", tmp_path / "t.csv",
                       "--sim-results", tmp_path / "sim.json", "--report", tmp_path / "report.json")
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    recorded = rows(tmp_path / "t.csv")
    ids = sorted(int(r["request_id"]) for r in recorded)
    assert ids == list(range(5, 40))  # warm-up dispatch indices 0..4 never written
    info = report["trace_info"]
    assert info["matched_pairs"] == 35 and info["unmatched_real"] == 0 and info["unmatched_sim"] == 0
    assert info["token_mismatch_count"] == 0 and report["network"]["rtt_us"] == 500
    # the report's real side is the trace's client-side latencies; its sim side the replay's
    real_ttft = np.mean([int(r["first_chunk_time_us"]) - int(r["send_time_us"]) for r in recorded])
    sim = {e["request_id"]: e for e in json.loads((tmp_path / "sim.json").read_text())}
    assert report["metrics"]["ttft"]["real_mean_us"] == pytest.approx(real_ttft)
    assert report["metrics"]["ttft"]["sim_mean_us"] == pytest.approx(
        np.mean([sim[i]["ttft_us"] for i in ids]) + 500)
    # pairing by request_id: each pair's real and simulated latencies belong to the same request
    header, requests = read_trace(tmp_path / "t.yaml", tmp_path / "t.csv")
    pairs = calibrate.pair_records(calibrate.observed_from_trace(requests),
                                   calibrate.read_sim_results(tmp_path / "sim.json"),
                                   warmup_requests=header.warm_up_requests)
    by_id = {int(r["request_id"]): r for r in recorded}
    for k, rid in enumerate(pairs.request_id.tolist()):
        r = by_id[rid]
        assert pairs.real["ttft"][k] == int(r["first_chunk_time_us"]) - int(r["send_time_us"])
        assert pairs.sim["ttft"][k] == sim[rid]["ttft_us"]
        assert sim[rid]["output_tokens"] == int(r["output_tokens"])
    print(calibrate.format_summary(report))


# ------------------------------------------------------------------- a spec, chat, KV, SLOs


SPEC = """\
version: "2"
seed: 7
num_requests: 12
aggregate_rate: 40
goodput_slo_targets:
  critical: {e2e_ms: 5000}
clients:
  - id: sys
    rate_fraction: 1
    slo_class: critical
    tenant_id: t1
    streaming: true
    slo_target_us: 1500
    prefix_group: sys
    prefix_length: 32
    arrival: {process: poisson}
    input_distribution: {type: constant, params: {value: 48}}
    output_distribution: {type: constant, params: {value: 3}}
  - id: chat
    rate_fraction: 1
    slo_class: batch
    arrival: {process: poisson}
    input_distribution: {type: constant, params: {value: 20}}
    output_distribution: {type: constant, params: {value: 2}}
    reasoning:
      multi_turn: {max_rounds: 2, think_time_us: 5000, context_growth: accumulate}
"""


def test_spec_chat_kv_scrape_and_slo_targets(tmp_path):
    spec = tmp_path / "w.yaml"
    spec.write_text(SPEC)
    with server_process("--ttft-ms", 2, "--itl-ms", 1) as url:
        rc, out, err = cli(*observe_args(url, tmp_path, "--workload-spec", spec, "--api-format", "chat",
                                         "--scrape-kv-metrics", "--vllm-commit", "abc", "--slo-ttft", "critical=1s",
                                         "--server-type", "tgi", "--rtt-ms", 2.5))
        truth = server_log(url)
    assert rc == 0, err
    header, requests = read_trace(tmp_path / "t.yaml", tmp_path / "t.csv")
    assert header.extra["workload_spec"] == str(spec) and header.workload_seed == 7
    assert header.extra["server"] == {"type": "tgi", "model": "test-model"}
    assert header.extra["network"] == {"measured_rtt_ms": 2.5}
    assert header.goodput_slo_targets == {"critical": {"ttft_ms": 1000.0, "e2e_ms": 5000}}
    kv = header.extra["observed_kv_metrics"]
    assert kv["source"] == "gpu-prefix-cache-fallback" and 0 < kv["hit_rate"] < 1 and kv["vllm_commit"] == "abc"
    recorded = rows(tmp_path / "t.csv")
    assert list(recorded[0])[:5] == ["request_id", "client_id", "tenant_id", "slo_class", "vllm_priority"]
    assert "slo_target_us" in recorded[0] and "x_request_id" in recorded[0]
    sys_rows = [r for r in recorded if r["client_id"] == "sys"]
    chat_rows = [r for r in recorded if r["client_id"] == "chat"]
    assert sys_rows and chat_rows and len(truth) == 1 + len(recorded)  # + the probe
    assert all(r["streaming"] == "true" and r["vllm_priority"] == "0" and r["prefix_group"] == "sys"
               and r["prefix_length"] == "32" and r["input_tokens"] == "48" for r in sys_rows)
    assert all(r["streaming"] == "false" and r["vllm_priority"] == "5" for r in chat_rows)
    assert {r["round_index"] for r in chat_rows} == {"0", "1"}
    assert all(r["status"] == "ok" and int(r["num_chunks"]) >= 1 for r in recorded)
    assert '"per_class": {' in out and "=== Session Metrics ===" in out
    assert "Calibrated tokens-per-word ratio" in err


def test_progress_line_on_a_terminal():
    from blis_jax.observe.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    p = Progress(stream)
    p.on_sent()
    p.on_done(ok=False)
    p.close()
    text = stream.getvalue()
    assert text.startswith("\r") and "sent 1, completed 1, errors 1, elapsed" in text and text.endswith("\n")
    quiet = io.StringIO()
    Progress(quiet).on_sent()
    assert quiet.getvalue() == ""
