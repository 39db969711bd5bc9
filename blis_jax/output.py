"""Rendering of metrics exactly as BLIS prints them: Go `encoding/json` (MarshalIndent, two
spaces) for the JSON blocks and files, and the plain-text stdout sections (spec §1.9).

Go formats a float64 with the shortest digits that round-trip, in positional notation
unless |x| < 1e-6 or ≥ 1e21, so 0.0 prints as `0` and 15.0 as `15`; Python's `json` would
print `0.0` and `15.0`. Hence a small encoder of our own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Mapping, Sequence
from decimal import Decimal
from pathlib import Path

import numpy as np

from blis_jax.engine.output import NOT_ARRIVED, SimOutput
from blis_jax.errors import ConfigError
from blis_jax.io_safety import atomic_write_text
from blis_jax.metrics import (
    GOODPUT_KEYS,
    AnomalyCounters,
    ClassLatency,
    KVCacheMetrics,
    ModelLatency,
    SessionSummary,
    TenantUsage,
    anomaly_counters,
    kv_cache_metrics,
    metrics_output,
    per_model_latencies,
    per_slo_latencies,
    per_tenant_usage,
    request_records,
    results_entries,
    session_summary,
)
from blis_jax.workload.requests import RequestSet

METRICS_HEADER = "=== Simulation Metrics ==="
ANOMALY_HEADER = "=== Anomaly Counters ==="
KV_CACHE_HEADER = "=== KV Cache Metrics ==="
PER_SLO_HEADER = "=== Per-SLO Metrics ==="
PER_MODEL_HEADER = "=== Per-Model Metrics ==="
PER_TENANT_HEADER = "=== Per-Tenant Metrics ==="
SESSION_HEADER = "=== Session Metrics ==="


# ------------------------------------------------------------------------ Go-style JSON


def go_float(x: float) -> str:
    """Go encoding/json rendering of a float64."""
    x = float(x)
    if not math.isfinite(x):
        raise ConfigError(f"cannot write {x} as JSON (Go's encoder rejects NaN and ±Inf)")
    if x == 0:
        return "-0" if math.copysign(1.0, x) < 0 else "0"
    d = Decimal(repr(x)).normalize()   # repr = shortest round-trip digits, as Go's -1 precision
    if 1e-6 <= abs(x) < 1e21:
        return format(d, "f")
    sign, digits, exponent = d.as_tuple()
    mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
    exp10 = exponent + len(digits) - 1
    # Go writes at least two exponent digits, then shortens e-0X to e-X.
    exp = f"{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    if exp10 < 0 and abs(exp10) < 10:
        exp = f"-{abs(exp10)}"
    return ("-" if sign else "") + mantissa + "e" + exp


def go_string(s: str) -> str:
    # Go escapes <, >, & (HTML safety) and U+2028/2029, and leaves other non-ASCII alone.
    out = json.dumps(s, ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        out = out.replace(ch, esc)
    return out


def go_json(value, indent: str = "  ", _level: int = 0) -> str:
    """json.MarshalIndent(value, "", indent) for dicts (insertion order), lists, str, int,
    float, bool and None. No trailing newline, like MarshalIndent."""
    pad, inner = indent * _level, indent * (_level + 1)
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = [f"{inner}{go_string(str(k))}: {go_json(v, indent, _level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        return "[\n" + ",\n".join(inner + go_json(v, indent, _level + 1) for v in value) + "\n" + pad + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return go_string(value)
    if hasattr(value, "dtype"):  # numpy scalar
        value = value.item()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    raise ConfigError(f"cannot write {type(value).__name__} as JSON")


# ---------------------------------------------------------------------- stdout sections


def format_metrics_block(metrics: Mapping) -> str:
    return f"{METRICS_HEADER}\n{go_json(metrics)}\n"


def format_anomaly_section(counters: AnomalyCounters) -> str:
    """The Anomaly Counters section, or '' when every counter is zero."""
    if not counters.any_nonzero():
        return ""
    lines = [ANOMALY_HEADER,
             f"Priority Inversions: {counters.priority_inversions}",
             f"HOL Blocking Events: {counters.hol_blocking_events}",
             f"Rejected Requests (Admission): {counters.rejected_admission}",
             *(f"  Shed ({cls}): {n}" for cls, n in counters.shed_by_class),
             f"Rejected Requests (Routing): {counters.rejected_routing}",
             f"Dropped Unservable: {counters.dropped_unservable}",
             f"Timed Out Requests: {counters.timed_out}",
             f"Length-Capped Requests: {counters.length_capped}"]
    if counters.flow_control:
        lines += [f"Gateway Queue Depth (end): {counters.gateway_queued}",
                  f"Gateway Queue Shed: {counters.gateway_shed}",
                  f"Gateway Queue Rejected: {counters.gateway_rejected}",
                  f"Gateway Expired: {counters.gateway_expired}"]
    if counters.encode_routing_rejections:  # E/P/D (name and placement unverified against BLIS's output)
        lines.append(f"Encode Routing Rejections: {counters.encode_routing_rejections}")
    return "\n".join(lines) + "\n"


def format_kv_cache_section(kv: KVCacheMetrics) -> str:
    """The KV Cache Metrics section, or '' when all three figures are zero."""
    if not kv.any_nonzero():
        return ""
    return (f"{KV_CACHE_HEADER}\n"
            f"Preemption Rate: {kv.preemption_rate:.4f}\n"
            f"Cache Hit Rate: {kv.cache_hit_rate:.4f}\n"
            f"KV Thrashing Rate: {kv.thrashing_rate:.4f}\n")


def format_per_slo_section(stats: Sequence[ClassLatency]) -> str:
    """The Per-SLO Metrics section (values in µs, unlabelled, as BLIS prints them)."""
    if not stats:
        return ""
    lines = [PER_SLO_HEADER]
    for c in stats:
        lines += [f"  {c.slo_class}:",
                  f"    TTFT: mean={c.ttft_mean_us:.2f} p99={c.ttft_p99_us:.2f} (n={c.count})",
                  f"    ITL:  mean={c.itl_mean_us:.2f} p99={c.itl_p99_us:.2f} (n={c.count})",
                  f"    E2E:  mean={c.e2e_mean_us:.2f} p99={c.e2e_p99_us:.2f} (n={c.count})"]
    return "\n".join(lines) + "\n"


def format_per_model_section(stats: Sequence[ModelLatency]) -> str:
    """The Per-Model Metrics section (p50 / p99 in µs, unlabelled, as BLIS prints them)."""
    if not stats:
        return ""
    lines = [PER_MODEL_HEADER]
    for m in stats:
        lines += [f"  {m.model}:",
                  f"    TTFT: p50={m.ttft_p50_us:.2f} p99={m.ttft_p99_us:.2f} (n={m.ttft_count})",
                  f"    E2E:  p50={m.e2e_p50_us:.2f} p99={m.e2e_p99_us:.2f} (n={m.e2e_count})",
                  f"    Throughput: {m.requests_per_s:.2f} req/s, {m.tokens_per_s:.2f} tok/s"]
    return "\n".join(lines) + "\n"


def format_per_tenant_section(usage: TenantUsage | None) -> str:
    if usage is None:
        return ""
    lines = [PER_TENANT_HEADER]
    lines += [f"  {tenant}: requests={n}, tokens={tokens}" for tenant, n, tokens in usage.tenants]
    lines.append(f"  Jain Fairness Index: {usage.jain_index:.4f}")
    return "\n".join(lines) + "\n"


def format_session_section(summary: SessionSummary | None) -> str:
    if summary is None:
        return ""

    def line(label: str, st) -> str:
        mean, p50, p95, p99 = (x / 1000.0 for x in st[:4])
        n = st[4]
        return f"  {label}mean={mean:.2f} p50={p50:.2f} p95={p95:.2f} p99={p99:.2f} ms (n={n})"

    lines = [SESSION_HEADER, f"  Sessions: {summary.sessions}",
             line("TTFT cold (round 0): ", summary.ttft_cold)]
    if summary.ttft_warm[4]:
        lines.append(line("TTFT warm (round≥1): ", summary.ttft_warm))
    lines.append(line("Session duration:    ", summary.duration))
    return "\n".join(lines) + "\n"


def render_stdout(out: SimOutput, requests: RequestSet, *, scheduler: str = "fcfs",
                  hol_blocking_events: int = 0, rejected_routing: int = 0,
                  thrashing_rate: float = 0.0,
                  goodput_targets: Mapping[str, Mapping[str, float]] | None = None,
                  extra_sections: Sequence[str] = (),
                  instance_outputs: Sequence[SimOutput] | None = None,
                  instance_requests: Sequence | None = None,
                  per_instance_blocks: bool | None = None) -> str:
    """The `run` / `replay` stdout: per-instance blocks (more than one instance), the cluster
    block, then the Anomaly, KV-cache, Per-SLO, Per-Model, Per-Tenant and Session sections when they
    apply, then `extra_sections` (already formatted, e.g. PD metrics, produced elsewhere).
    `instance_outputs[k]` is what instance k itself served, when that differs from the
    request-level `out` (PD sub-requests), with its own rows `instance_requests[k]` where not
    None (a pod that served a request twice). `per_instance_blocks`: BLIS prints them when
    `--num-instances` > 1, even if node pools placed only one (None: more than one instance)."""
    parts = []
    if out.num_instances > 1 if per_instance_blocks is None else per_instance_blocks:
        views = instance_outputs if instance_outputs is not None else [out] * out.num_instances
        rows = [(instance_requests[k] if instance_requests else None) or requests for k in range(out.num_instances)]
        parts += [format_metrics_block(metrics_output(views[k], rows[k], k)) for k in range(out.num_instances)]
    parts.append(format_metrics_block(metrics_output(out, requests, goodput_targets=goodput_targets)))
    parts.append(format_anomaly_section(anomaly_counters(
        out, requests, scheduler=scheduler, hol_blocking_events=hol_blocking_events,
        rejected_routing=rejected_routing)))
    parts.append(format_kv_cache_section(kv_cache_metrics(out, thrashing_rate)))
    parts.append(format_per_slo_section(per_slo_latencies(out, requests, goodput_targets)))
    parts.append(format_per_model_section(per_model_latencies(out, requests)))
    parts.append(format_per_tenant_section(per_tenant_usage(out, requests)))
    parts.append(format_session_section(session_summary(out, requests)))
    parts.extend(extra_sections)
    return "".join(parts)


# -------------------------------------------------------------------------------- files


def metrics_file_text(out: SimOutput, requests: RequestSet,
                      goodput_targets: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """--metrics-path content: cluster block + cache_hit_rate + per-request records.
    BLIS writes the goodput fields after `requests`."""
    block = metrics_output(out, requests, with_cache_hit_rate=True, goodput_targets=goodput_targets)
    goodput = {k: block.pop(k) for k in (*GOODPUT_KEYS, "adapters") if k in block}
    body = {**block, "requests": request_records(out, requests), **goodput}
    return go_json(body)


def results_file_text(out: SimOutput, requests: RequestSet) -> str:
    """--results-path content: completed requests sorted by request_id."""
    return go_json(results_entries(out, requests))


def write_metrics_file(path: str | Path, out: SimOutput, requests: RequestSet,
                       goodput_targets: Mapping[str, Mapping[str, float]] | None = None) -> None:
    atomic_write_text(path, metrics_file_text(out, requests, goodput_targets))


def write_results_file(path: str | Path, out: SimOutput, requests: RequestSet) -> None:
    atomic_write_text(path, results_file_text(out, requests))


# ----------------------------------------------------------------------------- PD metrics


@dataclasses.dataclass(frozen=True)
class PDSummary:
    """Figures of the `=== PD Metrics ===` section."""

    disaggregated: int
    dropped_at_decode: int
    prefill_throughput: float  # prefill sub-requests completed per second of simulated time
    decode_throughput: float
    load_imbalance: float  # max / min of the two throughputs (1 = balanced pools)
    parent_ttft_us: np.ndarray
    transfer_us: np.ndarray
    # with transfer contention: transfers in flight at each start, itself included (else None)
    transfers_in_flight: np.ndarray | None = None


def pd_summary(out: SimOutput, views) -> PDSummary:
    duration_s = float(int(out.sim_end_us.max())) / 1e6 if out.num_instances else 0.0
    rate = (lambda n: n / duration_s if duration_s > 0 else 0.0)  # noqa: E731
    prefill, decode = rate(views.prefill_completed), rate(views.decode_completed)
    low, high = min(prefill, decode), max(prefill, decode)
    ttft = out.ttft_us[views.disaggregated & (out.ttft_us >= 0)]
    return PDSummary(disaggregated=int(views.disaggregated.sum()), dropped_at_decode=views.dropped_at_decode,
                     prefill_throughput=prefill, decode_throughput=decode,
                     load_imbalance=high / low if low > 0 else 0.0, parent_ttft_us=ttft,
                     transfer_us=np.asarray(views.transfer_us),
                     transfers_in_flight=np.asarray(views.transfers_in_flight) if views.contention else None)


def pd_trace_outcomes(out: SimOutput, views):
    """The per-request outcome the trace export records under PD: BLIS's trace recorder never
    sees a disaggregated request finish (its prefill and decode sub-requests do), so its row is
    `incomplete` with zero chunk times; other requests keep their own outcome."""
    split = np.asarray(views.disaggregated, bool)
    return types.SimpleNamespace(status=np.where(split, NOT_ARRIVED, out.status),
                                 ttft_us=np.where(split, -1, out.ttft_us), itl_sum_us=out.itl_sum_us)


def format_pd_section(s: PDSummary) -> str:
    def stats(values: np.ndarray) -> str:
        if values.size == 0:
            return "mean=0.0 p50=0.0 p95=0.0 p99=0.0"
        v = np.sort(values.astype(np.float64))
        pct = lambda p: float(np.interp(p / 100 * (v.size - 1), np.arange(v.size), v))  # noqa: E731
        return f"mean={v.mean():.1f} p50={pct(50):.1f} p95={pct(95):.1f} p99={pct(99):.1f}"

    if s.disaggregated == 0:  # BLIS prints the section only when some request was disaggregated
        return ""
    queue = ""
    if s.transfers_in_flight is not None:
        depth = s.transfers_in_flight
        queue = (f"Peak Concurrent Transfers: {int(depth.max()) if depth.size else 0}\n"
                 f"Mean Transfer Queue Depth: {float(depth.mean()) if depth.size else 0.0:.4f}\n")
    return ("=== PD Metrics ===\n"
            f"Disaggregated Requests: {s.disaggregated}\n"
            f"Dropped at Decode KV: {s.dropped_at_decode}\n"
            f"Prefill Throughput: {s.prefill_throughput:.4f} sub-req/s\n"
            f"Decode Throughput: {s.decode_throughput:.4f} sub-req/s\n"
            f"Load Imbalance Ratio: {s.load_imbalance:.4f}\n"
            f"Parent TTFT (us): {stats(s.parent_ttft_us)}\n"
            f"KV Transfer Duration (us): {stats(s.transfer_us)}\n" + queue)
