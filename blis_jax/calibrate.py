"""Calibration: observed per-request latencies against simulated ones (BLIS `calibrate`,
spec blis-features §1.4).

The inputs are two per-request tables keyed by `request_id`: the observed TraceV2 records
(send, first-chunk and last-chunk times, status), and the simulator's per-request results
(`replay --results-path`: `ttft_us`, `e2e_us` of completed requests). `pair_records` builds
the pairs:

* records with `request_id` < the warm-up count are dropped, then records whose status is
  not `ok`, then records without a simulated result, then pairs with a negative latency;
* real TTFT = first_chunk − send and real E2E = last_chunk − send, in µs, where send is the
  injection time (`send_time_us`, or `arrival_time_us` when send is 0), the origin of the
  simulated times too;
* the simulated side is made client-perspective: TTFT' = ttft + RTT + upload and
  E2E' = e2e + RTT + upload + download, with upload / download = tokens × 4 bytes × 8 bits /
  (Mbps · 10⁶) s for the input / output tokens (0 when the bandwidth is 0).

`compare` gives, per metric, the count, mean / p50 / p90 / p95 / p99 of both sides with signed
(sim − real) and relative ((sim − real) / real) errors, the request-level MAPE (mean of
|real − sim| / real over real ≠ 0, as a fraction), Pearson r, the bias direction (sign of
Σ(sim − real)) and BLIS's quality grade. Percentiles interpolate linearly at rank
p/100·(n−1), as the simulation metrics do. Undefined values (a MAPE with no real ≠ 0, r of
fewer than two pairs or of a constant side, an error relative to 0) are None, since JSON has
no NaN; an undefined r grades `poor`, as Go's NaN comparisons would.

`calibration_report` adds per-SLO-class and per-model breakdowns (when there are several),
a goodput comparison (SLO attainment, real against simulated, over the TTFT and E2E targets;
ITL targets need per-chunk data and are not compared), the KV-cache hit-rate comparison and
the TTFT MAPE threshold check. Field names are BLIS's where the spec gives them (`mape`,
`pearson_r`, `bias_direction`, `quality`, `count`, `token_mismatch_count`, ...).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.io_safety import load_json_text, read_text, short
from blis_jax.limits import INT64_MAX
from blis_jax.workload.requests import RequestSet

METRICS = ("ttft", "e2e")
STATISTICS = ("mean", "p50", "p90", "p95", "p99")
# (grade, MAPE below, Pearson r above), best first; anything else is `poor`.
QUALITY_GRADES = (("excellent", 0.10, 0.95), ("good", 0.20, 0.85), ("fair", 0.35, 0.70))
BITS_PER_TOKEN = 4 * 8  # BLIS's network model sends 4 bytes per token
OBSERVED_COLUMNS = ("first_chunk_time_us", "last_chunk_time_us", "status")
SIM_RESULT_FIELDS = ("request_id", "ttft_us", "e2e_us", "input_tokens", "output_tokens")
DEFAULT_LABEL = "default"  # name of the empty SLO class / model label, as in the goodput metrics
NO_TIME = -1  # an empty chunk-time cell


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class ObservedRecords:
    """Observed request records of a trace, one row per record (any order)."""

    request_id: np.ndarray      # int64[N]
    send_us: np.ndarray         # int64[N] injection time
    first_chunk_us: np.ndarray  # int64[N], NO_TIME where the cell is empty
    last_chunk_us: np.ndarray   # int64[N], NO_TIME where the cell is empty
    ok: np.ndarray              # bool[N] status == ok
    input_tokens: np.ndarray    # int64[N] prompt length as the simulator sees it
    output_tokens: np.ndarray   # int64[N]
    slo_class: np.ndarray       # str[N]
    model: np.ndarray           # str[N]


@dataclasses.dataclass(frozen=True)
class SimResults:
    """Per-request simulator results (completed requests), one row per entry."""

    request_id: np.ndarray      # int64[M]
    ttft_us: np.ndarray         # float64[M]
    e2e_us: np.ndarray          # float64[M]
    input_tokens: np.ndarray    # int64[M]
    output_tokens: np.ndarray   # int64[M]


@dataclasses.dataclass(frozen=True)
class NetworkModel:
    """Client ↔ server delays added to the simulated latencies."""

    rtt_us: float = 0.0
    bandwidth_mbps: float = 0.0  # 0 = no transfer delay

    def transfer_us(self, tokens: np.ndarray) -> np.ndarray:
        if self.bandwidth_mbps <= 0:
            return np.zeros(len(tokens), dtype=np.float64)
        # tokens · 32 bits / (Mbps · 1e6 bit/s) seconds, in µs
        return np.asarray(tokens, dtype=np.float64) * BITS_PER_TOKEN / self.bandwidth_mbps


def observed_from_trace(requests: RequestSet, source: str = "trace") -> ObservedRecords:
    """The observed columns of a TraceV2's records. An `ok` record must carry both chunk
    times; the error names the column and the request."""
    columns = requests.trace_columns
    missing = [name for name in OBSERVED_COLUMNS if name not in columns]
    if missing:
        raise ConfigError(f"{source}: no {', '.join(missing)} column; calibrate needs the observed "
                          "first/last chunk times and status of every request")
    ok = np.asarray(columns["status"]) == "ok"
    times = {}
    for name in OBSERVED_COLUMNS[:2]:
        cells = np.asarray(columns[name])
        empty = cells == ""
        values = np.where(empty, str(NO_TIME), cells).astype(np.int64)
        unrecorded = ok & empty
        if unrecorded.any():
            rid = int(requests.request_id[np.argmax(unrecorded)])
            raise ConfigError(f"{source}: column {name} is empty for request_id {rid} (status ok) and "
                              f"{int(unrecorded.sum())} record(s) in all; calibrate needs the observed chunk "
                              "times of every ok request (a trace recorded by `observe`, or written by "
                              "run/replay --trace-output)")
        times[name] = values
    return ObservedRecords(
        request_id=np.asarray(requests.request_id, dtype=np.int64),
        send_us=np.asarray(requests.arrival_us, dtype=np.int64),
        first_chunk_us=times["first_chunk_time_us"], last_chunk_us=times["last_chunk_time_us"], ok=ok,
        input_tokens=np.asarray(requests.input_len, dtype=np.int64),
        output_tokens=np.asarray(requests.output_len, dtype=np.int64),
        slo_class=np.asarray(requests.slo_class, dtype=str), model=np.asarray(requests.model, dtype=str))


def _read_json(path: str | Path, flag: str) -> Any:
    return load_json_text(read_text(path, f"{flag} {path}"), f"{flag} {path}")


def read_sim_results(path: str | Path, flag: str = "--sim-results") -> SimResults:
    """The JSON array that `replay --results-path` writes."""
    raw = _read_json(path, flag)
    where = f"{flag} {path}"
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a JSON array of per-request results (the file that "
                          "replay --results-path writes)")
    values: dict[str, list[float]] = {name: [] for name in SIM_RESULT_FIELDS}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: entry {i} is not an object")
        for name in SIM_RESULT_FIELDS:
            value = entry.get(name)
            if value is None:
                raise ConfigError(f"{where}: entry {i} has no {name}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    abs(value) > INT64_MAX or not math.isfinite(value):
                raise ConfigError(f"{where}: entry {i}, {name}: {short(value)} is not a finite number below 2^63")
            if name not in ("ttft_us", "e2e_us") and value != int(value):
                raise ConfigError(f"{where}: entry {i}, {name}: {short(value)} is not an integer")
            values[name].append(value)
    ids = np.asarray(values["request_id"], dtype=np.int64)
    unique, counts = np.unique(ids, return_counts=True)
    if np.any(counts > 1):
        raise ConfigError(f"{where}: request_id {int(unique[np.argmax(counts > 1)])} appears more than once")
    return SimResults(request_id=ids, ttft_us=np.asarray(values["ttft_us"], dtype=np.float64),
                      e2e_us=np.asarray(values["e2e_us"], dtype=np.float64),
                      input_tokens=np.asarray(values["input_tokens"], dtype=np.int64),
                      output_tokens=np.asarray(values["output_tokens"], dtype=np.int64))


def read_sim_hit_rate(path: str | Path, flag: str = "--sim-metrics") -> float:
    """`cache_hit_rate` of a `--metrics-path` file."""
    raw = _read_json(path, flag)
    value = raw.get("cache_hit_rate") if isinstance(raw, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{flag} {path}: no cache_hit_rate in [0, 1]; give the file that run/replay "
                          "--metrics-path writes")
    return float(value)


# ------------------------------------------------------------------------------ pairing


@dataclasses.dataclass(frozen=True)
class CalibrationPairs:
    """Matched latencies in µs, one row per kept request, ordered by request_id, plus how many
    records each filter removed."""

    request_id: np.ndarray             # int64[n]
    real: Mapping[str, np.ndarray]     # metric → float64[n]
    sim: Mapping[str, np.ndarray]      # metric → float64[n], client-perspective
    slo_class: np.ndarray              # str[n]
    model: np.ndarray                  # str[n]
    num_records: int
    warm_up_excluded: int
    not_ok_excluded: int
    unmatched_real: int                # kept records without a simulated result
    unmatched_sim: int                 # simulated results without a trace record
    negative_excluded: int
    token_mismatch_count: int          # pairs whose input or output token counts differ

    def __len__(self) -> int:
        return len(self.request_id)

    def trace_info(self) -> dict[str, int]:
        return {"num_requests": self.num_records, "warm_up_excluded": self.warm_up_excluded,
                "not_ok_excluded": self.not_ok_excluded, "unmatched_real": self.unmatched_real,
                "unmatched_sim": self.unmatched_sim, "negative_latency_excluded": self.negative_excluded,
                "matched_pairs": len(self), "token_mismatch_count": self.token_mismatch_count}


def pair_records(observed: ObservedRecords, sim: SimResults, *, warmup_requests: int = 0,
                 network: NetworkModel = NetworkModel()) -> CalibrationPairs:
    """Pair observed records with simulated results by request_id (see the module docstring)."""
    after_warmup = observed.request_id >= warmup_requests
    kept = after_warmup & observed.ok
    sim_order = np.argsort(sim.request_id, kind="stable")
    sim_ids = sim.request_id[sim_order]
    pos = np.searchsorted(sim_ids, observed.request_id)
    found = pos < len(sim_ids)
    found[found] = sim_ids[pos[found]] == observed.request_id[found]
    matched = kept & found
    rows = np.flatnonzero(matched)
    cols = sim_order[pos[rows]]

    upload = network.transfer_us(observed.input_tokens[rows])
    download = network.transfer_us(observed.output_tokens[rows])
    send = observed.send_us[rows].astype(np.float64)
    real = {"ttft": observed.first_chunk_us[rows] - send, "e2e": observed.last_chunk_us[rows] - send}
    simulated = {"ttft": sim.ttft_us[cols] + network.rtt_us + upload,
                 "e2e": sim.e2e_us[cols] + network.rtt_us + upload + download}
    valid = (real["ttft"] >= 0) & (real["e2e"] >= 0) & (sim.ttft_us[cols] >= 0) & (sim.e2e_us[cols] >= 0)
    rows, cols = rows[valid], cols[valid]
    order = np.argsort(observed.request_id[rows], kind="stable")
    rows, cols = rows[order], cols[order]
    keep = np.flatnonzero(valid)[order]  # positions in the matched rows, by request_id
    mismatch = ((observed.input_tokens[rows] != sim.input_tokens[cols])
                | (observed.output_tokens[rows] != sim.output_tokens[cols]))
    recorded = np.isin(sim.request_id, observed.request_id)
    return CalibrationPairs(
        request_id=observed.request_id[rows],
        real={m: np.asarray(v[keep], dtype=np.float64) for m, v in real.items()},
        sim={m: np.asarray(v[keep], dtype=np.float64) for m, v in simulated.items()},
        slo_class=observed.slo_class[rows], model=observed.model[rows],
        num_records=len(observed.request_id),
        warm_up_excluded=int((~after_warmup).sum()),
        not_ok_excluded=int((after_warmup & ~observed.ok).sum()),
        unmatched_real=int((kept & ~found).sum()),
        unmatched_sim=int((~recorded).sum()),
        negative_excluded=int((~valid).sum()),
        token_mismatch_count=int(mismatch.sum()))


# ----------------------------------------------------------------------------- statistics


def _statistic(values: np.ndarray, name: str) -> float:
    if name == "mean":
        return float(values.mean())
    return float(np.percentile(values, float(name[1:])))  # linear: rank p/100·(n−1)


def mape(real: np.ndarray, sim: np.ndarray) -> float | None:
    """Mean |real − sim| / real over the pairs with real ≠ 0 (a fraction, not %)."""
    nonzero = real != 0
    if not nonzero.any():
        return None
    return float(np.mean(np.abs(real[nonzero] - sim[nonzero]) / np.abs(real[nonzero])))


def pearson_r(real: np.ndarray, sim: np.ndarray) -> float | None:
    if len(real) < 2:
        return None
    dr, ds = real - real.mean(), sim - sim.mean()
    denom = math.sqrt(float(np.dot(dr, dr)) * float(np.dot(ds, ds)))
    if denom == 0:
        return None
    return min(1.0, max(-1.0, float(np.dot(dr, ds)) / denom))


def bias_direction(real: np.ndarray, sim: np.ndarray) -> str:
    total = float(np.sum(sim - real))
    return "over-predict" if total > 0 else "under-predict" if total < 0 else "neutral"


def quality(mape_value: float | None, r: float | None) -> str:
    if mape_value is None or r is None:
        return "poor"
    for grade, max_mape, min_r in QUALITY_GRADES:
        if mape_value < max_mape and r > min_r:
            return grade
    return "poor"


def compare(real: np.ndarray, sim: np.ndarray) -> dict[str, Any]:
    """MetricComparison of one metric over n ≥ 1 pairs (µs)."""
    if len(real) == 0 or len(real) != len(sim):
        raise ValueError(f"compare needs equal non-empty samples, got {len(real)} and {len(sim)}")
    m, r = mape(real, sim), pearson_r(real, sim)
    out: dict[str, Any] = {"count": len(real), "mape": m, "pearson_r": r,
                           "bias_direction": bias_direction(real, sim), "quality": quality(m, r)}
    for name in STATISTICS:
        real_value, sim_value = _statistic(real, name), _statistic(sim, name)
        out[f"real_{name}_us"] = real_value
        out[f"sim_{name}_us"] = sim_value
        out[f"{name}_error_us"] = sim_value - real_value
        out[f"{name}_relative_error"] = (sim_value - real_value) / real_value if real_value != 0 else None
    return out


def _compare_all(pairs: CalibrationPairs, rows: np.ndarray | slice = slice(None)) -> dict[str, Any]:
    return {m: compare(pairs.real[m][rows], pairs.sim[m][rows]) for m in METRICS}


def _breakdown(pairs: CalibrationPairs, labels: np.ndarray) -> dict[str, Any] | None:
    """Comparisons per label value; None when the pairs carry fewer than two labels."""
    named = np.where(labels == "", DEFAULT_LABEL, labels)
    values = sorted(set(named.tolist()))
    if len(values) < 2:
        return None
    return {v: _compare_all(pairs, named == v) for v in values}


def goodput_comparison(pairs: CalibrationPairs,
                       targets: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """SLO attainment per class with TTFT / E2E targets (ms), real against simulated: the
    fraction of the class's pairs that meet every such target."""
    classes = np.where(pairs.slo_class == "", DEFAULT_LABEL, pairs.slo_class)
    out: dict[str, Any] = {}
    for cls in sorted(targets):
        rows = classes == cls
        dims = [m for m in METRICS if f"{m}_ms" in targets[cls]]
        if not rows.any() or not dims:
            continue
        good = {side: np.ones(int(rows.sum()), dtype=bool) for side in ("real", "sim")}
        for m in dims:
            limit_us = float(targets[cls][f"{m}_ms"]) * 1000.0
            good["real"] &= pairs.real[m][rows] <= limit_us
            good["sim"] &= pairs.sim[m][rows] <= limit_us
        real_attainment, sim_attainment = float(good["real"].mean()), float(good["sim"].mean())
        out[cls] = {"count": int(rows.sum()), "targets": [f"{m}_ms" for m in dims],
                    "real_slo_attainment": real_attainment, "sim_slo_attainment": sim_attainment,
                    "attainment_error": sim_attainment - real_attainment}
    return out


def hit_rate_comparison(real: float, sim: float, tolerance_pp: float) -> dict[str, Any]:
    """KV prefix-cache hit rates (fractions) and their gap in percentage points."""
    gap_pp = abs(real - sim) * 100.0
    return {"real_hit_rate": real, "sim_hit_rate": sim, "difference_pp": gap_pp,
            "tolerance_pp": tolerance_pp, "within_tolerance": gap_pp <= tolerance_pp}


def calibration_report(pairs: CalibrationPairs, network: NetworkModel = NetworkModel(), *,
                       goodput_targets: Mapping[str, Mapping[str, float]] | None = None,
                       hit_rates: tuple[float, float] | None = None, hit_rate_tolerance_pp: float = 5.0,
                       ttft_mape_threshold: float = 0.15) -> dict[str, Any]:
    """The whole report; raises ConfigError when no pair is left to compare."""
    if len(pairs) == 0:
        info = pairs.trace_info()
        raise ConfigError(
            "no observed record has a simulated result to compare with ("
            + ", ".join(f"{k} {v}" for k, v in info.items() if k != "matched_pairs")
            + "); check that --sim-results comes from replaying this trace and that --warmup-requests "
              "leaves records")
    metrics = _compare_all(pairs)
    report: dict[str, Any] = {
        "trace_info": pairs.trace_info(),
        "network": {"rtt_us": network.rtt_us, "bandwidth_mbps": network.bandwidth_mbps},
        "metrics": metrics,
    }
    for key, labels in (("per_slo_class", pairs.slo_class), ("per_model", pairs.model)):
        breakdown = _breakdown(pairs, labels)
        if breakdown is not None:
            report[key] = breakdown
    if goodput_targets:
        report["goodput"] = goodput_comparison(pairs, goodput_targets)
    checks: dict[str, Any] = {}
    if hit_rates is not None:
        report["kv_hit_rate"] = hit_rate_comparison(*hit_rates, tolerance_pp=hit_rate_tolerance_pp)
        checks["hit_rate_within_tolerance"] = report["kv_hit_rate"]["within_tolerance"]
    ttft_mape = metrics["ttft"]["mape"]
    checks["ttft_mape_threshold"] = ttft_mape_threshold
    checks["ttft_mape_within_threshold"] = ttft_mape is not None and ttft_mape <= ttft_mape_threshold
    report["checks"] = checks
    return report


# ------------------------------------------------------------------------------- summary


def _format_number(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_summary(report: Mapping[str, Any]) -> str:
    """Short plain-text summary of a report (the JSON file has everything)."""
    info = report["trace_info"]
    lines = ["=== Calibration Report ===",
             (f"matched pairs: {info['matched_pairs']} of {info['num_requests']} records "
              f"(excluded: warm-up {info['warm_up_excluded']}, not ok {info['not_ok_excluded']}, "
              f"no simulated result {info['unmatched_real']}, negative latency "
              f"{info['negative_latency_excluded']}; simulated results without a record "
              f"{info['unmatched_sim']}; token mismatches {info['token_mismatch_count']})")]
    for metric, c in report["metrics"].items():
        mape_pct = None if c["mape"] is None else 100.0 * c["mape"]
        lines.append(f"{metric}: MAPE {_format_number(mape_pct, '.2f')}%, Pearson r "
                     f"{_format_number(c['pearson_r'], '.4f')}, bias {c['bias_direction']}, quality "
                     f"{c['quality']} (mean real {c['real_mean_us'] / 1000:.3f} ms, sim "
                     f"{c['sim_mean_us'] / 1000:.3f} ms; p99 real {c['real_p99_us'] / 1000:.3f} ms, "
                     f"sim {c['sim_p99_us'] / 1000:.3f} ms)")
    for cls, g in report.get("goodput", {}).items():
        lines.append(f"goodput {cls}: SLO attainment real {g['real_slo_attainment']:.4f}, "
                     f"sim {g['sim_slo_attainment']:.4f} ({', '.join(g['targets'])})")
    if "kv_hit_rate" in report:
        kv = report["kv_hit_rate"]
        verdict = "within" if kv["within_tolerance"] else "outside"
        lines.append(f"kv hit rate: real {kv['real_hit_rate']:.4f}, sim {kv['sim_hit_rate']:.4f}, "
                     f"difference {kv['difference_pp']:.2f} pp ({verdict} the {kv['tolerance_pp']:g} pp tolerance)")
    return "\n".join(lines) + "\n"
