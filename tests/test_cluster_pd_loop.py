"""Prefill/decode disaggregation in the cluster loop (blis-features §3.10) against BLIS's E05 and
E07 reference cases, and conservation when the horizon cuts transfers in flight.

E05 (2 prefill + 2 decode instances, round-robin, decider always) is deterministic, so it must
match BLIS request by request: parent TTFT / E2E / ITL, the prefill's scheduling delay, the
decode instance that served each request, every cluster aggregate and every per-instance
block. E07 routes each pool with its own scorers, whose ties BLIS breaks with its
`decode-router` / `prefill-router` Go streams (blis-rng §10.2), carried in the loop state: it
matches request by request too (slow: a second compiled program).

The horizon tests reuse E05's compiled program (horizon, bandwidth and seed are dynamic), and
so do the per-pool deployment tests (`--prefill-tp`, `--decode-hardware`, ...: each slot's
latency model, KV blocks and max-model-len are numbers of that program): a prefill pool at TP 2
must give exactly what the mirrored setting gives (TP 2 cluster-wide, decode pool back at TP 1),
with transfers sized by the prefill pool's TP; a decode pool on other hardware, with the decider
`never`, must serve requests exactly as a plain cluster of that hardware does.
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
from engine_helpers import case_dir, latency_model, params_from
from shared_data import needs_blis_diff

from blis_jax import latency
from blis_jax.cluster import pd
from blis_jax.cluster.deployments import PoolDeployment
from blis_jax.cluster.simulate import (
    ClusterConfig,
    simulate_cluster,
    simulate_cluster_views,
)
from blis_jax.config import load_gpu, load_model
from blis_jax.config.kv_capacity import kv_bytes_per_token
from blis_jax.engine import output as so
from blis_jax.metrics import metrics_output
from blis_jax.output import pd_summary
from blis_jax.workload.tracev2 import read_trace

# One compiled PD program (~25 s on 2 cores) for the whole module: `pytest -m slow`.
pytestmark = [needs_blis_diff, pytest.mark.slow]


@cache
def case(case_id: str):
    d = case_dir(case_id)
    c = json.loads((d / "case.json").read_text())
    _, requests = read_trace(d / "trace.yaml", d / "trace.csv")
    model = latency_model(c["model"], c["hardware"], int(c["tp"]), c["latency_model"])
    metrics = json.loads((d / "metrics.json").read_text())
    records = {int(r["requestID"].rsplit("_", 1)[1]): r for r in metrics.pop("requests")}
    results = {int(r["request_id"]): r for r in json.loads((d / "results.json").read_text())}
    blocks = [json.loads("{" + b.split("{", 1)[1].split("\n}", 1)[0] + "\n}")
              for b in (d / "stdout.txt").read_text().split("=== Simulation Metrics ===")[1:]]
    return c, requests, model, metrics, records, results, blocks


def config(c: dict, **overrides) -> ClusterConfig:
    of = c["other_flags"]
    settings = dict(num_instances=c["num_instances"], routing_policy=c["routing_policy"],
                    routing_scorers=c["routing_scorers"], seed=c["seed"],
                    prefill_instances=of["prefill_instances"], decode_instances=of["decode_instances"],
                    pd_decider=of["pd_decider"], prefill_routing_scorers=of.get("prefill_routing_scorers"),
                    decode_routing_scorers=of.get("decode_routing_scorers"))
    settings.update(overrides)
    return ClusterConfig(**settings)


def run(case_id: str, horizon_us: int | None = None, **overrides):
    c, requests, model, *_ = case(case_id)
    settings = dict(c, horizon_us=horizon_us or c["horizon_us"])
    kvb = kv_bytes_per_token(load_model(c["model"]), int(c["tp"]))
    return simulate_cluster_views(requests, params_from(settings), model, config(c, **overrides),
                                  kv_bytes_per_token=kvb)


@cache
def e05():
    return run("E05")


def test_e05_matches_blis_request_by_request():
    c, requests, _, _, records, results, _ = case("E05")
    out, views = e05()
    assert out.result == 0
    for i, rid in enumerate(requests.request_id.tolist()):
        want, rec = results[rid], records[rid]
        assert out.status[i] == so.COMPLETED
        assert out.ttft_us[i] == want["ttft_us"], rid
        assert out.e2e_us[i] == want["e2e_us"], rid
        assert out.itl_sum_us[i] / max(out.output_tokens[i] - 1, 1) == pytest.approx(want["itl_mean_us"], rel=1e-12)
        assert out.sched_delay_us[i] == round(rec["scheduling_delay_ms"] * 1000)  # the prefill's
        assert f"instance_{out.handled_by[i]}" == rec["handled_by"]
    assert views.disaggregated.all() and views.dropped_at_decode == 0


def test_e05_aggregates_and_instance_blocks_match():
    _, requests, _, metrics, _, _, blocks = case("E05")
    out, views = e05()
    got = metrics_output(out, requests, with_cache_hit_rate=True)
    for key, value in metrics.items():
        assert got[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-12, abs=1e-12)), key
    for k, block in enumerate(blocks[:-1]):  # instance_0..3, then the cluster
        mine = metrics_output(views.outputs[k], requests, k)
        for key, value in block.items():
            assert mine[key] == (pytest.approx(value, rel=1e-12, abs=1e-12) if key != "instance_id" else value), \
                (k, key)


def test_e05_pd_section_figures():
    out, views = e05()
    s = pd_summary(out, views)
    assert (s.disaggregated, s.dropped_at_decode) == (600, 0)
    assert s.prefill_throughput == pytest.approx(13.9032, abs=5e-5)
    assert s.parent_ttft_us.mean() == pytest.approx(41638.6, abs=0.05)
    assert s.transfer_us.mean() == pytest.approx(2846.6, abs=0.05)


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_conservation_when_the_horizon_cuts_transfers(fraction):
    """Slow transfers (0.05 GB/s: tens of ms each) so that some are in flight at the horizon:
    every request that arrived is counted exactly once (never both as a finished prefill and
    as a parent), in-flight transfers count as still running."""
    c, requests, model, *_ = case("E05")
    horizon = int(requests.arrival_us.max() * fraction)
    out, views = run("E05", horizon_us=horizon, pd_transfer_bandwidth=0.05)
    m = metrics_output(out, requests)
    # As in BLIS, a request counts once it reached a queue: α0 after its arrival.
    queued_by = requests.arrival_us + int(latency.queueing_time_us(model, 1)) <= horizon
    arrived = int(queued_by.sum())
    assert m["injected_requests"] == arrived
    assert (m["completed_requests"] + m["still_queued"] + m["still_running"] + m["dropped_unservable"]
            + m["timed_out_requests"]) == arrived
    assert np.isin(out.status[queued_by], [so.COMPLETED, so.QUEUED, so.RUNNING]).all()
    assert (out.status[~queued_by] == so.NOT_ARRIVED).all()
    in_transfer = int(m["still_running"]) - sum(int(o.still_running[k]) for k, o in enumerate(views.outputs))
    assert in_transfer > 0, "the scenario should leave transfers in flight"
    assert views.prefill_completed >= m["completed_requests"]


def test_first_token_lag_of_disaggregated_requests():
    """blis-jax's α₃: a disaggregated request's first token is the decode pod's first step, so
    its TTFT and E2E gain trunc(α₃ × that step), as a co-located request's do; the schedule does
    not change. With α₃ = 1 the shift is the step itself, so α₃ = 0.8 must shift by trunc(0.8 ×
    that)."""
    c, requests, model, *_ = case("E05")
    kvb = kv_bytes_per_token(load_model(c["model"]), int(c["tp"]))
    outs = {}
    for lag in (0.0, 1.0, 0.8):
        alpha = np.asarray(model.alpha).copy()
        alpha[3] = lag
        outs[lag], _ = simulate_cluster_views(requests, params_from(c), latency.with_coefficients(model, alpha=alpha),
                                              config(c), kv_bytes_per_token=kvb)
    base = outs[0.0]
    assert so.is_completed(base.status).all()
    step = outs[1.0].ttft_us - base.ttft_us
    assert (step > 0).all()
    np.testing.assert_array_equal(outs[1.0].e2e_us - base.e2e_us, step)
    np.testing.assert_array_equal(outs[0.8].ttft_us - base.ttft_us, np.trunc(0.8 * step).astype(np.int64))
    np.testing.assert_array_equal(outs[0.8].e2e_us - base.e2e_us, np.trunc(0.8 * step).astype(np.int64))
    np.testing.assert_array_equal(outs[0.8].itl_sum_us, base.itl_sum_us)
    np.testing.assert_array_equal(outs[0.8].handled_by, base.handled_by)


def test_decider_never_serves_everything_on_the_decode_pool():
    c, requests, *_ = case("E05")
    out, views = run("E05", pd_decider="never")
    assert not views.disaggregated.any() and views.prefill_completed == 0
    assert set(np.unique(out.handled_by)) <= {2, 3}
    assert so.is_completed(out.status).all()


@pytest.mark.slow
def test_e07_matches_blis_request_by_request():
    _, requests, _, metrics, records, results, _ = case("E07")
    out, _ = run("E07")
    for i, rid in enumerate(requests.request_id.tolist()):
        assert (out.ttft_us[i], out.e2e_us[i]) == (results[rid]["ttft_us"], results[rid]["e2e_us"]), rid
        assert f"instance_{out.handled_by[i]}" == records[rid]["handled_by"], rid
    got = metrics_output(out, requests)
    for key in ("completed_requests", "ttft_mean_ms", "e2e_mean_ms", "itl_mean_ms"):
        assert got[key] == pytest.approx(metrics[key], rel=1e-12), key


# ================================================================== pools on their own hardware / TP


def pool_deployment(tp: int, hardware: str = "H100") -> PoolDeployment:
    c, *_ = case("E05")
    return PoolDeployment(latency_model=latency_model(c["model"], hardware, tp, c["latency_model"]),
                          total_kv_blocks=c["total_kv_blocks"], max_model_len=c["max_model_len"],
                          hardware=load_gpu(hardware).name, tp=tp,
                          kv_bytes_per_token=kv_bytes_per_token(load_model(c["model"]), tp))


PER_REQUEST = ("status", "ttft_us", "e2e_us", "itl_sum_us", "num_itl", "sched_delay_us", "output_tokens")


def test_prefill_pool_tp_equals_its_mirror_and_sizes_the_transfers():
    c, requests, model, *_ = case("E05")
    tp1, tp2 = pool_deployment(1), pool_deployment(2)
    params = params_from(c)
    out, views = simulate_cluster_views(requests, params, model, config(c), kv_bytes_per_token=tp1.kv_bytes_per_token,
                                        prefill_pool=tp2)
    mirror, mirror_views = simulate_cluster_views(requests, params, tp2.latency_model, config(c),
                                                  kv_bytes_per_token=tp2.kv_bytes_per_token, decode_pool=tp1)
    assert out.result == mirror.result == 0
    for name in (*PER_REQUEST, "handled_by", "itl_step_us", "itl_runs"):
        np.testing.assert_array_equal(getattr(out, name), getattr(mirror, name), err_msg=name)
    np.testing.assert_array_equal(views.transfer_us, mirror_views.transfer_us)
    # every request is transferred, for the prefill pool's TP-2 bytes per token
    want = pd.transfer_time_us(config(c).pd_config(), requests.input_len, 16, tp2.kv_bytes_per_token)
    np.testing.assert_array_equal(views.transfer_us, np.asarray(want))
    assert views.transfer_us.mean() < e05()[1].transfer_us.mean()  # half the bytes per GPU of TP 1
    # the prefill steps are TP-2 steps: the requests reach their decode instance at other times
    assert so.is_completed(out.status).all()
    assert (out.ttft_us != e05()[0].ttft_us).mean() > 0.5


def test_decode_pool_hardware_serves_as_a_plain_cluster_of_that_hardware():
    c, requests, model, *_ = case("E05")
    a100 = pool_deployment(2, "A100-80")
    out, views = simulate_cluster_views(requests, params_from(c), model, config(c, pd_decider="never"),
                                        kv_bytes_per_token=kv_bytes_per_token(load_model(c["model"]), 1),
                                        decode_pool=a100)
    plain = simulate_cluster(requests, params_from(c), a100.latency_model,
                             ClusterConfig(num_instances=2, seed=c["seed"]))
    assert not views.disaggregated.any()
    for name in PER_REQUEST:
        np.testing.assert_array_equal(getattr(out, name), getattr(plain, name), err_msg=name)
    np.testing.assert_array_equal(out.handled_by, plain.handled_by + 2)
    np.testing.assert_array_equal(np.sort(out.itl_step_us), np.sort(plain.itl_step_us))
    # and A100 steps are not H100 steps: the same requests on the base deployment differ
    h100, _ = run("E05", pd_decider="never")
    assert not np.array_equal(h100.e2e_us, out.e2e_us)
