"""Instance warm-up (blis-infra §2.5, a BLIS library feature; blis-jax: library config and CLI
extension flags). WE-7 both parts: the post-hoc TTFT factor (recorded requests' cluster TTFTs
multiplied, the others and the per-instance figures untouched), and a one-instance run with
W = 2, f = 2 (the first two routed requests penalised, the instance WarmingUp until two
completions, then Active; f = 0 changes nothing)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster import warm_up
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.engine import output as so
from blis_jax.errors import ConfigError
from blis_jax.metrics import metrics_output, per_model_latencies, request_records
from blis_jax.workload.requests import make_request_set

from cluster_helpers import after_each_chunk  # noqa: E402


def _output(ttft, handled=None, factor_marks=None, factor=2.0):
    """A hand-built 1-instance output of completed requests with the given TTFTs."""
    n = len(ttft)
    ttft = np.asarray(ttft, np.int64)
    fields = dict(status=np.full(n, so.COMPLETED), ttft_us=ttft, e2e_us=ttft + 1000, itl_sum_us=np.zeros(n),
                  num_itl=np.zeros(n), sched_delay_us=np.zeros(n), output_tokens=np.ones(n),
                  handled_by=np.zeros(n) if handled is None else handled, itl_step_us=np.zeros(0),
                  itl_runs=np.zeros((0, 3)), **{c: [0] for c in so._COUNTERS})
    fields["sim_end_us"] = [10_000_000]
    out = so.SimOutput(**fields)
    if factor_marks is not None:
        out = dataclasses.replace(out, ttft_adjusted_us=warm_up.adjusted_ttft(out.ttft_us, factor_marks, factor))
    return out


def _requests(n, model=None):
    return make_request_set(request_id=np.arange(n), arrival_us=np.arange(n) * 1000, input_len=np.full(n, 10),
                            output_len=np.full(n, 5), model=model)


def test_we7_factor_applied_in_aggregation():
    # W = 2, f = 2.0; request_0 and request_1 recorded; instance TTFTs 100, 200, 150 µs
    out = _output([100, 200, 150], factor_marks=[1, 1, 0])
    assert out.cluster_ttft_us.tolist() == [200.0, 400.0, 150.0]
    assert out.ttft_us.tolist() == [100, 200, 150]   # the instance's own figures stay
    requests = _requests(3)
    cluster = metrics_output(out, requests)
    assert cluster["ttft_mean_ms"] == (200 + 400 + 150) / 3 / 1000
    assert cluster["ttft_p99_ms"] == pytest.approx(0.2 + (0.4 - 0.2) * 0.98)   # rank 1.98 of [150, 200, 400]
    assert metrics_output(out, requests, instance=0)["ttft_mean_ms"] == (100 + 200 + 150) / 3 / 1000
    assert [r["ttft_ms"] for r in request_records(out, requests)] == [0.2, 0.4, 0.15]
    assert out.take(np.asarray([2, 0])).cluster_ttft_us.tolist() == [150.0, 200.0]


def test_factor_rules():
    ttft = np.asarray([101, 50, -1])
    assert warm_up.adjusted_ttft(ttft, [1, 0, 1], 0.0) is None      # f = 0 means 1: nothing changes
    assert warm_up.adjusted_ttft(ttft, [1, 0, 1], 1.0) is None
    assert warm_up.adjusted_ttft(ttft, [0, 0, 1], 2.0) is None      # the recorded request has no TTFT
    adjusted = warm_up.adjusted_ttft(ttft, [1, 0, 1], 1.5)
    assert adjusted.tolist() == [151.5, 50.0, -1.0]
    # BLIS's TTFT sum gains trunc(151.5 - 101) = 50: (101 + 50 + 50) / 2 requests with a TTFT; the
    # percentiles read the float value
    out = _output([101, 50], factor_marks=[1, 0], factor=1.5)
    m = metrics_output(out, _requests(2))
    assert m["ttft_mean_ms"] == (101 + 50 + 50) / 2 / 1000
    assert m["ttft_p99_ms"] == pytest.approx((50 + (151.5 - 50) * 0.99) / 1000)
    # per-model TTFT percentiles use the adjusted values too
    (model,) = per_model_latencies(out, _requests(2, model=["m", "m"]))
    assert model.ttft_p50_us == pytest.approx((50 + 151.5) / 2)


@pytest.mark.parametrize("count, factor, field", [(-1, 0.0, "warm_up_request_count"), (1.5, 0.0, "warm_up_request_count"),
                                                  (True, 0.0, "warm_up_request_count"), (2, 0.5, "warm_up_ttft_factor"),
                                                  (2, float("nan"), "warm_up_ttft_factor"),
                                                  (2, float("inf"), "warm_up_ttft_factor")])
def test_validation(count, factor, field):
    with pytest.raises(ConfigError, match=f"cluster.{field}"):
        ClusterConfig(warm_up_request_count=count, warm_up_ttft_factor=factor).validate()


def test_defaults_are_off():
    c = ClusterConfig().validate()
    assert (c.warm_up_request_count, c.warm_up_ttft_factor, c.drain_policy) == (0, 0.0, "bare")
    ClusterConfig(warm_up_request_count=3, warm_up_ttft_factor=1.0).validate()   # f = 1 allowed (no effect)


def test_promotion_and_recording_rules():
    import jax.numpy as jnp

    wu = warm_up.empty(2, 3, 5)
    for r, target in enumerate([0, 0, 0, 1, -1]):   # the third request to instance 0 is past W
        wu = warm_up.record(wu, jnp.asarray(target), r, jnp.asarray(True))
    assert wu.recorded.tolist() == [2, 1, 0] and wu.marks.tolist() == [1, 1, 0, 1, 0]
    life = lc.make([lc.WARMING_UP, lc.WARMING_UP, lc.ACTIVE])
    # completions, not drops or time-outs, end the warm-up
    # per instance: 2 left (completed, length-capped); 3 left (completed, timed out, dropped); none
    counters = types.SimpleNamespace(finished=jnp.asarray([2, 3, 0]), dropped=jnp.asarray([0, 1, 0]),
                                     timed_out=jnp.asarray([0, 1, 0]))
    done = warm_up.completed(counters)
    assert done.tolist() == [2, 1, 0]
    assert warm_up.promote(life, wu, done, jnp.asarray(True)).state.tolist() == [lc.ACTIVE, lc.WARMING_UP, lc.ACTIVE]
    assert warm_up.promote(life, wu, done, jnp.asarray(False)).state.tolist() == life.state.tolist()
    assert int(warm_up.ready_state(0)) == lc.ACTIVE and int(warm_up.ready_state(2)) == lc.WARMING_UP


def _completed_statuses(cs) -> np.ndarray:
    """Completed or length-capped requests per instance, read from their exit statuses."""
    status = np.asarray(cs.instances.out_status)
    return ((status == so.COMPLETED) | (status == so.LENGTH_CAPPED)).sum(axis=-1)


@pytest.mark.slow   # compiles a cluster program
def test_we7_one_instance_warm_up_run():
    from blis_jax.scenario import ScenarioConfig, resolve, simulate
    from blis_jax.scenario.config import Deployment

    base = ScenarioConfig(deployment=Deployment(latency_model="roofline"),
                          cluster=ClusterConfig(warm_up_request_count=2, warm_up_ttft_factor=2.0))
    requests = _requests(3)
    states, completions = [], []

    def watch(cs):
        states.append(int(np.asarray(cs.lifecycle.state)[0]))
        completions.append(int(np.asarray(warm_up.completed(cs.instances))[0]))
        assert completions[-1] == _completed_statuses(cs)[0]

    runs = {}
    for factor in (2.0, 0.0):
        scenario = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, warm_up_ttft_factor=factor))
        resolved = dataclasses.replace(resolve(scenario), requests=requests)
        assert not resolved.single_instance   # warm-up runs in the cluster loop
        with after_each_chunk(watch):
            runs[factor] = simulate(resolved, events_per_chunk=2).output
    plain = simulate(dataclasses.replace(resolve(dataclasses.replace(base, cluster=ClusterConfig())),
                                         requests=requests)).output
    tau = plain.ttft_us
    assert np.all(tau > 0) and np.all(plain.status == so.COMPLETED)
    # the warm-up changes no scheduling: the instance's TTFTs are the plain run's
    for out in runs.values():
        assert out.ttft_us.tolist() == tau.tolist() and out.e2e_us.tolist() == plain.e2e_us.tolist()
    penalised = runs[2.0]
    assert penalised.cluster_ttft_us.tolist() == [2.0 * tau[0], 2.0 * tau[1], float(tau[2])]
    assert runs[0.0].ttft_adjusted_us is None
    cluster = metrics_output(penalised, requests)
    assert cluster["ttft_mean_ms"] == float(2 * tau[0] + 2 * tau[1] + tau[2]) / 3 / 1000
    assert metrics_output(penalised, requests, instance=0)["ttft_mean_ms"] == float(tau.sum()) / 3 / 1000
    assert cluster["e2e_mean_ms"] == metrics_output(plain, requests)["e2e_mean_ms"]   # E2E is not adjusted
    # WarmingUp from the start, Active only once two requests completed, Active at the end
    assert states[0] == lc.WARMING_UP and states[-1] == lc.ACTIVE
    assert all(s == lc.WARMING_UP or c >= 2 for s, c in zip(states, completions)), list(zip(states, completions))
    assert set(states) == {lc.WARMING_UP, lc.ACTIVE}


@pytest.mark.slow   # compiles a cluster program
def test_warm_up_with_node_pools_loading_and_the_autoscaler():
    """Loading → WarmingUp (not Active) with W > 0, the autoscaler's own instances too; only
    instances past their warm-up (W completions) are Active, hence drained; INV-A holds."""
    from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
    from blis_jax.scenario import ScenarioConfig, simulate
    from blis_jax.scenario.config import SyntheticWorkload
    from blis_jax.workload.distribution import GaussianLength

    w = 3
    scenario = ScenarioConfig(
        workload=SyntheticWorkload(rate=40.0, num_requests=200, prompt=GaussianLength(200, 50, 16, 400),
                                   output=GaussianLength(40, 10, 8, 80)),
        cluster=ClusterConfig(num_instances=2, node_pools=(
            NodePool(name="p", gpu_type="H100", gpus_per_node=4, gpu_memory_gib=80.0, initial_nodes=1, max_nodes=1),),
            instance_lifecycle=InstanceLifecycle(loading_delay=Delay(mean=1.0, stddev=0.3)),
            model_autoscaler_interval_us=1_000_000, warm_up_request_count=w, warm_up_ttft_factor=1.5), seed=2)
    previous, seen = None, set()
    recorded = None

    def check(cs):
        nonlocal previous, recorded
        state = np.asarray(cs.lifecycle.state)
        done = np.asarray(warm_up.completed(cs.instances))
        assert done.tolist() == _completed_statuses(cs).tolist()   # the counters agree with the statuses
        if previous is not None:
            assert all(a == b or lc.allowed(a, b) for a, b in zip(previous, state)), (previous, state)
            assert not np.any((previous == lc.LOADING) & (state == lc.ACTIVE) & (done < w))
        past_warm_up = (state == lc.ACTIVE) | (state == lc.DRAINING) | (state == lc.TERMINATED)
        assert np.all(done[past_warm_up] >= w), (state, done)
        in_use, held = (int(x) for x in lc.gpus_in_use(cs.lifecycle))
        assert in_use == held
        seen.update(state.tolist())
        previous = state
        recorded = np.asarray(cs.warm_up.recorded), np.asarray(cs.warm_up.marks), np.asarray(cs.handled_by)

    with after_each_chunk(check):
        result = simulate(scenario, events_per_chunk=50)
    out, requests = result.output, result.requests
    assert {lc.LOADING, lc.WARMING_UP, lc.ACTIVE} <= seen
    assert any("scale-down" in line[2] for line in out.cluster_log)
    per_instance, marks, handled = recorded
    routed = np.bincount(handled[handled >= 0], minlength=per_instance.shape[0])
    assert per_instance.tolist() == np.minimum(routed, w).tolist()   # the first W routed to each instance
    marked = np.flatnonzero(marks[:len(requests)] > 0)
    for i in range(per_instance.shape[0]):   # ... in routing (arrival) order
        mine = np.flatnonzero(handled[:len(requests)] == i)
        assert marked[handled[marked] == i].tolist() == mine[:w].tolist()
    has = out.ttft_us >= 0
    factor = np.where(marks[:len(requests)] > 0, 1.5, 1.0)
    assert np.array_equal(out.cluster_ttft_us[has], out.ttft_us[has] * factor[has])
