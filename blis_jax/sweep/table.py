"""The sweep table: one row per scenario (axis values, result, every `run` metric); CSV / JSON.

Metrics come from `blis_jax.metrics.metrics_output` (the block `blis-jax run` prints, with the
`cache_hit_rate` of `--metrics-path`) plus the KV-cache section's preemption rate, so a row's
values are exactly those of a `blis-jax run` of the scenario.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from blis_jax.engine import results as result_codes
from blis_jax.io_safety import atomic_output, atomic_write_text
from blis_jax.metrics import kv_cache_metrics, metrics_output

# The metrics block in BLIS field order (`kv_allocation_failures` is printed only when non-zero;
# here it is always a column), then the KV-cache section's preemption rate.
METRICS = (
    "completed_requests", "still_queued", "still_running", "injected_requests", "total_input_tokens",
    "total_output_tokens", "vllm_estimated_duration_s", "responses_per_sec", "tokens_per_sec",
    "e2e_mean_ms", "e2e_p90_ms", "e2e_p95_ms", "e2e_p99_ms",
    "ttft_mean_ms", "ttft_p90_ms", "ttft_p95_ms", "ttft_p99_ms",
    "itl_mean_ms", "itl_p90_ms", "itl_p95_ms", "itl_p99_ms",
    "scheduling_delay_p99_ms", "kv_allocation_failures", "preemption_count", "cache_hit_rate",
    "dropped_unservable", "length_capped_requests", "timed_out_requests", "preemption_rate",
)
SCENARIO, RESULT = "scenario", "result"
OK = "ok"
# Columns of the short text table printed on stdout.
SUMMARY_METRICS = ("completed_requests", "ttft_p99_ms", "itl_p99_ms", "e2e_p99_ms", "responses_per_sec")


def scenario_metrics(out, requests) -> dict[str, Any]:
    """Every metric of one scenario's SimOutput, in `METRICS` order (None when the engine
    could not finish: a row must never carry the numbers of an incomplete run)."""
    if out.result != result_codes.OK:
        return dict.fromkeys(METRICS)
    block = metrics_output(out, requests, with_cache_hit_rate=True)
    block.pop("instance_id")
    block.setdefault("kv_allocation_failures", 0)
    block["preemption_rate"] = kv_cache_metrics(out).preemption_rate
    extra = [k for k in block if k not in METRICS]  # a field metrics.py gained: keep it, at the end
    return {k: block.get(k) for k in (*METRICS, *extra)}


def result_label(code: int) -> str:
    return OK if code == result_codes.OK else result_codes.describe(code)


@dataclasses.dataclass(frozen=True)
class SweepTable:
    """Rows in scenario order; each row maps `scenario`, the axis keys, `result` and the
    metrics to plain Python values."""

    axes: tuple[str, ...]
    rows: tuple[Mapping[str, Any], ...]
    # autoscaled scenarios: scenario index → instance counts over time (cluster/timeline.py `counts`)
    timelines: Mapping[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def metrics(self) -> tuple[str, ...]:
        fixed = {SCENARIO, RESULT, *self.axes}
        names: dict[str, None] = {}
        for row in self.rows:
            names.update((k, None) for k in row if k not in fixed)
        return tuple(names)

    @property
    def columns(self) -> tuple[str, ...]:
        return (SCENARIO, *self.axes, RESULT, *self.metrics)

    def failed(self) -> list[Mapping[str, Any]]:
        return [r for r in self.rows if r[RESULT] != OK]

    def to_json(self) -> dict:
        columns = self.columns  # a scan of every row: once, not per row
        return {"axes": list(self.axes), "metrics": list(self.metrics),
                "rows": [{c: row.get(c) for c in columns} for row in self.rows]}


def make_row(index: int, values: Mapping[str, Any], code: int, metrics: Mapping[str, Any]) -> dict:
    return {SCENARIO: index, **values, RESULT: result_label(code), **metrics}


def write_csv(path: str | Path, table: SweepTable) -> None:
    with atomic_output(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        columns = table.columns  # a scan of every row: once, not per row
        writer.writerow(columns)
        for row in table.rows:
            writer.writerow([_csv_cell(row.get(c)) for c in columns])


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # shortest round-trip digits: the CSV holds the exact values
    return str(value)


def write_json(path: str | Path, table: SweepTable) -> None:
    atomic_write_text(path, json.dumps(table.to_json(), indent=2) + "\n")


def format_text(table: SweepTable, metrics: Sequence[str] = SUMMARY_METRICS) -> str:
    """An aligned text table of the axes, result and a few metrics (for stdout)."""
    present = set(table.metrics)
    columns = (SCENARIO, *table.axes, RESULT, *[m for m in metrics if m in present])
    cells = [[str(c) for c in columns]]
    cells += [[_text_cell(row.get(c)) for c in columns] for row in table.rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cells]
    return "\n".join(lines) + "\n"


def _text_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    return str(value)
