"""TraceV2 read / write (spec §4.13, blis-diff README)."""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

import numpy as np
import pytest

from blis_jax.engine.output import COMPLETED, DROPPED, NOT_ARRIVED, TIMED_OUT, SimOutput
from blis_jax.errors import ConfigError
from blis_jax.workload.tracev2 import (
    REQUIRED_COLUMNS,
    TraceHeader,
    format_header,
    format_records,
    read_trace,
    trace_column_order,
    write_trace,
)

from blis_diff import params_with_known_failures  # noqa: E402
from shared_data import BLIS_DIFF, needs_blis_diff  # noqa: E402
CASES = sorted(p for p in BLIS_DIFF.glob("*") if (p / "trace.csv").is_file()) if BLIS_DIFF.is_dir() else []
needs_reference = needs_blis_diff


@functools.cache
def _read(case: Path):
    return read_trace(case / "trace.yaml", case / "trace.csv")


def _rows(case: Path) -> list[dict[str, str]]:
    with open(case / "trace.csv", newline="") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------- blis-diff traces


@needs_reference
def test_reference_set_has_41_traces():
    assert len(CASES) == 41


@needs_reference
@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name[:3])
def test_reads_every_reference_trace(case: Path):
    header, requests = _read(case)
    info = json.loads((case / "case.json").read_text())
    rows = _rows(case)
    assert len(requests) == info["trace_records"] == len(rows)
    assert header.trace_version == 3 and header.mode == "generated" and header.time_unit == "microseconds"
    # Rows are already in arrival order in the reference traces, so no reordering happens.
    assert requests.request_id.tolist() == [int(r["request_id"]) for r in rows]
    assert requests.arrival_us.tolist() == [int(r["send_time_us"]) or int(r["arrival_time_us"]) for r in rows]
    assert requests.deadline_us.tolist() == [int(r["deadline_us"]) for r in rows]
    assert requests.output_len.tolist() == [int(r["output_tokens"]) for r in rows]
    # Prompt lengths as the replay used them: results.json input_tokens includes the prefix.
    by_id = dict(zip(requests.request_id.tolist(), requests.input_len.tolist()))
    for entry in json.loads((case / "results.json").read_text()):
        assert by_id[entry["request_id"]] == entry["input_tokens"]


@needs_reference
def test_prefix_groups_c03():
    _, r = _read(BLIS_DIFF / "C03_prefix_groups_single_instance")
    rows = _rows(BLIS_DIFF / "C03_prefix_groups_single_instance")
    names = [row["prefix_group"] for row in rows]
    assert set(r.prefix_group_names) == {n for n in names if n}
    grouped = r.prefix_group >= 0
    assert [r.prefix_group_names[g] if g >= 0 else "" for g in r.prefix_group] == names
    np.testing.assert_array_equal(r.input_len[grouped], (r.prefix_len + np.array(
        [int(row["input_tokens"]) for row in rows]))[grouped])
    row2 = rows[2]  # system-prompt-a, prefix 1024 + 140 fresh tokens
    assert (row2["prefix_group"], r.input_len[2], r.prefix_len[2]) == ("system-prompt-a", 1164, 1024)


@needs_reference
def test_ungrouped_prefix_length_is_ignored_c06():
    # Multi-turn rows carry prefix_length 256 with an empty group: no shared prefix.
    _, r = _read(BLIS_DIFF / "C06_inference_perf_multiturn_scout")
    assert (r.prefix_group == -1).all() and (r.prefix_len == 0).all()
    assert r.input_len[0] == 350 and r.session_id[0] == "sess_2817609848346812949"


@needs_reference
def test_priorities_and_labels_e03():
    _, r = _read(BLIS_DIFF / "E03_priority_fcfs_priority_preemption")
    expected = {"critical": 0, "standard": 1, "batch": 5}
    assert [expected[c] for c in r.slo_class] == r.priority.tolist()
    assert r.tenant_id[0] == "t-batch" and r.client_id[0] == "batch-jobs"


@needs_reference
def test_goodput_targets_in_header_c01():
    header, _ = _read(BLIS_DIFF / "C01_multiclient_poisson_gamma_weibull")
    assert dict(header.goodput_slo_targets["critical"]) == {"ttft_ms": 200, "e2e_ms": 5000}
    assert header.workload_seed == 42


@needs_reference
@pytest.mark.parametrize("case", params_with_known_failures(CASES, set()))
def test_round_trip_is_byte_identical(case: Path, tmp_path: Path):
    header, requests = _read(case)
    yaml_path, csv_path = write_trace(tmp_path / "trace", header, requests)
    assert csv_path.read_bytes() == (case / "trace.csv").read_bytes()
    assert yaml_path.read_bytes() == (case / "trace.yaml").read_bytes()
    again_header, again = read_trace(yaml_path, csv_path)
    assert again_header == header
    for field in ("request_id", "arrival_us", "input_len", "output_len", "deadline_us", "prefix_group",
                  "prefix_len", "priority", "slo_class", "tenant_id", "session_id", "round_index"):
        np.testing.assert_array_equal(getattr(again, field), getattr(requests, field))


def _sim_output_from_results(case: Path, requests) -> SimOutput:
    """Outcome arrays of a replay rebuilt from results.json / metrics.json."""
    results = {e["request_id"]: e for e in json.loads((case / "results.json").read_text())}
    records = {int(r["requestID"][8:]): r for r in json.loads((case / "metrics.json").read_text())["requests"]}
    n = len(requests)
    status, ttft = np.full(n, DROPPED, np.int8), np.full(n, -1, np.int64)
    e2e, itl_sum, num_itl = np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i, rid in enumerate(requests.request_id.tolist()):
        if rid in results:
            e = results[rid]
            gaps = max(e["output_tokens"] - 1, 1)
            status[i], ttft[i], e2e[i] = COMPLETED, e["ttft_us"], e["e2e_us"]
            itl_sum[i], num_itl[i] = round(e.get("itl_mean_us", 0) * gaps), 0
        elif rid in records:
            status[i], ttft[i] = TIMED_OUT, round(records[rid]["ttft_ms"] * 1000)
    zeros = np.zeros(1, np.int64)
    return SimOutput(status=status, ttft_us=ttft, e2e_us=e2e, itl_sum_us=itl_sum, num_itl=num_itl,
                     sched_delay_us=np.full(n, -1), output_tokens=np.zeros(n), handled_by=np.zeros(n),
                     itl_step_us=np.zeros(0), itl_runs=np.zeros((0, 3)), preemption_count=zeros, kv_hits=zeros, kv_misses=zeros,
                     dropped_unservable=zeros, timed_out=zeros, length_capped=zeros, total_input_tokens=zeros,
                     sim_end_us=zeros, still_queued=zeros, still_running=zeros, kv_allocation_failures=zeros, peak_batch_size=zeros)


@needs_reference
@pytest.mark.parametrize("name", ["A01_llama8b_h100_tp1_stable", "A03_qwen25_7b_a100_overload_timeout",
                                  "B06_qwen25_7b_max_model_len_drops"])
def test_written_chunk_times_match_generating_run(name: str):
    # These replays match their generating runs, so first/last chunk = arrival + TTFT (+ ΣITL).
    case = BLIS_DIFF / name
    _, requests = _read(case)
    out = _sim_output_from_results(case, requests)
    written = list(csv.DictReader(format_records(requests, out).splitlines()))
    for got, ref in zip(written, _rows(case)):
        assert got["status"] == ref["status"]
        assert got["first_chunk_time_us"] == ref["first_chunk_time_us"]
        if ref["status"] != "timeout":   # ΣITL of timed-out requests is not in results.json
            assert got["last_chunk_time_us"] == ref["last_chunk_time_us"]


# ---------------------------------------------------------------------- small synthetic traces

_HEADER = "trace_version: 3\ntime_unit: microseconds\nmode: generated\nwarm_up_requests: 0\nworkload_seed: 7\n"
_ROW = {c: "" for c in REQUIRED_COLUMNS} | {
    "round_index": "0", "prefix_length": "0", "streaming": "false", "input_tokens": "10", "output_tokens": "5",
    "text_tokens": "0", "image_tokens": "0", "audio_tokens": "0", "video_tokens": "0", "reason_ratio": "0",
    "deadline_us": "0", "server_input_tokens": "0", "first_chunk_time_us": "0", "last_chunk_time_us": "0",
    "num_chunks": "0", "status": "ok"}


def _write(tmp_path: Path, rows: list[dict], columns=None, header: str = _HEADER) -> tuple[Path, Path]:
    columns = list(columns or REQUIRED_COLUMNS)
    yaml_path, csv_path = tmp_path / "t.yaml", tmp_path / "t.csv"
    yaml_path.write_text(header)
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(columns)
        for row in rows:
            w.writerow([row.get(c, "") for c in columns])
    return yaml_path, csv_path


def _row(rid: int, arrival: int, **cells) -> dict:
    return _ROW | {"request_id": str(rid), "arrival_time_us": str(arrival), "send_time_us": str(arrival)} | {
        k: str(v) for k, v in cells.items()}


def test_injection_time_prefers_send_time_and_sorts_stably(tmp_path):
    rows = [_row(0, 500, send_time_us=0), _row(1, 100, send_time_us=900), _row(2, 300), _row(3, 900, send_time_us=0)]
    _, r = read_trace(*_write(tmp_path, rows))
    assert r.request_id.tolist() == [2, 0, 1, 3]
    assert r.arrival_us.tolist() == [300, 500, 900, 900]


def test_group_prefix_uses_first_row_length_and_server_tokens(tmp_path):
    rows = [_row(0, 1, prefix_group="sys", prefix_length=100, input_tokens=10),
            _row(1, 2, prefix_group="sys", prefix_length=999, input_tokens=20),
            _row(2, 3, input_tokens=10, server_input_tokens=42),
            _row(3, 4, prefix_group="sys", input_tokens=5, server_input_tokens=77)]
    _, r = read_trace(*_write(tmp_path, rows))
    assert r.input_len.tolist() == [110, 120, 42, 105]
    assert r.prefix_len.tolist() == [100, 100, 0, 100]
    out = format_records(r)
    assert list(csv.DictReader(out.splitlines()))[2]["input_tokens"] == "10"


def test_optional_columns_are_accepted_and_rewritten_in_place(tmp_path):
    columns = list(REQUIRED_COLUMNS) + ["adapter", "think_time_us"]
    columns.insert(columns.index("slo_class") + 1, "vllm_priority")
    rows = [_row(0, 1, adapter="lora-a", think_time_us=5, vllm_priority=-3), _row(1, 2)]
    yaml_path, csv_path = _write(tmp_path, rows, columns)
    header, r = read_trace(yaml_path, csv_path)
    assert trace_column_order(r) == columns
    out_yaml, out_csv = write_trace(tmp_path / "again", header, r)
    assert out_csv.read_text() == csv_path.read_text()
    assert out_yaml.read_text() == format_header(header)


@pytest.mark.parametrize("mutate, pattern", [
    (lambda cols, row: cols.remove("output_tokens"), "missing required column.*output_tokens"),
    (lambda cols, row: cols.append("colour"), "unknown column.*colour"),
    (lambda cols, row: row.update(input_tokens="-4"), r"row 0 .*input_tokens.*'-4'.*≥ 0"),
    (lambda cols, row: row.update(output_tokens="3.5"), r"row 0 .*output_tokens.*'3.5'.*integer"),
    (lambda cols, row: row.update(arrival_time_us="soon"), r"row 0 .*arrival_time_us.*integer"),
    (lambda cols, row: row.update(streaming="yes"), r"row 0 .*streaming.*true or false"),
    (lambda cols, row: row.update(reason_ratio="nan"), r"row 0 .*reason_ratio.*finite"),
    (lambda cols, row: row.update(status="done"), r"row 0 .*status"),
    (lambda cols, row: row.update(input_tokens="0"), r"row 0 .*input_tokens.*empty"),
    (lambda cols, row: row.update(deadline_us="-1"), r"row 0 .*deadline_us"),
])
def test_malformed_trace_gives_one_clear_error(tmp_path, mutate, pattern):
    columns, row = list(REQUIRED_COLUMNS), _row(0, 10)
    mutate(columns, row)
    with pytest.raises(ConfigError, match=pattern):
        read_trace(*_write(tmp_path, [row, _row(1, 20)], columns))


def test_duplicate_request_id_and_ragged_rows(tmp_path):
    with pytest.raises(ConfigError, match="duplicate id 1"):
        read_trace(*_write(tmp_path, [_row(1, 10), _row(1, 20)]))
    yaml_path, csv_path = _write(tmp_path, [_row(0, 10)])
    csv_path.write_text(csv_path.read_text() + "1,2,3\n")
    with pytest.raises(ConfigError, match="line 3 has 3 fields"):
        read_trace(yaml_path, csv_path)


@pytest.mark.parametrize("header, pattern", [
    (_HEADER + "colour: blue\n", "unknown key.*colour"),
    (_HEADER.replace("microseconds", "milliseconds"), "time_unit"),
    (_HEADER.replace("generated", "invented"), "mode"),
    (_HEADER.replace("trace_version: 3", "trace_version: 9"), "trace_version"),
    (_HEADER + "goodput_slo_targets:\n  critical:\n    ttft: 5\n", "goodput_slo_targets.critical"),
    ("- just\n- a list\n", "mapping"),
])
def test_bad_header(tmp_path, header, pattern):
    with pytest.raises(ConfigError, match=pattern):
        read_trace(*_write(tmp_path, [_row(0, 10)], header=header))


def test_write_without_results_and_with_unfinished_requests(tmp_path):
    _, r = read_trace(*_write(tmp_path, [_row(0, 10), _row(1, 20)]))
    header = TraceHeader(workload_seed=1)
    zeros = np.zeros(1, np.int64)
    out = SimOutput(status=[COMPLETED, NOT_ARRIVED], ttft_us=[7, -1], e2e_us=[20, -1], itl_sum_us=[12, 0],
                    num_itl=[4, 0], sched_delay_us=[1, -1], output_tokens=[5, 0], handled_by=[0, -1],
                    itl_step_us=[3, 3, 3, 3], itl_runs=[[0, 0, 3]], preemption_count=zeros, kv_hits=zeros, kv_misses=zeros,
                    dropped_unservable=zeros, timed_out=zeros, length_capped=zeros, total_input_tokens=zeros,
                    sim_end_us=zeros, still_queued=zeros, still_running=zeros, kv_allocation_failures=zeros, peak_batch_size=zeros)
    rows = list(csv.DictReader(format_records(r, out).splitlines()))
    assert [(x["first_chunk_time_us"], x["last_chunk_time_us"], x["status"]) for x in rows] == \
        [("17", "29", "ok"), ("0", "0", "incomplete")]
    assert format_header(header) == "trace_version: 3\ntime_unit: microseconds\nmode: generated\n" \
                                    "warm_up_requests: 0\nworkload_seed: 1\n"


@needs_reference
def test_run_export_of_distribution_workload_has_blis_columns(tmp_path):
    # A01 was generated by `blis run --rate 9 --num-requests 600`: every column except the
    # sampled lengths (Go RNG) and the simulated outcome must come out identical.
    from blis_jax.workload.distribution import DistributionWorkload, generate_distribution

    requests = generate_distribution(DistributionWorkload(rate=9, num_requests=600), seed=42)
    yaml_path, csv_path = write_trace(tmp_path / "run", TraceHeader(workload_seed=42), requests)
    assert yaml_path.read_text() == (BLIS_DIFF / "A01_llama8b_h100_tp1_stable" / "trace.yaml").read_text()
    skip = {"input_tokens", "output_tokens", "first_chunk_time_us", "last_chunk_time_us", "status"}
    with open(csv_path, newline="") as f:
        written = list(csv.DictReader(f))
    for got, ref in zip(written, _rows(BLIS_DIFF / "A01_llama8b_h100_tp1_stable"), strict=True):
        assert {k: v for k, v in got.items() if k not in skip} == {k: v for k, v in ref.items() if k not in skip}


def test_header_keeps_created_at_text_and_extra_sections(tmp_path):
    header_text = ("trace_version: 3\ntime_unit: microseconds\ncreated_at: 2024-05-01T10:00:00Z\nmode: real\n"
                   "warm_up_requests: 2\nserver:\n    type: vllm\n    max_num_seqs: 8\n")
    header, _ = read_trace(*_write(tmp_path, [_row(0, 10)], header=header_text))
    assert header.created_at == "2024-05-01T10:00:00Z" and header.extra["server"]["max_num_seqs"] == 8
    again, _ = read_trace(*_write(tmp_path, [_row(0, 10)], header=format_header(header)))
    assert again == header
