"""Observed trace output (spec §8.1–8.3): the TraceV2 header and CSV, and the ITL CSV.

Rows are in completion order (request_id = dispatch index), which a RequestSet (sorted by
arrival) cannot hold, so the CSV is written here with TraceV2's column names and order
(`workload.tracev2.REQUIRED_COLUMNS` / `OPTIONAL_COLUMNS`) and Go's quoting; the header goes
through the project's TraceHeader and `format_header`. `time_unit` is `microseconds` (BLIS's
observe writes `us`; this project's trace reader accepts only `microseconds`, and nothing reads
the value).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence

from blis_jax.io_safety import atomic_write_text
from blis_jax.observe.dispatcher import Record
from blis_jax.observe.http_request import vllm_priority
from blis_jax.observe.workload import ObservedWorkload
from blis_jax.workload.tracev2 import OPTIONAL_COLUMNS, REQUIRED_COLUMNS, TraceHeader, format_header

ITL_COLUMNS = ("request_id", "chunk_index", "timestamp_us")


def go_csv_field(value: str) -> str:
    """encoding/csv's quoting: a comma, quote, CR or LF, a leading space, or `\\.` → quoted."""
    if value == "":
        return value
    if value == r"\." or any(c in value for c in ',"\r\n') or value[0].isspace():
        return '"' + value.replace('"', '""') + '"'
    return value


def csv_text(rows: Sequence[Sequence[str]]) -> str:
    return "".join(",".join(go_csv_field(str(v)) for v in row) + "\n" for row in rows)


def record_row(w: ObservedWorkload, rec: Record) -> dict[str, str]:
    r, p, o = w.requests, rec.planned, rec.outcome
    row = p.row
    group = ""
    prefix = 0
    if not p.follow_up and r.prefix_group[row] >= 0:
        group, prefix = r.prefix_group_names[r.prefix_group[row]], int(r.prefix_len[row])
    fresh = int(r.input_len[row]) - prefix
    if fresh < 0:
        fresh, prefix = int(r.input_len[row]), 0
    slo_class = str(r.slo_class[row])
    return {
        "request_id": str(rec.index), "client_id": str(r.client_id[row]), "tenant_id": str(r.tenant_id[row]),
        "slo_class": slo_class, "vllm_priority": str(vllm_priority(slo_class) if slo_class else 0),
        "session_id": p.session_id, "round_index": str(p.round_index),
        "prefix_group": group, "prefix_length": str(prefix), "streaming": "true" if o.streaming else "false",
        "input_tokens": str(fresh), "output_tokens": str(o.output_tokens),
        "text_tokens": "0", "image_tokens": "0", "audio_tokens": "0", "video_tokens": "0", "reason_ratio": "0",
        "model": str(r.model[row]), "deadline_us": str(p.deadline_us),
        "slo_target_us": str(w.slo_target_us(row)), "server_input_tokens": str(o.server_input_tokens),
        "arrival_time_us": str(p.arrival_us), "send_time_us": str(o.send_us),
        "first_chunk_time_us": str(o.first_chunk_us), "last_chunk_time_us": str(o.last_chunk_us),
        "num_chunks": str(o.num_chunks), "status": o.status, "error_message": o.error_message,
        "finish_reason": o.finish_reason, "x_request_id": o.x_request_id,
    }


def trace_columns(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """The required columns plus the conditional ones some row uses, in BLIS's order."""
    present = {
        "vllm_priority": any(r["vllm_priority"] != "0" or r["slo_class"] for r in rows),
        "slo_target_us": any(int(r["slo_target_us"]) > 0 for r in rows),
        "x_request_id": any(r["x_request_id"] for r in rows),
    }
    order = list(REQUIRED_COLUMNS)
    for name, after in OPTIONAL_COLUMNS.items():
        if present.get(name):
            order.insert(order.index(after) + 1 if after else len(order), name)
    return order


def format_trace_csv(w: ObservedWorkload, records: Sequence[Record]) -> str:
    rows = [record_row(w, rec) for rec in records]
    order = trace_columns(rows)
    return csv_text([order, *([row[c] for c in order] for row in rows)])


def observed_header(*, warmup: int, seed: int, workload_spec: str | None, server_type: str, model: str,
                    rtt_ms: float, goodput_targets: Mapping | None, kv_metrics: Mapping | None,
                    created_at: str | None = None) -> TraceHeader:
    server = {"type": server_type, "model": model} if server_type else {"model": model}
    extra: dict = {"server": server, "network": {"measured_rtt_ms": rtt_ms} if rtt_ms else {}}
    if workload_spec:
        extra["workload_spec"] = workload_spec
    if kv_metrics:
        extra["observed_kv_metrics"] = dict(kv_metrics)
    created = created_at or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return TraceHeader(trace_version=3, time_unit="microseconds", mode="real", warm_up_requests=warmup,
                       workload_seed=seed, created_at=created,
                       goodput_slo_targets={c: dict(sorted(t.items(), key=_dimension_order))
                                            for c, t in sorted(goodput_targets.items())} if goodput_targets else None,
                       extra=extra)


def _dimension_order(item) -> int:
    return ("ttft_ms", "itl_ms", "e2e_ms").index(item[0]) if item[0] in ("ttft_ms", "itl_ms", "e2e_ms") else 9


def write_observed_trace(header_path: str, data_path: str, header: TraceHeader, w: ObservedWorkload,
                         records: Sequence[Record]) -> None:
    atomic_write_text(header_path, format_header(header))
    atomic_write_text(data_path, format_trace_csv(w, records), newline="")


def itl_path(trace_data: str, itl_output: str | None) -> str:
    """`--itl-output`, else the trace CSV path with one `.csv` removed plus `.itl.csv`."""
    if itl_output:
        return itl_output
    return (trace_data[:-4] if trace_data.endswith(".csv") else trace_data) + ".itl.csv"


def itl_records(records: Sequence[Record]) -> list[tuple[int, int, int]]:
    """(request_id, chunk_index, timestamp_us) of every ok recorded request, completion order."""
    out = []
    for rec in records:
        if rec.outcome.status == "ok":
            out.extend((rec.index, k, t) for k, t in enumerate(rec.outcome.chunk_times_us))
    return out


def write_itl(path: str, itl: Sequence[tuple[int, int, int]]) -> None:
    atomic_write_text(path, csv_text([ITL_COLUMNS, *itl]), newline="")
