"""Multi-model routing (blis-infra §5): every instance serves --model lower-cased; a request
tagged with another model is rejected at routing (never reaching an instance) and the
Per-Model Metrics section summarises the tagged requests."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax import ClusterConfig, ScenarioConfig, simulate
from blis_jax.cluster import loop
from blis_jax.cluster.simulate import model_ids, unservable_models
from blis_jax.engine.output import COMPLETED, NOT_ARRIVED, ROUTING_REJECTED, TIMED_OUT, SimOutput
from blis_jax.engine.status import STATUS_NAMES
from blis_jax.metrics import anomaly_counters, metrics_output, per_model_latencies, request_records
from blis_jax.output import format_per_model_section, render_stdout
from blis_jax.scenario import Deployment, TraceWorkload
from blis_jax.scenario.resolve import resolve_deployment
from blis_jax.workload.requests import make_request_set

from shared_data import BLIS_DIFF, needs_blis_diff  # noqa: E402

SERVED = "meta-llama/llama-3.1-8b-instruct"


def _requests(models, output_len=None):
    n = len(models)
    return make_request_set(request_id=np.arange(n), arrival_us=np.arange(n) * 1000, input_len=np.full(n, 100),
                            output_len=output_len if output_len is not None else np.full(n, 10), model=models)


def _output(status, ttft, e2e, sim_end_us=2_000_000):
    n = len(status)
    zeros = np.zeros(1, np.int64)
    counters = {k: zeros for k in ("preemption_count", "kv_hits", "kv_misses", "dropped_unservable", "timed_out",
                                   "length_capped", "total_input_tokens", "still_queued", "still_running",
                                   "kv_allocation_failures", "peak_batch_size")}
    return SimOutput(status=np.asarray(status, np.int8), ttft_us=np.asarray(ttft, np.int64),
                     e2e_us=np.asarray(e2e, np.int64), itl_sum_us=np.zeros(n, np.int64), num_itl=np.zeros(n, np.int64),
                     sched_delay_us=np.zeros(n, np.int64), output_tokens=np.zeros(n, np.int64),
                     handled_by=np.zeros(n, np.int32), itl_step_us=np.zeros(0, np.int32),
                     itl_runs=np.zeros((0, 3), np.int64), **counters, sim_end_us=zeros + sim_end_us)


def test_per_model_section_partitions_tagged_requests():
    # two tagged models, an untagged request, a not-arrived one and a routing rejection
    requests = _requests(["b/x", "a/y", "", "b/x", "b/x", "a/y", "c/z"], output_len=[10, 20, 30, 40, 50, 60, 70])
    out = _output(status=[COMPLETED, COMPLETED, COMPLETED, COMPLETED, TIMED_OUT, NOT_ARRIVED, ROUTING_REJECTED],
                  ttft=[100, 300, 999, 200, 400, -1, -1], e2e=[1000, 3000, 9999, 2000, -1, -1, -1])
    stats = per_model_latencies(out, requests)
    assert [m.model for m in stats] == ["a/y", "b/x"]          # untagged and never-served models absent
    a, b = stats
    # b/x: TTFT of the timed-out request counts (n=3: 100, 200, 400), E2E only the completed (1000, 2000)
    assert (b.ttft_count, b.e2e_count) == (3, 2)
    assert b.ttft_p50_us == 200 and b.ttft_p99_us == pytest.approx(200 + 0.98 * 200)   # rank 1.98
    assert b.e2e_p50_us == 1500 and b.e2e_p99_us == pytest.approx(1000 + 0.99 * 1000)
    assert b.requests_per_s == 1.0 and b.tokens_per_s == 25.0                          # 2 req, 10+40 tokens, 2 s
    assert (a.ttft_count, a.e2e_count, a.requests_per_s, a.tokens_per_s) == (1, 1, 0.5, 10.0)
    assert format_per_model_section(stats) == (
        "=== Per-Model Metrics ===\n"
        "  a/y:\n"
        "    TTFT: p50=300.00 p99=300.00 (n=1)\n"
        "    E2E:  p50=3000.00 p99=3000.00 (n=1)\n"
        "    Throughput: 0.50 req/s, 10.00 tok/s\n"
        "  b/x:\n"
        "    TTFT: p50=200.00 p99=396.00 (n=3)\n"
        "    E2E:  p50=1500.00 p99=1990.00 (n=2)\n"
        "    Throughput: 1.00 req/s, 25.00 tok/s\n")


def test_we19_per_model_metrics():
    """blis-infra §7 WE-19: five llama and three qwen requests, SimEndedTime 10 s, 0 planned tokens."""
    requests = _requests(["llama"] * 5 + ["qwen"] * 3, output_len=np.zeros(8, np.int64))
    out = _output(status=[COMPLETED] * 8, ttft=[100, 200, 300, 400, 500, 200, 400, 600],
                  e2e=[500, 1000, 1500, 2000, 2500, 800, 1600, 2400], sim_end_us=10_000_000)
    assert format_per_model_section(per_model_latencies(out, requests)) == (
        "=== Per-Model Metrics ===\n"
        "  llama:\n"
        "    TTFT: p50=300.00 p99=496.00 (n=5)\n"
        "    E2E:  p50=1500.00 p99=2480.00 (n=5)\n"
        "    Throughput: 0.50 req/s, 0.00 tok/s\n"
        "  qwen:\n"
        "    TTFT: p50=400.00 p99=596.00 (n=3)\n"
        "    E2E:  p50=1600.00 p99=2384.00 (n=3)\n"
        "    Throughput: 0.30 req/s, 0.00 tok/s\n")
    assert per_model_latencies(out, _requests([""] * 8)) == ()


def test_routing_rejections_are_counted_apart_from_admission_and_have_no_record():
    requests = _requests(["", "x/y", ""])
    out = _output(status=[COMPLETED, ROUTING_REJECTED, COMPLETED], ttft=[100, -1, 100], e2e=[1000, -1, 1000])
    counters = anomaly_counters(out, requests)
    assert (counters.rejected_routing, counters.rejected_admission) == (1, 0)
    assert metrics_output(out, requests)["injected_requests"] == 2
    assert [r["requestID"] for r in request_records(out, requests)] == ["request_0", "request_2"]
    assert STATUS_NAMES[ROUTING_REJECTED] == "routing_rejected"
    assert "Per-Model Metrics" not in render_stdout(out, requests)   # no tagged request reached an instance


def test_eligible_instances_by_model_id():
    cparams = dataclasses.replace(_params(4), instance_model=jnp.array([0, 1, 0, 0], jnp.int32),
                                  request_model=jnp.array([-1, 0, 1, 2], jnp.int32))
    routable = jnp.array([True, True, True, False])
    assert loop.eligible(cparams, routable, 0).tolist() == [True, True, True, False]   # untagged: every routable one
    assert loop.eligible(cparams, routable, 1).tolist() == [True, False, True, False]
    assert loop.eligible(cparams, routable, 2).tolist() == [False, True, False, False]
    assert loop.eligible(cparams, routable, 3).tolist() == [False, False, False, False]   # nobody serves model 2


def _params(slots):
    ids = dict(instance_model=jnp.zeros(slots, jnp.int32), request_model=jnp.zeros(4, jnp.int32))
    return loop.ClusterParams(active=jnp.ones(slots, bool), admission_latency_us=jnp.int64(0),
                              routing_latency_us=jnp.int64(0), prefill_role=jnp.zeros(slots, bool),
                              decode_role=jnp.ones(slots, bool), pd=None, kv_bytes_per_token=jnp.float64(0),
                              total_kv_blocks=jnp.zeros(slots, jnp.int64), max_model_len=jnp.zeros(slots, jnp.int64),
                              gateway=None, **ids)


def test_model_ids_compare_bytes_and_pad():
    requests = _requests(["", SERVED, "meta-llama/Llama-3.1-8B-Instruct", "qwen/qwen3-14b"])
    ids = model_ids(requests, ClusterConfig(num_instances=2, served_model=SERVED), 6)
    assert ids["request_model"].tolist() == [-1, 0, 1, 1, -1, -1]
    assert ids["instance_model"].tolist() == [0, 0]
    assert model_ids(requests, ClusterConfig(num_instances=2), 4)["request_model"].tolist() == [-1] * 4
    assert unservable_models(requests, SERVED) and not unservable_models(_requests(["", SERVED]), SERVED)
    assert not unservable_models(requests, None)


def test_scenario_serves_the_lower_cased_model_and_leaves_the_single_engine_for_wrong_tags():
    config = ScenarioConfig(deployment=Deployment(model="meta-llama/Llama-3.1-8B-Instruct"))
    resolved = resolve_deployment(config, horizon_us=None)
    assert resolved.cluster.served_model == SERVED
    assert dataclasses.replace(resolved, requests=_requests(["", SERVED])).single_instance
    assert not dataclasses.replace(resolved, requests=_requests(["", "meta-llama/Llama-3.1-8B-Instruct"])).single_instance


# ------------------------------------------------------------------------------ whole runs


@needs_blis_diff
@pytest.mark.slow
def test_f05_through_the_library_api_is_byte_identical(tmp_path):
    """F05 configured in Python (the routing-only bundle's weighted profile as fields)."""
    case = BLIS_DIFF / "F05_multi_model_match_mismatch_llama8b"
    config = ScenarioConfig(
        deployment=Deployment(model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100", tp=1),
        cluster=ClusterConfig(num_instances=4, routing_policy="weighted",
                              routing_scorers="queue-depth:2,kv-utilization:1"),
        workload=TraceWorkload(header=case / "trace.yaml", data=case / "trace.csv"), seed=19)
    result = simulate(config)
    assert result.report() == (case / "stdout.txt").read_text()
    result.write_metrics(tmp_path / "metrics.json")
    result.write_results(tmp_path / "results.json")
    for name in ("metrics.json", "results.json"):
        assert (tmp_path / name).read_text() == (case / name).read_text(), name
    rows = np.asarray(result.requests.model, dtype=object)
    rejected = result.output.status == ROUTING_REJECTED
    assert rejected.sum() == 168 and np.all((rows[rejected] != "") & (rows[rejected] != SERVED))


@pytest.mark.slow
def test_wrong_model_requests_leave_the_others_untouched():
    """One instance: requests tagged with another model are rejected at routing and change
    nothing for the rest: the same results as a run where they arrive after the horizon (one
    compiled program for both runs: the same request set shapes)."""
    n, horizon = 40, 10**9
    rng = np.random.default_rng(3)
    models = np.where(np.arange(n) % 3 == 1, "other/model", np.where(np.arange(n) % 3 == 2, SERVED, ""))
    arrival = np.cumsum(rng.integers(2_000, 40_000, n))
    served = models != "other/model"
    config = ScenarioConfig(deployment=Deployment(model="meta-llama/Llama-3.1-8B-Instruct", total_kv_blocks=2000))
    resolved = resolve_deployment(config, horizon_us=horizon)

    inputs, outputs = rng.integers(50, 900, n), rng.integers(5, 120, n)

    def run(rows, arrival, models):
        requests = make_request_set(request_id=rows, arrival_us=arrival[rows], input_len=inputs[rows],
                                    output_len=outputs[rows], model=models[rows])
        return simulate(dataclasses.replace(resolved, requests=requests))

    everyone = run(np.arange(n), arrival, models)
    # the same rows, the wrong-model ones last (requests are in arrival order), past the horizon
    order = np.concatenate([np.flatnonzero(served), np.flatnonzero(~served)])
    late = run(order, np.where(served, arrival, horizon + 1), models)
    out = everyone.output
    assert (out.status == ROUTING_REJECTED).tolist() == (~served).tolist()
    assert (late.output.status == NOT_ARRIVED).tolist() == sorted((~served).tolist())
    assert anomaly_counters(out, everyone.requests).rejected_routing == (~served).sum()
    k = served.sum()
    for field in ("ttft_us", "e2e_us", "itl_sum_us", "status"):
        assert getattr(out, field)[served].tolist() == getattr(late.output, field)[:k].tolist(), field
    assert json.loads(json.dumps(metrics_output(out, everyone.requests)))["injected_requests"] == served.sum()
