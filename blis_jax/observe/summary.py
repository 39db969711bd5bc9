"""What observe prints on stdout (spec §8.4): the `=== Simulation Metrics ===` JSON block
(client-side latencies of the recorded rows, goodput when targets exist) and, when some row
belongs to a session, the `=== Session Metrics ===` block. Also the Go-duration and `--slo-*`
parsers the goodput targets come from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.output import go_json

PERCENTILES = (90, 95, 99)
_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]*)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_US = {"ns": 1e-3, "us": 1.0, "µs": 1.0, "μs": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}


def parse_go_duration(text: str) -> float:
    """Go's time.ParseDuration → µs (`1m30s`, `250ms`, `1.5h`; a unit is required except for 0)."""
    s = text.strip()
    sign = 1.0
    if s[:1] in "+-" and s:
        sign, s = (-1.0 if s[0] == "-" else 1.0), s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError(f'time: invalid duration "{text}"')
    total, pos = 0.0, 0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if not m or m.group(1) in ("", "."):
            raise ValueError(f'time: invalid duration "{text}"' if m else f'time: missing unit in duration "{text}"')
        total += float(m.group(1)) * _UNIT_US[m.group(2)]
        pos = m.end()
    return sign * total


def parse_slo_flag(text: str) -> dict[str, float]:
    """`class=duration,…` → class → ms (spec §1.2 item 22's errors)."""
    out: dict[str, float] = {}
    for pair in text.split(","):
        if not pair.strip():
            raise ConfigError(f'empty pair in "{text}" (expected key=duration)')
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f'invalid pair "{pair}" (expected key=duration)')
        if not key.strip():
            raise ConfigError(f'empty class key in pair "{pair}"')
        try:
            us = parse_go_duration(value)
        except ValueError as e:
            raise ConfigError(f'unparseable duration in pair "{pair}": {e}') from None
        if us <= 0:
            raise ConfigError(f'non-positive duration in pair "{pair}"')
        out[key.strip()] = us / 1000.0
    return out


def merge_targets(spec_targets: Mapping | None, cli: Mapping[str, Mapping[str, float]]) -> dict | None:
    """CLI flags over the spec's targets, per class and dimension; all-zero classes dropped."""
    merged: dict[str, dict[str, float]] = {c: dict(t) for c, t in (spec_targets or {}).items()}
    for dim, classes in cli.items():
        for cls, ms in classes.items():
            merged.setdefault(cls, {})[dim] = ms
    merged = {c: {d: v for d, v in t.items() if v} for c, t in merged.items()}
    merged = {c: t for c, t in merged.items() if t}
    return merged or None


def _ms_stats(values_us: Sequence[float]) -> tuple[float, ...]:
    if not len(values_us):
        return (0.0,) * (1 + len(PERCENTILES))
    arr = np.asarray(values_us, dtype=np.float64)
    return (float(arr.sum()) / len(arr) / 1000.0,
            *(float(np.percentile(arr, p)) / 1000.0 for p in PERCENTILES))


def _valid(row: Mapping) -> bool:
    ttft, e2e = row["first"] - row["send"], row["last"] - row["send"]
    return row["status"] == "ok" and ttft > 0 and e2e > 0 and e2e >= ttft


def itl_diffs(chunks: Sequence[int]) -> list[int]:
    return [b - a for a, b in zip(chunks, chunks[1:]) if b - a > 0]


def metrics_block(rows: Sequence[Mapping], duration_s: float, itl: Mapping[int, Sequence[int]] | None = None,
                  goodput: Mapping | None = None, saturation: Mapping | None = None) -> dict:
    """rows: dicts with request_id, status, send, first, last, output_tokens, slo_class.
    itl: request_id → chunk timestamps (only with --record-itl)."""
    valid = [r for r in rows if _valid(r)]
    ttft = [r["first"] - r["send"] for r in valid]
    e2e = [r["last"] - r["send"] for r in valid]
    diffs = [d for ts in (itl or {}).values() if len(ts) >= 2 for d in itl_diffs(ts)]
    d = duration_s if duration_s > 0 else math.inf
    out: dict = {"instance_id": "", "completed_requests": len(valid), "still_queued": 0, "still_running": 0,
                 "injected_requests": 0, "total_input_tokens": 0, "total_output_tokens": 0,
                 "vllm_estimated_duration_s": 0.0,
                 "responses_per_sec": len(valid) / d, "tokens_per_sec": sum(r["output_tokens"] for r in valid) / d}
    for name, values in (("e2e", e2e), ("ttft", ttft), ("itl", diffs)):
        mean, *pcts = _ms_stats(values)
        out[f"{name}_mean_ms"] = mean
        for p, v in zip(PERCENTILES, pcts):
            out[f"{name}_p{p}_ms"] = v
    out.update({"scheduling_delay_p99_ms": 0.0, "preemption_count": 0, "dropped_unservable": 0,
                "length_capped_requests": 0, "timed_out_requests": 0})
    if saturation:
        out["saturation"] = dict(saturation)
    if goodput:
        for key in ("goodput_rps", "slo_attainment", "per_class"):
            if goodput.get(key):
                out[key] = goodput[key]
    return out


def goodput_block(rows: Sequence[Mapping], targets: Mapping[str, Mapping[str, float]], duration_s: float,
                  itl: Mapping[int, Sequence[int]] | None = None) -> dict:
    """Per-class SLO attainment and goodput (spec §8.4)."""
    d = duration_s if duration_s > 0 else math.inf
    per_class: dict = {}
    total_good = total_count = 0
    for cls in sorted(targets):
        t = targets[cls]
        mine = [r for r in rows if (r["slo_class"] or "default") == cls and r["status"] in ("ok", "error", "timeout")]
        valid = [r for r in mine if _valid(r)]
        good = 0
        met = {dim: 0 for dim in ("e2e", "itl", "ttft") if t.get(f"{dim}_ms")}
        evaluated = {dim: 0 for dim in met}
        itl_means = []
        for r in valid:
            ttft_ms, e2e_ms = (r["first"] - r["send"]) / 1000.0, (r["last"] - r["send"]) / 1000.0
            diffs = itl_diffs((itl or {}).get(r["request_id"], []))
            mean_itl = sum(diffs) / len(diffs) / 1000.0 if diffs else None
            if mean_itl is not None:
                itl_means.append(mean_itl)
            ok = {"ttft": ttft_ms <= t.get("ttft_ms", math.inf), "e2e": e2e_ms <= t.get("e2e_ms", math.inf),
                  "itl": mean_itl is not None and mean_itl <= t.get("itl_ms", math.inf)}
            for dim in met:
                evaluated[dim] += 1
                met[dim] += ok[dim]
            good += all(ok[dim] for dim in met)
        count = len(mine)
        entry: dict = {"count": count, "goodput_rps": good / d}
        if valid:
            entry["e2e_p99_ms"] = float(np.percentile([(r["last"] - r["send"]) for r in valid], 99)) / 1000.0
        if itl_means:
            entry["itl_mean_ms"] = sum(itl_means) / len(itl_means)
        entry["slo_attainment"] = good / count if count else 0.0
        by_dim = {dim: met[dim] / evaluated[dim] for dim in sorted(met) if evaluated[dim]}
        if by_dim:
            entry["slo_attainment_by_dim"] = by_dim
        if valid:
            entry["ttft_p99_ms"] = float(np.percentile([(r["first"] - r["send"]) for r in valid], 99)) / 1000.0
        per_class[cls] = dict(sorted(entry.items()))
        total_good += good
        total_count += count
    return {"goodput_rps": total_good / d, "slo_attainment": total_good / total_count if total_count else 0.0,
            "per_class": per_class}


def session_block(rows: Sequence[Mapping]) -> str:
    """The `=== Session Metrics ===` text, '' when no recorded row has a session id."""
    sessions = [r for r in rows if r["session_id"]]
    if not sessions:
        return ""
    cold, warm = [], []
    for r in sessions:
        if r["status"] == "ok" and r["first"] > 0 and r["send"] > 0:
            (cold if r["round_index"] == 0 else warm).append((r["first"] - r["send"]) / 1000.0)
    durations = []
    by_id: dict[str, list] = {}
    for r in sessions:
        by_id.setdefault(r["session_id"], []).append(r)
    for members in by_id.values():
        starts = [r["send"] for r in members if r["round_index"] == 0 and r["send"] > 0]
        ends = [r["last"] for r in members if r["last"] > 0]
        if starts and ends:
            span = (max(ends) - starts[0]) / 1000.0
            if span > 0:
                durations.append(span)
    lines = ["=== Session Metrics ===", f"  Sessions: {len(by_id)}"]
    for label, values in (("TTFT cold (round 0):", cold), ("TTFT warm (round≥1):", warm),
                          ("Session duration:   ", durations)):
        if values:
            arr = np.asarray(values)
            lines.append(f"  {label} mean={arr.mean():.2f} p50={np.percentile(arr, 50):.2f} "
                         f"p95={np.percentile(arr, 95):.2f} p99={np.percentile(arr, 99):.2f} ms (n={len(arr)})")
    return "\n".join(lines) + "\n"


def render(metrics: Mapping, sessions_text: str) -> str:
    return "=== Simulation Metrics ===\n" + go_json(metrics) + "\n" + sessions_text
