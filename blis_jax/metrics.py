"""SimOutput → BLIS's metrics: the MetricsOutput block (with goodput fields when targets are
given), per-request records, results.json entries, and the figures behind the Anomaly,
KV-cache, Per-SLO and Per-Tenant text sections (spec §1.9, §2.12).

Everything is numpy on the host and reproduces BLIS's float arithmetic operation by
operation, so values agree to the last bit with Go's output:
* mean  = float64(Σ µs) / n / 1000;
* pXX   = lo/1000 + (hi − lo)·frac/1000 on the sorted µs sample at rank p/100·(n−1);
* per-request ITL mean = Σ ITL / max(output − 1, 1) µs (length-capped: / max(#ITL − 1, 1)).
Dict key order is BLIS's JSON field order; `blis_jax.output` renders them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping

import numpy as np

from blis_jax.engine.output import SimOutput, is_completed
from blis_jax.engine.status import (
    ENCODE_REJECTED,
    GATEWAY_EXPIRED,
    GATEWAY_QUEUED,
    GATEWAY_REJECTED,
    GATEWAY_SHED,
    LENGTH_CAPPED,
    NOT_ARRIVED,
    QUEUED,
    REJECTED,
    ROUTING_REJECTED,
    RUNNING,
    TIMED_OUT,
)
from blis_jax.errors import ConfigError
from blis_jax.workload.requests import RequestSet

CLUSTER = "cluster"
PERCENTILES = (90, 95, 99)  # BLIS reports mean, p90, p95, p99 (no p50)
# Requests that reached an instance and still have a per-request record at the end.
_RECORDED = (QUEUED, RUNNING, TIMED_OUT)


def instance_name(k: int, out: SimOutput | None = None) -> str:
    """Instance k's ID: `out.instance_names[k]` when the run named its instances, else instance_<k>."""
    if out is not None and out.instance_names is not None:
        return out.instance_names[k]
    return f"instance_{k}"


# ----------------------------------------------------------------------------- statistics


def percentile_ms(values_us: np.ndarray, p: float) -> float:
    """BLIS percentile of a µs sample, in ms; 0 for an empty sample."""
    v = np.asarray(values_us)
    # float64 values (warm-up-adjusted TTFTs) stay floats, as in BLIS's maps
    return _sorted_percentile_ms(np.sort(v if v.dtype == np.float64 else v.astype(np.int64)), p)


def _sorted_percentile_ms(v: np.ndarray, p: float, ends: np.ndarray | None = None) -> float:
    """Percentile of sorted values `v`; with `ends` (cumulative counts), `v[k]` stands for
    `ends[k] - ends[k-1]` equal samples (the ITL pool's compressed form)."""
    n = v.shape[0] if ends is None else (int(ends[-1]) if ends.shape[0] else 0)
    if n == 0:
        return 0.0
    rank = p / 100.0 * float(n - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    frac = rank - float(lo)
    v_lo, v_hi = (v[lo], v[hi]) if ends is None else v[np.searchsorted(ends, [lo, hi], side="right")]
    return float(v_lo) / 1000.0 + float(v_hi - v_lo) * frac / 1000.0


def mean_ms(values_us: np.ndarray) -> float:
    """Arithmetic mean of a µs sample, in ms; 0 for an empty sample."""
    v = np.asarray(values_us)
    if v.shape[0] == 0:
        return 0.0
    if v.dtype == np.float64:  # warm-up-adjusted TTFTs: BLIS's int64 sum gains trunc(τ·f − τ) per value
        v = np.trunc(v).astype(np.int64)
    return float(int(v.sum(dtype=np.int64))) / float(v.shape[0]) / 1000.0


def _distribution(prefix: str, values_us: np.ndarray) -> dict[str, float]:
    ordered = np.sort(np.asarray(values_us))
    out = {f"{prefix}_mean_ms": mean_ms(values_us)}
    out.update({f"{prefix}_p{p}_ms": _sorted_percentile_ms(ordered, p) for p in PERCENTILES})
    return out


def _pooled_distribution(prefix: str, values_us: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """`_distribution` of the sample in which value k occurs counts[k] times (same figures)."""
    values, counts = np.asarray(values_us, np.int64), np.asarray(counts, np.int64)
    ordered, ends = _ordered_pool(values, counts)
    n = int(ends[-1]) if ends.shape[0] else 0
    total = int((values * counts).sum())
    out = {f"{prefix}_mean_ms": float(total) / float(n) / 1000.0 if n else 0.0}
    out.update({f"{prefix}_p{p}_ms": _sorted_percentile_ms(ordered, p, ends) for p in PERCENTILES})
    return out


def _ordered_pool(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a pooled sample in ascending order, with cumulative counts.
    Step times span a narrow range of µs, so a histogram over it is several times faster
    than sorting (a sweep reads one pool per scenario); a wide span falls back to a sort."""
    if values.shape[0] == 0:
        return values, counts
    low = int(values.min())
    span = int(values.max()) - low + 1
    if span > 4 * values.shape[0] + 4096:
        order = np.argsort(values)  # equal values are interchangeable: any order gives the same figures
        return values[order], np.cumsum(counts[order])
    # float64 weights are exact: a pool holds far fewer than 2**53 samples
    histogram = np.bincount(values - low, weights=counts, minlength=span)
    present = np.flatnonzero(histogram)
    return present + low, np.cumsum(histogram[present]).astype(np.int64)


# ---------------------------------------------------------------------------- per request


def per_request_itl_mean_us(out: SimOutput, requests: RequestSet) -> np.ndarray:
    """Mean inter-token latency per completed request (µs, float64); 0 for the others."""
    _check_aligned(out, requests)
    capped = out.status == LENGTH_CAPPED
    gaps = np.where(capped, out.num_itl - 1, requests.output_len - 1)
    denom = np.maximum(gaps, 1).astype(np.float64)
    mean = out.itl_sum_us.astype(np.float64) / denom
    return np.where(out.completed_mask(), mean, 0.0)


def request_records(out: SimOutput, requests: RequestSet) -> list[dict]:
    """metrics.json `requests`: every request that reached an instance and was not dropped
    (completed, timed out, still queued or running), sorted by arrival (stable)."""
    _check_aligned(out, requests)
    itl_us = per_request_itl_mean_us(out, requests)
    done = out.completed_mask()
    keep = np.flatnonzero(done | np.isin(out.status, _RECORDED))
    keep = keep[np.argsort(requests.arrival_us[keep], kind="stable")]
    return [_record(out, requests, int(i), float(itl_us[i]), bool(done[i])) for i in keep]


def _record(out: SimOutput, requests: RequestSet, i: int, itl_us: float, done: bool) -> dict:
    ttft, sched = out.cluster_ttft_us[i], int(out.sched_delay_us[i])  # TTFT: float with the warm-up penalty
    rec: dict = {
        "arrived_at": float(requests.arrival_us[i]) / 1e6,
        "requestID": f"request_{int(requests.request_id[i])}",
        "num_prefill_tokens": int(requests.input_len[i]),
        "num_decode_tokens": int(requests.output_len[i]),
        "ttft_ms": float(ttft) / 1000.0 if ttft >= 0 else 0.0,
        "itl_ms": itl_us / 1000.0,
        "e2e_ms": float(out.e2e_us[i]) / 1000.0 if done else 0.0,
        "scheduling_delay_ms": float(sched) / 1000.0 if sched >= 0 else 0.0,
    }
    _put_label(rec, "slo_class", requests.slo_class[i])
    _put_label(rec, "tenant_id", requests.tenant_id[i])
    if out.handled_by[i] >= 0:
        rec["handled_by"] = instance_name(int(out.handled_by[i]), out)
    _put_label(rec, "model", requests.model[i])
    if out.adapter_ids:
        _put_label(rec, "adapter", _adapter_labels(requests)[i])
    if out.status[i] == LENGTH_CAPPED:
        rec["length_capped"] = True
    if out.gateway_delay_us is not None and out.gateway_delay_us[i] >= 0:
        rec["gateway_queue_delay_ms"] = float(out.gateway_delay_us[i]) / 1000.0
    _put_label(rec, "session_id", requests.session_id[i])
    rec["round_index"] = int(requests.round_index[i])
    return rec


def results_entries(out: SimOutput, requests: RequestSet) -> list[dict]:
    """results.json: one entry per completed request, sorted by request_id."""
    _check_aligned(out, requests)
    itl_us = per_request_itl_mean_us(out, requests)
    done = np.flatnonzero(out.completed_mask())
    done = done[np.argsort(requests.request_id[done], kind="stable")]
    entries = []
    for i in done:
        entry = {"request_id": int(requests.request_id[i]), "ttft_us": int(out.ttft_us[i]),
                 "e2e_us": int(out.e2e_us[i]), "input_tokens": int(requests.input_len[i]),
                 "output_tokens": int(out.output_tokens[i])}
        _put_label(entry, "slo_class", requests.slo_class[i])
        _put_label(entry, "model", requests.model[i])
        if itl_us[i] != 0:
            entry["itl_mean_us"] = float(itl_us[i])
        entries.append(entry)
    return entries


def _put_label(d: dict, key: str, value) -> None:
    if str(value):
        d[key] = str(value)


# --------------------------------------------------------------------- MetricsOutput block


def metrics_output(out: SimOutput, requests: RequestSet, instance: int | None = None, *,
                   with_cache_hit_rate: bool = False,
                   goodput_targets: Mapping[str, Mapping[str, float]] | None = None) -> dict:
    """BLIS MetricsOutput for the cluster (`instance=None`) or one instance.

    `with_cache_hit_rate` adds the --metrics-path-only `cache_hit_rate` field;
    `goodput_targets` ({class: {ttft_ms, itl_ms, e2e_ms}}) adds the cluster goodput fields.
    """
    _check_aligned(out, requests)
    if instance is not None and not 0 <= instance < out.num_instances:
        raise ConfigError(f"metrics_output: instance {instance} outside 0..{out.num_instances - 1}")
    rows = np.ones(out.num_requests, bool) if instance is None else out.handled_by == instance
    inst = slice(None) if instance is None else slice(instance, instance + 1)
    done = out.completed_mask() & rows

    def counter(name: str) -> int:
        return int(getattr(out, name)[inst].sum())

    completed = int(done.sum())
    queued, running = counter("still_queued"), counter("still_running")
    dropped, timed_out = counter("dropped_unservable"), counter("timed_out")
    output_tokens = int(out.output_tokens[done].sum())
    sim_end = int(out.sim_end_us[inst].max()) if out.num_instances else 0
    duration_s = float(sim_end) / 1e6
    m: dict = {
        "instance_id": CLUSTER if instance is None else instance_name(instance, out),
        "completed_requests": completed,
        "still_queued": queued,
        "still_running": running,
        "injected_requests": completed + queued + running + dropped + timed_out,
        "total_input_tokens": counter("total_input_tokens"),
        "total_output_tokens": output_tokens,
        "vllm_estimated_duration_s": duration_s,
        "responses_per_sec": float(completed) / duration_s if duration_s > 0 else 0.0,
        "tokens_per_sec": float(output_tokens) / duration_s if duration_s > 0 else 0.0,
    }
    m.update(_latency_fields(out, rows, done, out.cluster_ttft_us if instance is None else out.ttft_us))
    failures = counter("kv_allocation_failures")
    if failures:
        m["kv_allocation_failures"] = failures
    m["preemption_count"] = counter("preemption_count")
    if with_cache_hit_rate:
        m["cache_hit_rate"] = cache_hit_rate(out, instance)
    m["dropped_unservable"] = dropped
    m["length_capped_requests"] = counter("length_capped")
    m["timed_out_requests"] = timed_out
    if goodput_targets and instance is None:
        m.update(goodput_fields(out, requests, goodput_targets))
    if out.adapter_ids:
        m["adapters"] = adapter_metrics(out, requests, instance, done, duration_s)
    return m


def _adapter_labels(requests: RequestSet) -> np.ndarray:
    column = requests.trace_columns.get("adapter")
    return np.full(len(requests), "", object) if column is None else np.asarray(column, object).astype(str)


def adapter_metrics(out: SimOutput, requests: RequestSet, instance: int | None, done: np.ndarray,
                    duration_s: float) -> dict:
    """The `adapters` block: per LoRA adapter (by id) cold loads and evictions, TTFT p50 / p99
    (µs) and output-token throughput over its completed requests. An adapter appears when it
    was loaded or completed a request here."""
    labels = _adapter_labels(requests)
    inst = slice(None) if instance is None else slice(instance, instance + 1)
    loads = np.asarray(out.adapter_loads)[inst].sum(axis=0)
    evictions = np.asarray(out.adapter_evictions)[inst].sum(axis=0)
    block = {}
    for k in sorted(range(len(out.adapter_ids)), key=lambda k: out.adapter_ids[k]):
        mine = done & (labels == out.adapter_ids[k])
        if not mine.any() and loads[k] == 0:
            continue
        ttft = out.ttft_us[mine]
        tokens = int(out.output_tokens[mine].sum())
        block[out.adapter_ids[k]] = {
            "load_count": int(loads[k]),
            "eviction_count": int(evictions[k]),
            # BLIS takes the percentile in ms and multiplies back (the last bits show it)
            "ttft_p50_us": percentile_ms(ttft, 50) * 1000.0,
            "ttft_p99_us": percentile_ms(ttft, 99) * 1000.0,
            "throughput_tok_per_s": float(tokens) / duration_s if duration_s > 0 else 0.0,
        }
    return block


def _latency_fields(out: SimOutput, rows: np.ndarray, done: np.ndarray, ttft_us: np.ndarray) -> dict[str, float]:
    """E2E / TTFT / ITL distributions and p99 scheduling delay; all 0 without completions
    (BLIS computes aggregates only when completed_requests > 0). `ttft_us`: the cluster's
    (warm-up penalty: floats, whose mean sums trunc(τ·f) = τ + trunc(τ·f − τ) as BLIS's TTFT
    sum does) or an instance's own."""
    if not done.any():
        empty = np.zeros(0, np.int64)
        return {**_distribution("e2e", empty), **_distribution("ttft", empty),
                **_distribution("itl", empty), "scheduling_delay_p99_ms": 0.0}
    ttft = ttft_us[rows & (ttft_us >= 0)]            # includes later time-outs
    # pooled gaps, not per-request means
    itl_values, itl_counts = out.itl_pool(None if rows.all() else rows)
    sched = out.sched_delay_us[rows & (out.sched_delay_us >= 0)]
    return {**_distribution("e2e", out.e2e_us[done]), **_distribution("ttft", ttft),
            **_pooled_distribution("itl", itl_values, itl_counts), "scheduling_delay_p99_ms": percentile_ms(sched, 99)}


GOODPUT_KEYS = ("goodput_rps", "slo_attainment", "per_class")
_DEFAULT_CLASS = "default"  # goodput name of the empty SLO class


def goodput_fields(out: SimOutput, requests: RequestSet,
                   targets: Mapping[str, Mapping[str, float]]) -> dict:
    """`goodput_rps`, `slo_attainment`, `per_class` for classes with targets (spec §1.9).

    A completed request is good when every configured dimension is met (TTFT ≤ target,
    per-request mean ITL ≤ target, E2E ≤ target; a request without inter-token gaps fails an
    ITL target). Attainment divides by every request of the class that reached the cluster
    (rejected, dropped and timed-out ones count against it). Keys of `per_class` and of its
    entries are sorted, as Go writes maps.
    """
    _check_aligned(out, requests)
    duration_s = float(int(out.sim_end_us.max())) / 1e6 if out.num_instances else 0.0
    itl_us = per_request_itl_mean_us(out, requests)
    has_itl = out.num_itl > 0
    arrived = out.status != NOT_ARRIVED
    done = out.completed_mask()
    classes = np.array([str(c) or _DEFAULT_CLASS for c in requests.slo_class])
    per_class: dict[str, dict] = {}
    total_good = total_injected = 0
    for cls in sorted(targets):
        injected = int((arrived & (classes == cls)).sum())
        if out.extra_arrivals is not None:   # redirected (twice) and discarded requests (drain policies)
            injected += int(out.extra_arrivals[classes == cls].sum())
        if injected == 0:
            continue
        rows = done & (classes == cls)
        good, by_dim = rows.copy(), {}
        for dim, value_us, present in (("e2e", out.e2e_us, rows), ("itl", itl_us, has_itl),
                                       ("ttft", out.cluster_ttft_us, out.ttft_us >= 0)):
            target = targets[cls].get(f"{dim}_ms")
            if target is None:
                continue
            met = rows & present & (value_us <= float(target) * 1000.0)
            good &= met
            evaluated = int(rows.sum())
            by_dim[dim] = int(met.sum()) / evaluated if evaluated else 0.0
        n_good = int(good.sum())
        total_good, total_injected = total_good + n_good, total_injected + injected
        per_class[cls] = {
            "count": int(rows.sum()),
            "e2e_p99_ms": percentile_ms(out.e2e_us[rows], 99),
            "goodput_rps": n_good / duration_s if duration_s > 0 else 0.0,
            "itl_mean_ms": _sum_in_id_order(itl_us, rows, requests) / float(max(rows.sum(), 1)) / 1000.0,
            "slo_attainment": n_good / injected,
            "slo_attainment_by_dim": by_dim,
            "ttft_p99_ms": percentile_ms(out.cluster_ttft_us[rows], 99),
        }
    return {"goodput_rps": total_good / duration_s if duration_s > 0 else 0.0,
            "slo_attainment": total_good / total_injected if total_injected else 0.0,
            "per_class": per_class}


def _sum_in_id_order(values: np.ndarray, rows: np.ndarray, requests: RequestSet) -> float:
    """Σ values[rows] added one by one in BLIS's order, its sorted request names
    (`request_<id>` as strings: request_10 before request_2); the last bits of a float sum
    depend on the order (numpy's own sum is pairwise)."""
    idx = np.flatnonzero(rows)
    idx = idx[np.argsort(requests.request_id[idx].astype(str), kind="stable")]
    return float(np.cumsum(values[idx])[-1]) if len(idx) else 0.0


def cache_hit_rate(out: SimOutput, instance: int | None = None) -> float:
    """Prefix-cache hit rate in blocks, hits / (hits + misses); the cluster value is the
    unweighted mean over instances (an instance without lookups counts as 0)."""
    hits = out.kv_hits.astype(np.float64)
    total = hits + out.kv_misses.astype(np.float64)
    if out.cpu_tier_counts is not None:  # BLIS's tiered cache: + lookups the CPU tier missed
        total = total + np.asarray(out.cpu_tier_counts[0], np.float64)
    rates = np.divide(hits, total, out=np.zeros_like(hits), where=total > 0)
    if instance is not None:
        return float(rates[instance])
    return float(rates.sum() / rates.shape[0]) if rates.shape[0] else 0.0


# ----------------------------------------------------------------- text-section figures


@dataclasses.dataclass(frozen=True)
class AnomalyCounters:
    """Figures of the `=== Anomaly Counters ===` section (printed when any is non-zero)."""

    priority_inversions: int = 0
    hol_blocking_events: int = 0
    rejected_admission: int = 0
    shed_by_class: tuple[tuple[str, int], ...] = ()
    rejected_routing: int = 0
    dropped_unservable: int = 0
    timed_out: int = 0
    length_capped: int = 0
    flow_control: bool = False  # the gateway figures below exist
    gateway_queued: int = 0  # still in the gateway queue at the end
    gateway_rejected: int = 0
    gateway_shed: int = 0
    gateway_expired: int = 0
    encode_routing_rejections: int = 0  # E/P/D: the encode decider fired on an empty encode pool

    def any_nonzero(self) -> bool:
        return any((self.priority_inversions, self.hol_blocking_events, self.rejected_admission,
                    self.rejected_routing, self.dropped_unservable, self.timed_out, self.length_capped,
                    self.gateway_queued, self.gateway_rejected, self.gateway_shed, self.gateway_expired,
                    self.encode_routing_rejections))


def anomaly_counters(out: SimOutput, requests: RequestSet, *, scheduler: str = "fcfs",
                     hol_blocking_events: int = 0, rejected_routing: int = 0) -> AnomalyCounters:
    """Anomaly figures from the run. HOL blocking events are the cluster run's
    (`out.hol_blocking_events`) unless given; routing rejections are the requests with status
    ROUTING_REJECTED, plus `rejected_routing` (rejections not in `out`); priority
    inversions are counted only under the `priority-fcfs` scheduler, as in BLIS."""
    _check_aligned(out, requests)
    rejected = out.status == REJECTED
    shed: dict[str, int] = defaultdict(int)
    for cls in requests.slo_class[rejected]:
        shed[str(cls) or "standard"] += 1
    return AnomalyCounters(
        priority_inversions=priority_inversions(out, requests) if scheduler == "priority-fcfs" else 0,
        hol_blocking_events=int(hol_blocking_events or out.hol_blocking_events),
        rejected_admission=int(rejected.sum()),
        shed_by_class=tuple(sorted(shed.items())),
        rejected_routing=int(rejected_routing) + int((out.status == ROUTING_REJECTED).sum()),
        dropped_unservable=int(out.dropped_unservable.sum()),
        timed_out=int(out.timed_out.sum()),
        length_capped=int(out.length_capped.sum()),
        flow_control=out.gateway_delay_us is not None,
        gateway_queued=int((out.status == GATEWAY_QUEUED).sum()),
        gateway_rejected=int((out.status == GATEWAY_REJECTED).sum()),
        gateway_shed=int((out.status == GATEWAY_SHED).sum()),
        gateway_expired=int((out.status == GATEWAY_EXPIRED).sum()),
        encode_routing_rejections=int((out.status == ENCODE_REJECTED).sum()),
    )


def priority_inversions(out: SimOutput, requests: RequestSet) -> int:
    """Per instance and SLO class, ordered pairs of completed requests (i, j) with i arriving
    strictly earlier and E2E_i > 2·E2E_j. O(n log n)-ish with a sorted list per group."""
    _check_aligned(out, requests)
    done = np.flatnonzero(out.completed_mask())
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i in done:
        groups[(int(out.handled_by[i]), str(requests.slo_class[i]))].append(int(i))
    total = 0
    for rows in groups.values():
        idx = np.array(rows)
        arrival, e2e = requests.arrival_us[idx], out.e2e_us[idx]
        order = np.argsort(arrival, kind="stable")
        earlier: list[int] = []   # sorted E2Es of requests that arrived strictly earlier
        k = 0
        while k < order.shape[0]:
            same = k
            while same < order.shape[0] and arrival[order[same]] == arrival[order[k]]:
                same += 1
            for j in order[k:same]:
                total += len(earlier) - bisect.bisect_right(earlier, 2 * int(e2e[j]))
            for j in order[k:same]:
                bisect.insort(earlier, int(e2e[j]))
            k = same
    return total


@dataclasses.dataclass(frozen=True)
class KVCacheMetrics:
    """Figures of the `=== KV Cache Metrics ===` section (printed when any is non-zero)."""

    preemption_rate: float
    cache_hit_rate: float
    thrashing_rate: float = 0.0

    def any_nonzero(self) -> bool:
        return bool(self.preemption_rate or self.cache_hit_rate or self.thrashing_rate)


def _mean_instance_rate(numerator, denominator) -> float:
    """Per instance numerator / denominator (0 where the denominator is 0), then the mean over
    instances, as BLIS averages its per-instance KV rates (blis-features §1.9)."""
    num, den = (np.asarray(c, np.int64).reshape(-1) for c in (numerator, denominator))
    if den.size == 0:
        return 0.0
    return float(np.where(den > 0, num / np.maximum(den, 1), 0.0).mean())


def offload_thrashing_rate(counts: Mapping[str, np.ndarray]) -> float:
    """The multi-tier offload chain's KV Thrashing Rate from its per-instance counters
    (SimOutput.offload_counts): promotions refused (the CPU tier had no free or evictable slot)
    / promotions attempted, averaged over instances."""
    return _mean_instance_rate(counts["promotions_refused"], counts["promotions_attempted"])


def cpu_tier_thrashing_rate(counts) -> float:
    """The legacy CPU tier's KV Thrashing Rate from its per-instance (misses, stores, evictions)
    (SimOutput.cpu_tier_counts): evictions / stores, averaged over instances."""
    return _mean_instance_rate(counts[2], counts[1])


def kv_cache_metrics(out: SimOutput, thrashing_rate: float = 0.0) -> KVCacheMetrics:
    """Preemption rate = preemptions / completed; hit rate averaged over instances;
    thrashing comes from a tiered KV store when one exists: the legacy CPU tier's evictions /
    stores, or the offload chain's refused / attempted promotions."""
    completed = int(out.completed_mask().sum())
    preemptions = int(out.preemption_count.sum())
    if out.offload_counts is not None:
        # the offload chain (engine/offload.py), whose CPU staging tier may fill cpu_tier_counts
        # too: its rate is the promotions', not the legacy tier's evictions / stores
        thrashing_rate = offload_thrashing_rate(out.offload_counts)
    elif out.cpu_tier_counts is not None:
        thrashing_rate = cpu_tier_thrashing_rate(out.cpu_tier_counts)
    return KVCacheMetrics(preemption_rate=preemptions / completed if completed else 0.0,
                          cache_hit_rate=cache_hit_rate(out), thrashing_rate=float(thrashing_rate))


@dataclasses.dataclass(frozen=True)
class ClassLatency:
    """One class of the `=== Per-SLO Metrics ===` section: completed requests' TTFT,
    per-request mean ITL and E2E, mean and p99, in µs."""

    slo_class: str
    count: int
    ttft_mean_us: float
    ttft_p99_us: float
    itl_mean_us: float
    itl_p99_us: float
    e2e_mean_us: float
    e2e_p99_us: float


def per_slo_latencies(out: SimOutput, requests: RequestSet,
                      goodput_targets: Mapping | None = None) -> tuple[ClassLatency, ...]:
    """Per-class latency summary, or () when BLIS prints no Per-SLO section (fewer than two
    classes, unless goodput targets exist). The empty class is reported as `default`."""
    _check_aligned(out, requests)
    done = out.completed_mask()
    classes = np.array([str(c) or _DEFAULT_CLASS for c in requests.slo_class])
    present = sorted(set(classes[done].tolist()))
    if len(present) < 2 and not (present and goodput_targets):
        return ()
    itl_us = per_request_itl_mean_us(out, requests)
    stats = []
    for cls in present:
        rows = done & (classes == cls)
        ttft, itl, e2e = (out.cluster_ttft_us[rows].astype(np.float64), itl_us[rows],
                          out.e2e_us[rows].astype(np.float64))
        stats.append(ClassLatency(cls, int(rows.sum()), _mean(ttft), _percentile(ttft, 99),
                                  _mean(itl), _percentile(itl, 99), _mean(e2e), _percentile(e2e, 99)))
    return tuple(stats)


@dataclasses.dataclass(frozen=True)
class ModelLatency:
    """One model of the `=== Per-Model Metrics ===` section (blis-infra §5.4): TTFT over the
    requests with a first token, E2E over the completed ones (p50, p99 in µs), and their
    throughput over the run (tokens: the planned output lengths, as BLIS counts them)."""

    model: str
    ttft_p50_us: float
    ttft_p99_us: float
    ttft_count: int
    e2e_p50_us: float
    e2e_p99_us: float
    e2e_count: int
    requests_per_s: float
    tokens_per_s: float


def per_model_latencies(out: SimOutput, requests: RequestSet) -> tuple[ModelLatency, ...]:
    """Per-model summary of the requests tagged with a model, models in byte order; () when
    none has a TTFT or E2E entry (BLIS prints no section)."""
    _check_aligned(out, requests)
    models = np.asarray(requests.model, dtype=object)
    has_ttft = (out.ttft_us >= 0) & (models != "")
    done = out.completed_mask() & (models != "")
    duration_s = float(int(out.sim_end_us.max())) / 1e6 if out.num_instances else 0.0
    stats = []
    for model in sorted(set(models[has_ttft | done].tolist()), key=lambda m: m.encode()):
        ttft = out.cluster_ttft_us[has_ttft & (models == model)].astype(np.float64)
        rows = done & (models == model)
        e2e = out.e2e_us[rows].astype(np.float64)
        count, tokens = int(rows.sum()), int(requests.output_len[rows].sum())
        rate = duration_s > 0 and count > 0
        stats.append(ModelLatency(
            model=model, ttft_p50_us=_percentile(ttft, 50), ttft_p99_us=_percentile(ttft, 99), ttft_count=len(ttft),
            e2e_p50_us=_percentile(e2e, 50), e2e_p99_us=_percentile(e2e, 99), e2e_count=count,
            requests_per_s=count / duration_s if rate else 0.0, tokens_per_s=tokens / duration_s if rate else 0.0))
    return tuple(stats)


@dataclasses.dataclass(frozen=True)
class TenantUsage:
    """The `=== Per-Tenant Metrics ===` section: completed requests and output tokens per
    tenant, and Jain's fairness index (Σx)²/(n·Σx²) over per-tenant tokens."""

    tenants: tuple[tuple[str, int, int], ...]  # (tenant, completed requests, output tokens)
    jain_index: float


def per_tenant_usage(out: SimOutput, requests: RequestSet) -> TenantUsage | None:
    """None when no completed request carries a tenant label (no section)."""
    _check_aligned(out, requests)
    rows = out.completed_mask() & (requests.tenant_id != "")
    if not rows.any():
        return None
    tenants = []
    for tenant in sorted(set(requests.tenant_id[rows].tolist())):
        mine = rows & (requests.tenant_id == tenant)
        tenants.append((tenant, int(mine.sum()), int(out.output_tokens[mine].sum())))
    tokens = np.array([t[2] for t in tenants], dtype=np.float64)
    squares = float((tokens * tokens).sum())
    jain = float(tokens.sum()) ** 2 / (len(tokens) * squares) if squares > 0 else 1.0
    return TenantUsage(tuple(tenants), jain)


@dataclasses.dataclass(frozen=True)
class SessionSummary:
    """The `=== Session Metrics ===` section: session count, TTFT of round 0 ("cold") and of
    later rounds ("warm"), and session duration (last completion − round-0 arrival), all in µs
    as (mean, p50, p95, p99, n)."""

    sessions: int
    ttft_cold: tuple[float, float, float, float, int]
    ttft_warm: tuple[float, float, float, float, int]
    duration: tuple[float, float, float, float, int]


def session_summary(out: SimOutput, requests: RequestSet) -> SessionSummary | None:
    """None when no request carries a session id (no section)."""
    _check_aligned(out, requests)
    in_session = requests.session_id != ""
    if not in_session.any():
        return None
    has_ttft = in_session & (out.ttft_us >= 0)
    done = in_session & out.completed_mask()
    round0 = requests.round_index == 0
    sessions, index = np.unique(requests.session_id[in_session], return_inverse=True)
    start = np.full(len(sessions), np.iinfo(np.int64).max)
    np.minimum.at(start, index[round0[in_session]], requests.arrival_us[in_session & round0])
    end = np.full(len(sessions), -1, np.int64)
    np.maximum.at(end, index[done[in_session]], (requests.arrival_us + out.e2e_us)[done])
    ok = (end >= 0) & (start < np.iinfo(np.int64).max)

    def stats(values: np.ndarray):
        v = values.astype(np.float64)
        return (_mean(v), _percentile(v, 50), _percentile(v, 95), _percentile(v, 99), int(v.shape[0]))

    return SessionSummary(sessions=len(sessions), ttft_cold=stats(out.ttft_us[has_ttft & round0]),
                          ttft_warm=stats(out.ttft_us[has_ttft & ~round0]), duration=stats((end - start)[ok]))


def _mean(values: np.ndarray) -> float:
    return float(values.sum()) / values.shape[0] if values.shape[0] else 0.0


def _percentile(values: np.ndarray, p: float) -> float:
    """Same interpolation as `percentile_ms`, on float values, without the unit change."""
    v = np.sort(values)
    if v.shape[0] == 0:
        return 0.0
    rank = p / 100.0 * float(v.shape[0] - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return float(v[lo]) + float(v[hi] - v[lo]) * (rank - lo)


def _check_aligned(out: SimOutput, requests: RequestSet) -> None:
    if out.num_requests != len(requests):
        raise ConfigError(f"SimOutput has {out.num_requests} requests but the RequestSet has "
                          f"{len(requests)}; per-request arrays must follow the RequestSet's rows")


__all__ = [
    "CLUSTER",
    "AnomalyCounters",
    "ClassLatency",
    "KVCacheMetrics",
    "SessionSummary",
    "TenantUsage",
    "anomaly_counters",
    "cache_hit_rate",
    "goodput_fields",
    "instance_name",
    "is_completed",
    "cpu_tier_thrashing_rate",
    "kv_cache_metrics",
    "mean_ms",
    "metrics_output",
    "per_request_itl_mean_us",
    "per_slo_latencies",
    "per_tenant_usage",
    "percentile_ms",
    "priority_inversions",
    "request_records",
    "results_entries",
    "session_summary",
]
