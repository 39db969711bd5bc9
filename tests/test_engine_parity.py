"""The JAX engine against BLIS on every single-instance blis-diff case.

Each case's trace is replayed through `blis_jax.engine.simulate.simulate_instance` with the
settings of its case.json, and compared with BLIS's results.json (per-request TTFT / E2E) and
metrics.json (aggregates via `blis_jax.metrics.metrics_output`, and the per-request records).

Compilation dominates the cost (~15-20 s per program on 2 cores, runs take ~1 s), so the cases
are run under a dims floor (`engine_helpers.dims_floor`): every capacity is raised to the
largest any case of the same scheduler / preemption policy needs, leaving three programs
(trained-physics fcfs, roofline fcfs, priority-fcfs + priority preemption). A separate test
checks that the floor does not change anything (B01 with its own dims, through the unpatched
`simulate_instance`). Whole file: ~1.5 min on the 2-core CI machine.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
from engine_helpers import case_inputs, max_dims, natural_dims, simulate

from blis_jax.engine import output as so
from blis_jax.engine import results as rc
from blis_jax.metrics import metrics_output

SINGLE_INSTANCE_CASES = ["A01", "A02", "A03", "A05", "A07", "A09", "A11", "B01", "B03", "B05", "B06",
                         "C01", "C03", "C05", "C06", "E03"]
MIN_MATCH_RATE = 0.99
METRIC_RTOL = 1e-3


@cache
def floors() -> dict:
    groups: dict = {}
    for cid in SINGLE_INSTANCE_CASES:
        c = case_inputs(cid)
        d = natural_dims(c.requests, c.case)
        groups.setdefault((d.scheduler, d.preemption_policy), []).append(d)
    return {key: max_dims(dims) for key, dims in groups.items()}


@cache
def run(case_id: str) -> so.SimOutput:
    c = case_inputs(case_id)
    return simulate(c.requests, c.case, c.model, floors())


# The default suite runs one case per engine feature (stable load, KV pressure, length drops,
# closed-loop sessions); every case runs with -m slow (CI time; E03, priority scheduling,
# compiles a program of its own).
DEFAULT_CASES = ("A01", "B01", "B06", "C06")


@pytest.fixture(params=[c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow)
                        for c in SINGLE_INSTANCE_CASES])
def case_id(request):
    return request.param


def test_run_is_clean(case_id):
    out = run(case_id)
    assert out.result == so.RESULT_OK, f"{case_id}: result code {out.result} ({rc.describe(out.result)})"
    assert out.num_requests == len(case_inputs(case_id).requests)


def test_ttft_and_e2e_match_results_json(case_id):
    """Per completed request: TTFT and E2E within ±1 µs of BLIS for ≥ 99% of requests; every
    request BLIS completed is completed here with the same token counts."""
    c, out = case_inputs(case_id), run(case_id)
    row = {int(rid): i for i, rid in enumerate(c.requests.request_id)}
    assert set(c.results) <= set(row), f"{case_id}: results.json ids missing from the trace"
    done = out.completed_mask()
    not_completed = [rid for rid in c.results if not done[row[rid]]]
    assert not not_completed, f"{case_id}: BLIS completed but the engine did not: {not_completed[:10]}"
    extra = sorted(int(c.requests.request_id[i]) for i in np.flatnonzero(done)
                   if int(c.requests.request_id[i]) not in c.results)
    assert not extra, f"{case_id}: engine completed requests BLIS did not: {extra[:10]}"

    match, first_bad = 0, None
    for rid, ref in c.results.items():
        i = row[rid]
        ok = abs(int(out.ttft_us[i]) - ref["ttft_us"]) <= 1 and abs(int(out.e2e_us[i]) - ref["e2e_us"]) <= 1
        match += ok
        if not ok and first_bad is None:
            first_bad = {"request_id": rid, "ttft": (int(out.ttft_us[i]), ref["ttft_us"]),
                         "e2e": (int(out.e2e_us[i]), ref["e2e_us"])}
    rate = match / len(c.results) if c.results else 1.0
    print(f"{case_id}: TTFT+E2E within ±1 µs for {match}/{len(c.results)} = {rate:.2%}")
    assert rate >= MIN_MATCH_RATE, (f"{case_id}: TTFT+E2E within ±1 µs for {match}/{len(c.results)} = "
                                    f"{rate:.4%} (< {MIN_MATCH_RATE:.0%}); first mismatch (got, BLIS): {first_bad}")
    wrong_tokens = [rid for rid, ref in c.results.items()
                    if int(out.output_tokens[row[rid]]) != ref["output_tokens"]
                    or int(c.requests.input_len[row[rid]]) != ref["input_tokens"]]
    assert not wrong_tokens, f"{case_id}: input/output token counts differ for {wrong_tokens[:10]}"


def _close(got, want) -> bool:
    if isinstance(want, (bool, str)):
        return got == want
    if isinstance(want, int) and isinstance(got, (int, np.integer)):
        return int(got) == want  # a count (a float field that happens to be whole is a float here)
    if want == 0:
        return abs(got) <= 1e-12
    return math.isclose(float(got), float(want), rel_tol=METRIC_RTOL)


def test_aggregate_metrics_match_metrics_json(case_id):
    """Every field of BLIS's MetricsOutput that blis_jax also reports: counts exactly, floats
    within 0.1% relative."""
    c, out = case_inputs(case_id), run(case_id)
    got = metrics_output(out, c.requests, with_cache_hit_rate=True)
    common = [k for k in c.metrics if k in got]
    # the fields that must be there for the comparison to mean anything
    for key in ("completed_requests", "injected_requests", "still_queued", "still_running", "total_input_tokens",
                "total_output_tokens", "vllm_estimated_duration_s", "e2e_mean_ms", "e2e_p99_ms", "ttft_mean_ms",
                "ttft_p99_ms", "itl_mean_ms", "itl_p99_ms", "scheduling_delay_p99_ms", "preemption_count",
                "cache_hit_rate", "dropped_unservable", "length_capped_requests", "timed_out_requests"):
        assert key in common, f"{case_id}: {key} missing (metrics.json has it: {key in c.metrics})"
    bad = {k: (got[k], c.metrics[k]) for k in common
           if isinstance(c.metrics[k], (int, float, str)) and not _close(got[k], c.metrics[k])}
    assert not bad, f"{case_id}: metrics differ (got, BLIS): {bad}"


def test_request_records_match_metrics_json(case_id):
    """metrics.json["requests"]: scheduling delay and TTFT per request; the timed-out set (in the
    records but not completed) and the dropped set (reached the instance, no record)."""
    c, out = case_inputs(case_id), run(case_id)
    ids = [int(r) for r in c.requests.request_id]
    status = dict(zip(ids, out.status.tolist(), strict=True))
    row = {rid: i for i, rid in enumerate(ids)}

    sched_bad = [(rid, int(out.sched_delay_us[row[rid]]), round(rm["scheduling_delay_ms"] * 1000))
                 for rid, rm in c.request_metrics.items()
                 if max(int(out.sched_delay_us[row[rid]]), 0) != round(rm["scheduling_delay_ms"] * 1000)]
    assert not sched_bad, f"{case_id}: scheduling delay (id, got µs, BLIS µs): {sched_bad[:10]}"
    ttft_bad = [(rid, int(out.ttft_us[row[rid]]), round(rm["ttft_ms"] * 1000))
                for rid, rm in c.request_metrics.items()
                if max(int(out.ttft_us[row[rid]]), 0) != round(rm["ttft_ms"] * 1000)]
    assert len(ttft_bad) <= (1 - MIN_MATCH_RATE) * len(c.request_metrics), f"{case_id}: TTFT {ttft_bad[:10]}"

    unfinished = set(c.request_metrics) - set(c.results)  # timed out, or still queued / running
    got_unfinished = {rid for rid, s in status.items() if s in (so.TIMED_OUT, so.QUEUED, so.RUNNING)}
    assert got_unfinished == unfinished, (f"{case_id}: timed-out/unfinished set differs: only engine "
                                          f"{sorted(got_unfinished - unfinished)[:10]}, only BLIS "
                                          f"{sorted(unfinished - got_unfinished)[:10]}")
    timed_out = {rid for rid, s in status.items() if s == so.TIMED_OUT}
    assert len(timed_out) == c.metrics["timed_out_requests"]
    assert len(unfinished) - len(timed_out) == c.metrics["still_queued"] + c.metrics["still_running"]

    no_record = set(ids) - set(c.request_metrics)  # dropped as unservable, or never injected
    dropped = {rid for rid, s in status.items() if s == so.DROPPED}
    not_arrived = {rid for rid, s in status.items() if s == so.NOT_ARRIVED}
    assert dropped | not_arrived == no_record, (f"{case_id}: dropped set differs: only engine "
                                                f"{sorted((dropped | not_arrived) - no_record)[:10]}, only BLIS "
                                                f"{sorted(no_record - dropped - not_arrived)[:10]}")
    assert len(dropped) == c.metrics["dropped_unservable"]
    horizon = c.case["horizon_us"]
    assert all(c.requests.arrival_us[row[rid]] > horizon for rid in not_arrived)


@pytest.mark.slow  # a property of the test harness itself; `pytest -m slow`
def test_dims_floor_changes_nothing():
    """The shared-capacity runs above equal an unpatched `simulate_instance` run with the dims
    it picks itself (B01: preemption, prefix re-hits, and a free ring 64x smaller, so ring
    compaction happens on the natural path and never under the floor)."""
    c = case_inputs("B01")
    assert natural_dims(c.requests, c.case) != floors()[("fcfs", "fcfs")]
    natural = simulate(c.requests, c.case, c.model)
    floored = run("B01")
    for field in so.SimOutput.__dataclass_fields__:
        a, b = getattr(natural, field), getattr(floored, field)
        np.testing.assert_array_equal(a, b, err_msg=f"SimOutput.{field}")
