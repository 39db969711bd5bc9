"""`blis-jax calibrate` (spec blis-features §1.4): pairing, statistics, report and errors.

Synthetic traces whose observed times are a known function of the simulated ones give known
MAPE, bias and quality; one test runs the simulator (run → TraceV2 + results → calibrate,
then the trace's times doubled), one reads BLIS's A01 reference case from ../shared.
"""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest
from shared_data import BLIS_DIFF, needs_blis_diff

from blis_jax import calibrate
from blis_jax.cli import main
from blis_jax.workload.tracev2 import REQUIRED_COLUMNS


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def write_trace(path_prefix, rows: list[dict], header: str = "") -> tuple:
    """TraceV2 files of `rows` (column → value; unspecified columns get neutral values)."""
    defaults = {name: "" for name in REQUIRED_COLUMNS}
    defaults.update(client_id="c", round_index=0, prefix_length=0, streaming="true", input_tokens=100,
                    output_tokens=10, text_tokens=0, image_tokens=0, audio_tokens=0, video_tokens=0,
                    reason_ratio=0, deadline_us=0, server_input_tokens=0, num_chunks=0, status="ok")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(REQUIRED_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({**defaults, **row})
    header_path, data_path = path_prefix.with_suffix(".yaml"), path_prefix.with_suffix(".csv")
    header_path.write_text("trace_version: 3\ntime_unit: microseconds\nmode: real\n" + header)
    data_path.write_text(buf.getvalue())
    return header_path, data_path


def write_results(path, entries: list[dict]):
    path.write_text(json.dumps(entries))
    return path


def calibrate_files(tmp_path, header_path, data_path, results_path, *extra):
    report_path = tmp_path / "report.json"
    rc, out, err = cli("calibrate", "--trace-header", header_path, "--trace-data", data_path,
                       "--sim-results", results_path, "--report", report_path, *extra)
    report = json.loads(report_path.read_text()) if rc == 0 else None
    return rc, out, err, report


# ---------------------------------------------------------------------------- statistics


def test_compare_known_factor():
    real = np.array([100.0, 200.0, 400.0, 800.0])
    sim = real * 1.25                      # over-predicts by 25 % on every request
    c = calibrate.compare(real, sim)
    assert c["count"] == 4
    assert c["mape"] == pytest.approx(0.25)
    assert c["pearson_r"] == pytest.approx(1.0)
    assert c["bias_direction"] == "over-predict" and c["quality"] == "fair"
    assert c["real_p50_us"] == 300.0 and c["sim_p50_us"] == 375.0      # linear interpolation
    assert c["real_p90_us"] == pytest.approx(680.0)                     # rank 0.9·3 = 2.7
    assert c["mean_error_us"] == pytest.approx(93.75) and c["p99_relative_error"] == pytest.approx(0.25)
    close = calibrate.compare(real, real * 0.95)
    assert close["quality"] == "excellent" and close["bias_direction"] == "under-predict"
    assert close["mape"] == pytest.approx(0.05)


@pytest.mark.parametrize("mape, r, grade", [
    (0.09, 0.96, "excellent"), (0.09, 0.90, "good"), (0.19, 0.99, "good"), (0.30, 0.75, "fair"),
    (0.36, 0.99, "poor"), (0.05, 0.60, "poor"), (None, 1.0, "poor"), (0.0, None, "poor"),
])
def test_quality_grades(mape, r, grade):
    assert calibrate.quality(mape, r) == grade


def test_undefined_values_are_none():
    assert calibrate.pearson_r(np.array([5.0, 5.0, 5.0]), np.array([1.0, 2.0, 3.0])) is None
    assert calibrate.pearson_r(np.array([5.0]), np.array([6.0])) is None
    assert calibrate.mape(np.array([0.0, 0.0]), np.array([1.0, 2.0])) is None
    # Pairs with real = 0 do not enter the MAPE.
    assert calibrate.mape(np.array([0.0, 100.0]), np.array([5.0, 150.0])) == pytest.approx(0.5)
    c = calibrate.compare(np.array([0.0, 0.0]), np.array([0.0, 0.0]))
    assert c["mape"] is None and c["p50_relative_error"] is None and c["bias_direction"] == "neutral"


def test_pairing_filters_and_network_delays():
    observed = calibrate.ObservedRecords(
        request_id=np.array([4, 0, 1, 2, 3, 5]),
        send_us=np.array([400, 0, 100, 200, 300, 500]),
        first_chunk_us=np.array([450, 10, 150, -1, 250, 700]),     # id 3: chunk before send
        last_chunk_us=np.array([900, 20, 600, -1, 800, 1500]),
        ok=np.array([True, True, True, False, True, True]),        # id 2: status error
        input_tokens=np.array([10, 10, 20, 10, 10, 30]), output_tokens=np.array([5, 5, 6, 5, 5, 7]),
        slo_class=np.array(["", "", "", "", "", "batch"]), model=np.array([""] * 6))
    sim = calibrate.SimResults(
        request_id=np.array([5, 1, 3, 9, 0]), ttft_us=np.array([100.0, 40.0, 30.0, 1.0, 5.0]),
        e2e_us=np.array([900.0, 450.0, 400.0, 2.0, 6.0]), input_tokens=np.array([30, 20, 10, 1, 10]),
        output_tokens=np.array([8, 6, 5, 1, 5]))
    # 32 Mbps: a token (32 bits) takes 1 µs each way.
    pairs = calibrate.pair_records(observed, sim, warmup_requests=1,
                                   network=calibrate.NetworkModel(rtt_us=1000.0, bandwidth_mbps=32.0))
    assert pairs.request_id.tolist() == [1, 5]
    assert pairs.real["ttft"].tolist() == [50.0, 200.0] and pairs.real["e2e"].tolist() == [500.0, 1000.0]
    assert pairs.sim["ttft"].tolist() == [40.0 + 1000 + 20, 100.0 + 1000 + 30]
    assert pairs.sim["e2e"].tolist() == [450.0 + 1000 + 20 + 6, 900.0 + 1000 + 30 + 7]
    assert pairs.trace_info() == {
        "num_requests": 6, "warm_up_excluded": 1, "not_ok_excluded": 1, "unmatched_real": 1,
        "unmatched_sim": 1, "negative_latency_excluded": 1, "matched_pairs": 2, "token_mismatch_count": 1}
    assert pairs.slo_class.tolist() == ["", "batch"]


# ------------------------------------------------------------------------------ CLI, synthetic


def synthetic_case(tmp_path, *, header: str = "", n: int = 8, factor: float = 0.8):
    """Observed latencies = factor × (simulated + 2 ms RTT of the header), two SLO classes;
    plus a warm-up record, an error record and a simulated result without a record."""
    rows, results = [], []
    for i in range(n):
        ttft, e2e = 20_000 + 5_000 * i, 400_000 + 50_000 * i * i
        send = 1_000_000 * i
        rows.append({"request_id": i, "slo_class": "critical" if i % 2 else "standard",
                     "arrival_time_us": send, "send_time_us": send,
                     "first_chunk_time_us": send + round(factor * (ttft + 2_000)),
                     "last_chunk_time_us": send + round(factor * (e2e + 2_000))})
        results.append({"request_id": i, "ttft_us": ttft, "e2e_us": e2e, "input_tokens": 100,
                        "output_tokens": 10})
    rows.append({"request_id": n, "arrival_time_us": n * 1_000_000, "send_time_us": n * 1_000_000,
                 "status": "error", "first_chunk_time_us": "", "last_chunk_time_us": ""})
    results.append({"request_id": 99, "ttft_us": 1, "e2e_us": 2, "input_tokens": 100, "output_tokens": 10})
    header_path, data_path = write_trace(tmp_path / "observed", rows,
                                         "warm_up_requests: 1\nnetwork:\n    measured_rtt_ms: 2\n" + header)
    return header_path, data_path, write_results(tmp_path / "results.json", results)


def test_calibrate_synthetic_known_mape(tmp_path):
    files = synthetic_case(tmp_path, header="goodput_slo_targets:\n    critical:\n        ttft_ms: 40\n")
    rc, out, err, report = calibrate_files(tmp_path, *files)
    assert rc == 0, err
    info = report["trace_info"]
    assert info["matched_pairs"] == 7 and info["warm_up_excluded"] == 1 and info["not_ok_excluded"] == 1
    assert info["unmatched_sim"] == 1 and report["network"] == {"rtt_us": 2000, "bandwidth_mbps": 0}
    for metric in ("ttft", "e2e"):
        m = report["metrics"][metric]
        # real = 0.8 · sim' ⇒ |real − sim'| / real = 0.25 for every request
        assert m["count"] == 7 and m["mape"] == pytest.approx(0.25, rel=1e-4)
        assert m["pearson_r"] == pytest.approx(1.0) and m["bias_direction"] == "over-predict"
        assert m["quality"] == "fair"
        assert m["sim_mean_us"] == pytest.approx(1.25 * m["real_mean_us"], rel=1e-4)
    assert sorted(report["per_slo_class"]) == ["critical", "standard"]
    assert report["per_slo_class"]["critical"]["ttft"]["count"] == 4     # ids 1, 3, 5, 7
    assert "per_model" not in report
    # critical (ids 1, 3, 5, 7), TTFT target 40 ms: sim' = 27, 37, 47, 57 ms meets it twice,
    # real = 0.8 · sim' = 21.6, 29.6, 37.6, 45.6 ms three times.
    g = report["goodput"]["critical"]
    assert g["real_slo_attainment"] == 0.75 and g["sim_slo_attainment"] == 0.5
    assert g["attainment_error"] == -0.25 and g["targets"] == ["ttft_ms"]
    assert report["checks"] == {"ttft_mape_threshold": 0.15, "ttft_mape_within_threshold": False}
    assert "TTFT MAPE" in err and "exceeds --ttft-mape-threshold" in err
    assert out.startswith("=== Calibration Report ===\n") and "ttft: MAPE 25.00%" in out


def test_calibrate_flags_override_header(tmp_path):
    files = synthetic_case(tmp_path, factor=1.0)
    rc, _, err, report = calibrate_files(tmp_path, *files, "--warmup-requests", 0, "--network-rtt-us", 0,
                                         "--ttft-mape-threshold", 0.2)
    assert rc == 0, err
    assert report["trace_info"]["warm_up_excluded"] == 0 and report["trace_info"]["matched_pairs"] == 8
    # Observed times carry the 2 ms that the simulated side now lacks: sim under-predicts.
    ttft = report["metrics"]["ttft"]
    assert ttft["bias_direction"] == "under-predict"
    assert ttft["mean_error_us"] == pytest.approx(-2000.0)
    assert report["checks"]["ttft_mape_within_threshold"] is True and err == ""


def test_calibrate_kv_hit_rate(tmp_path):
    files = synthetic_case(tmp_path, header="observed_kv_metrics:\n    hit_rate: 0.30\n")
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"completed_requests": 8, "cache_hit_rate": 0.27}))
    rc, _, err, report = calibrate_files(tmp_path, *files, "--sim-metrics", metrics)
    assert rc == 0, err
    kv = report["kv_hit_rate"]
    assert kv["difference_pp"] == pytest.approx(3.0) and kv["within_tolerance"] is True
    rc, _, err, report = calibrate_files(tmp_path, *files, "--sim-metrics", metrics,
                                         "--hit-rate-tolerance-pp", 2)
    assert rc == 0, err
    assert report["kv_hit_rate"]["within_tolerance"] is False
    assert report["checks"]["hit_rate_within_tolerance"] is False


def test_calibrate_missing_observed_column_is_a_clear_error(tmp_path):
    header_path, data_path, results_path = synthetic_case(tmp_path)
    lines = data_path.read_text().splitlines()
    columns = lines[0].split(",")
    drop = columns.index("first_chunk_time_us")
    data_path.write_text("\n".join(",".join(c for j, c in enumerate(line.split(",")) if j != drop)
                                   for line in lines) + "\n")
    rc, out, err, _ = calibrate_files(tmp_path, header_path, data_path, results_path)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("blis-jax calibrate: error: ")
    assert "first_chunk_time_us" in err and "missing" in err


def test_calibrate_empty_observed_time_names_column_and_request(tmp_path):
    rows = [{"request_id": 0, "arrival_time_us": 0, "send_time_us": 0, "first_chunk_time_us": 10,
             "last_chunk_time_us": 20},
            {"request_id": 1, "arrival_time_us": 5, "send_time_us": 5, "first_chunk_time_us": 15,
             "last_chunk_time_us": ""}]
    header_path, data_path = write_trace(tmp_path / "t", rows)
    results = write_results(tmp_path / "r.json", [{"request_id": i, "ttft_us": 10, "e2e_us": 20,
                                                   "input_tokens": 100, "output_tokens": 10} for i in (0, 1)])
    rc, _, err, _ = calibrate_files(tmp_path, header_path, data_path, results)
    assert rc == 2 and err.count("\n") == 1
    assert "column last_chunk_time_us is empty for request_id 1" in err


@pytest.mark.parametrize("content, expected", [
    ("{}", "expected a JSON array"),
    ("[{\"request_id\": 0, \"ttft_us\": 1, \"input_tokens\": 1, \"output_tokens\": 1}]", "entry 0 has no e2e_us"),
    ("[{\"request_id\": 0, \"ttft_us\": \"x\", \"e2e_us\": 1, \"input_tokens\": 1, \"output_tokens\": 1}]",
     "entry 0, ttft_us"),
    ("not json", "not valid JSON"),
])
def test_calibrate_bad_sim_results(tmp_path, content, expected):
    header_path, data_path, _ = synthetic_case(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    rc, _, err, _ = calibrate_files(tmp_path, header_path, data_path, bad)
    assert rc == 2 and err.count("\n") == 1 and "--sim-results" in err and expected in err


@pytest.mark.parametrize("flags, expected", [
    (["--warmup-requests", "-2"], "--warmup-requests"),
    (["--network-rtt-us", "-5"], "--network-rtt-us"),
    (["--network-bandwidth-mbps", "-1"], "--network-bandwidth-mbps"),
    (["--warmup-requests", "100"], "no observed record has a simulated result"),
])
def test_calibrate_bad_flags(tmp_path, flags, expected):
    rc, _, err, _ = calibrate_files(tmp_path, *synthetic_case(tmp_path), *flags)
    assert rc == 2 and err.count("\n") == 1 and expected in err


def test_calibrate_requires_report_flag(tmp_path):
    header_path, data_path, results_path = synthetic_case(tmp_path)
    rc, _, err = cli("calibrate", "--trace-header", header_path, "--trace-data", data_path,
                     "--sim-results", results_path)
    assert rc == 2 and "--report" in err


# ------------------------------------------------------------------ CLI, simulated and BLIS


def test_run_then_calibrate_and_perturbed_trace(tmp_path):
    """A trace written by run matches its own results on TTFT exactly; E2E differs only by the
    post-decode overhead, which the trace's last-chunk time excludes. Doubling the observed
    latencies then gives MAPE 0.5 and an under-predicting simulator."""
    rc, _, err = cli("run", "--num-requests", 12, "--rate", 4, "--results-path", tmp_path / "results.json",
                     "--trace-output", tmp_path / "trace")
    assert rc == 0, err
    files = (tmp_path / "trace.yaml", tmp_path / "trace.csv", tmp_path / "results.json")
    rc, _, err, report = calibrate_files(tmp_path, *files)
    assert rc == 0, err
    assert report["trace_info"]["matched_pairs"] == 12 and report["trace_info"]["token_mismatch_count"] == 0
    ttft, e2e = report["metrics"]["ttft"], report["metrics"]["e2e"]
    assert ttft["mape"] == 0 and ttft["bias_direction"] == "neutral" and ttft["quality"] == "excellent"
    results = json.loads(files[2].read_text())
    rows = list(csv.DictReader(files[1].open()))
    last_chunk = {int(r["request_id"]): int(r["last_chunk_time_us"]) - int(r["send_time_us"]) for r in rows}
    expected = np.mean([(r["e2e_us"] - last_chunk[r["request_id"]]) / last_chunk[r["request_id"]]
                        for r in results])
    assert expected > 0 and e2e["mape"] == pytest.approx(expected, rel=1e-12)
    assert e2e["bias_direction"] == "over-predict"

    for row in rows:  # observed latencies twice the simulated ones
        send = int(row["send_time_us"])
        for column in ("first_chunk_time_us", "last_chunk_time_us"):
            row[column] = str(send + 2 * (int(row[column]) - send))
    with files[1].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    rc, _, err, report = calibrate_files(tmp_path, *files)
    assert rc == 0 and "exceeds --ttft-mape-threshold" in err
    ttft = report["metrics"]["ttft"]
    assert ttft["mape"] == pytest.approx(0.5) and ttft["bias_direction"] == "under-predict"
    assert ttft["pearson_r"] == pytest.approx(1.0) and ttft["quality"] == "poor"
    assert ttft["real_p90_us"] == pytest.approx(2 * ttft["sim_p90_us"])


@needs_blis_diff
def test_blis_reference_case_a01(tmp_path):
    """BLIS's A01 trace against BLIS's own replay results: the trace's chunk times come from
    the generating run, which the replay reproduces exactly."""
    case = next(BLIS_DIFF.glob("A01_*"))
    rc, _, err, report = calibrate_files(tmp_path, case / "trace.yaml", case / "trace.csv",
                                         case / "results.json")
    assert rc == 0, err
    assert report["trace_info"]["matched_pairs"] == 600
    assert report["metrics"]["ttft"]["mape"] == 0 and report["metrics"]["ttft"]["quality"] == "excellent"
    # Every E2E exceeds the observed last-chunk latency by the 777 µs post-decode overhead.
    assert report["metrics"]["e2e"]["mean_error_us"] == pytest.approx(777.0)
    results = json.loads((case / "results.json").read_text())
    expected = np.mean([777.0 / (r["e2e_us"] - 777.0) for r in results])
    assert math.isclose(report["metrics"]["e2e"]["mape"], expected, rel_tol=1e-12)
