"""Flow control: the gateway queue (blis_jax/cluster/gateway.py, blis-features §3.4).

Unit tests drive the queue functions directly (enqueue, shedding, band ceilings, fairness,
dispatch order, TTL). The loop tests (`-m slow`) check that
flow control with the `never` detector changes nothing but adds a zero queue delay, and, on an
overloaded cluster with the concurrency detector, depth limit, shedding and TTL, re-derive
from the run's own per-request times that: every dispatch happened below the concurrency
limit (requests surely in flight: dispatched, and not yet in their last step); no request of a higher band was waiting at a dispatch; each band is served oldest
first (global-strict fifo) or each tenant's flow is (round-robin); only sheddable requests
are shed; no dispatched request waited longer than the TTL; every request ends in exactly one
place.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from cluster_helpers import mixed_requests, router_state

from blis_jax.cluster import gateway as gw
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.errors import ConfigError
from blis_jax.workload.requests import make_request_set

# ---------------------------------------------------------------------------------- units


def requests(classes, tenants=None, slo_targets=None):
    n = len(classes)
    columns = {"slo_target_us": [str(t) if t else "" for t in slo_targets]} if slo_targets else None
    return make_request_set(request_id=np.arange(n), arrival_us=np.arange(n) * 10, input_len=np.full(n, 100),
                            output_len=np.full(n, 10), slo_class=classes, tenant_id=tenants or [""] * n,
                            trace_columns=columns)


def params(reqs, slots=8, qd=5.0, kv=0.8, **flags):
    p, bands, tenants = gw.make_params(gw.FlowControlConfig(**flags), reqs, qd, kv)
    return gw.padded(p, len(reqs)), bands, tenants


def queue(gp, bands, slots, *rs, now=0):
    gs = gw.empty(slots, gp.band_of.shape[0], bands)
    for r in rs:
        gs = gw.enqueue(gs, gp, r, now, jnp.asarray(True))
    return gs


IDLE = router_state([0, 0], [0, 0], [0, 0], [0.0, 0.0], [True, True])


def test_bands_are_the_priorities_present_highest_first():
    reqs = requests(["sheddable", "critical", "standard", "", "batch"], ["b", "a", "", "b", "a"])
    gp, bands, tenants = params(reqs)
    assert bands == 4 and tenants == 3  # critical 4, standard 3 ('' too), batch -1, sheddable -2
    np.testing.assert_array_equal(np.asarray(gp.band_of), [3, 0, 1, 1, 2])
    np.testing.assert_array_equal(np.asarray(gp.band_priority), [4, 3, -1, -2])
    np.testing.assert_array_equal(np.asarray(gp.tenant_of), [1, 0, 2, 1, 0])  # sorted: a, b, default


def test_depth_limit_rejects_or_sheds_the_least_valuable_newest_sheddable():
    reqs = requests(["sheddable", "batch", "sheddable", "standard", "critical", "sheddable"])
    gp, bands, _ = params(reqs, max_gateway_queue_depth=3)
    gs = queue(gp, bands, 8, 0, 1, 2, 3)  # 3 arrives at a full queue: rejected without shedding
    assert np.asarray(gs.outcome)[:4].tolist() == [gw.QUEUED] * 3 + [gw.REJECTED]
    gp, bands, _ = params(reqs, max_gateway_queue_depth=3, queue_shedding=True)
    gs = queue(gp, bands, 8, 0, 1, 2, 3)  # sheds 2 (sheddable, newer than 0), not 1 (batch)
    assert np.asarray(gs.outcome)[:4].tolist() == [gw.QUEUED, gw.QUEUED, gw.SHED, gw.QUEUED]
    gs = queue(gp, bands, 8, 0, 1, 2, 3, 4, 5)  # 4 sheds 0; 5 (sheddable) does not outrank 1 (batch)
    assert np.asarray(gs.outcome).tolist() == [gw.SHED, gw.QUEUED, gw.SHED, gw.QUEUED, gw.QUEUED, gw.REJECTED]
    assert int(gw.depth(gs)) == 3


def test_per_band_capacity_and_a_full_queue_is_an_overflow_not_a_loss():
    reqs = requests(["standard"] * 3 + ["critical"])
    gp, bands, _ = params(reqs, per_band_capacity=2)
    gs = queue(gp, bands, 8, 0, 1, 2, 3)
    assert np.asarray(gs.outcome).tolist() == [gw.QUEUED, gw.QUEUED, gw.REJECTED, gw.QUEUED]
    gp, bands, _ = params(reqs)
    assert bool(queue(gp, bands, 2, 0, 1, 2).full)


def test_dispatch_takes_the_highest_band_and_saturation_gates_bands():
    reqs = requests(["sheddable", "standard", "critical"])
    gp, bands, tenants = params(reqs)
    gs = queue(gp, bands, 8, 0, 1, 2)
    order = []
    for _ in range(3):
        gs = gw.dispatch(gs, gp, IDLE, 5, jnp.asarray(True), tenants)
        order.append(int(gs.to_route[int(gs.route_tail) - 1]))
    assert order == [2, 1, 0] and int(gw.depth(gs)) == 0
    # usage limit 0.4: ceilings 1.0, 0.7, 0.4 for 3 bands; saturation 0.5 stops at the lowest
    gp, bands, tenants = params(reqs, saturation_detector="concurrency", max_concurrency=4, usage_limit_threshold=0.4)
    np.testing.assert_allclose(np.asarray(gw.band_ceilings(gp, bands)), [1.0, 0.7, 0.4])
    half = router_state([0, 0], [0, 0], [2, 2], [0.0, 0.0], [True, True])  # 4 in flight / (2 x 4)
    assert float(gw.saturation(gp, half)) == 0.5
    gs = queue(gp, bands, 8, 0)  # only the sheddable request waits: its band's ceiling 0.4 <= 0.5
    assert int(gw.choose(gs, gp, gw.saturation(gp, half), tenants)[0]) == -1
    gs = queue(gp, bands, 8, 0, 1)
    slot, band, _ = gw.choose(gs, gp, gw.saturation(gp, half), tenants)
    assert int(gs.queue[int(slot)]) == 1 and int(band) == 1
    full = router_state([0, 0], [0, 0], [4, 4], [0.0, 0.0], [True, True])
    assert int(gw.choose(queue(gp, bands, 8, 2), gp, gw.saturation(gp, full), tenants)[0]) == -1


def test_fairness_and_dispatch_order_inside_a_band():
    reqs = requests(["standard"] * 5, ["b", "b", "a", "a", "b"], slo_targets=[900, 50, 400, 0, 0])
    gp, bands, tenants = params(reqs)

    def dispatched(gp, n):
        gs, out = queue(gp, bands, 8, 0, 1, 2, 3, 4), []
        for _ in range(n):
            gs = gw.dispatch(gs, gp, IDLE, 100, jnp.asarray(True), tenants)
            out.append(int(gs.to_route[int(gs.route_tail) - 1]))
        return out

    assert dispatched(gp, 5) == [0, 1, 2, 3, 4]  # global-strict fifo: oldest first
    gp, *_ = params(reqs, fairness_policy="round-robin")
    assert dispatched(gp, 5) == [2, 0, 3, 1, 4]  # tenants a, b, a, b, b
    # slo-deadline, inside the flow of the oldest head: b (0) -> 1 (t+50), b (0) -> 0 (t+900), then
    # a (2) -> 2 (t+400), a (3) -> 3 (none), b -> 4 (none)
    gp, *_ = params(reqs, dispatch_order="slo-deadline")
    assert dispatched(gp, 5) == [1, 0, 2, 3, 4]
    # 3 and 4 have no target of their own: the class target 100 applies; b: 1 (t+50), 4 (t+100)
    gp, *_ = params(reqs, dispatch_order="slo-deadline", slo_targets="standard=100")
    assert dispatched(gp, 2) == [1, 4]


def test_ttl_expires_the_oldest_first():
    reqs = requests(["standard"] * 3)
    gp, bands, _ = params(reqs, request_ttl_us=1000)
    gs = gw.empty(8, 3, bands)
    for r, t in ((0, 10), (1, 10), (2, 5)):
        gs = gw.enqueue(gs, gp, r, t, jnp.asarray(True))
    slot, at = gw.next_expiry(gs, gp)
    assert int(at) == 1005 and int(gs.queue[int(slot)]) == 2
    gs = gw.expire(gs, slot, jnp.asarray(True))
    slot, at = gw.next_expiry(gs, gp)
    assert int(at) == 1010 and int(gs.queue[int(slot)]) == 0
    assert int(gw.next_expiry(queue(params(reqs)[0], bands, 8, 0), params(reqs)[0])[1]) >= gw.INF_TIME


@pytest.mark.parametrize("flags, message", [
    ({"saturation_detector": "always"}, "--saturation-detector"),
    ({"dispatch_order": "lifo"}, "--dispatch-order"),
    ({"max_gateway_queue_depth": -1}, "--max-gateway-queue-depth"),
    ({"usage_limit_threshold": 1.5}, "--usage-limit-threshold"),
    ({"slo_targets": "critical=fast"}, "--slo-targets"),
    ({"in_flight_eviction": True}, "--in-flight-eviction"),
])
def test_bad_flags_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        gw.FlowControlConfig(**flags).validate()


def test_flow_control_is_the_admission_policy():
    with pytest.raises(ConfigError, match="the gateway queue is the admission policy"):
        ClusterConfig(num_instances=2, admission_policy="token-bucket", flow_control=gw.FlowControlConfig()).validate()
    from blis_jax.cli import build_parser
    from blis_jax.cli.scenario_flags import cluster
    with pytest.raises(ConfigError, match="need --flow-control"):
        cluster(build_parser().parse_args(["run", "--saturation-detector", "utilization"]))
    config = cluster(build_parser().parse_args(["run", "--flow-control", "--request-ttl", "5000"])).validate()
    assert config.flow_control.request_ttl_us == 5000


# ----------------------------------------------------------------------------------- loop


def workload(n: int, rate: float, seed: int):
    return mixed_requests(n, rate, seed, ["standard", "critical", "sheddable", "batch"], tenants=["a", "b", ""])


def simulate(reqs, flow_control=None):
    from engine_helpers import latency_model

    from blis_jax.cluster.simulate import simulate_cluster
    from blis_jax.engine.params import make_engine_params

    return simulate_cluster(reqs, make_engine_params(total_kv_blocks=4000, max_num_seqs=8), latency_model(),
                            ClusterConfig(num_instances=2, flow_control=flow_control))


@pytest.mark.slow
def test_never_detector_changes_nothing_but_adds_a_zero_queue_delay():
    reqs = workload(300, 30.0, 1)
    plain, gated = simulate(reqs), simulate(reqs, gw.FlowControlConfig())
    assert plain.gateway_delay_us is None and (gated.gateway_delay_us == 0).all()
    for name in ("status", "ttft_us", "e2e_us", "itl_sum_us", "handled_by", "sched_delay_us"):
        np.testing.assert_array_equal(getattr(plain, name), getattr(gated, name), err_msg=name)
    np.testing.assert_array_equal(plain.itl_step_us, gated.itl_step_us)


@pytest.mark.slow  # 17 s per fairness policy; the queue functions are unit-tested in the default suite
@pytest.mark.parametrize("fairness", ["global-strict", "round-robin"])
def test_gated_dispatch_follows_the_rules(fairness):
    from engine_helpers import latency_model

    from blis_jax import latency
    from blis_jax.cluster.admission import cluster_priority
    from blis_jax.engine import output as so

    reqs = workload(300, 30.0, 1)
    ttl, limit = 2_000_000, 2 * 4  # 2 instances x --max-concurrency 4
    out = simulate(reqs, gw.FlowControlConfig(saturation_detector="concurrency", max_concurrency=4,
                                              max_gateway_queue_depth=20, queue_shedding=True, request_ttl_us=ttl,
                                              fairness_policy=fairness))
    assert out.result == 0
    outcome = {so.STATUS_NAMES[k]: int(v) for k, v in zip(*np.unique(out.status, return_counts=True))}
    assert outcome["gateway_rejected"] > 10 and outcome["gateway_shed"] > 10 and outcome["gateway_expired"] > 10
    dispatched = out.gateway_delay_us >= 0
    # every request ends in exactly one place: served to the end, or one of the gateway outcomes
    assert set(outcome) == {"completed", "gateway_rejected", "gateway_shed", "gateway_expired"}
    np.testing.assert_array_equal(dispatched, so.is_completed(out.status))
    assert (out.handled_by[dispatched] >= 0).all() and (out.handled_by[~dispatched] == -1).all()
    priority = cluster_priority(reqs.priority)
    assert (priority[out.status == so.GATEWAY_SHED] < 0).all()
    assert out.gateway_delay_us.max() <= ttl
    t = reqs.arrival_us  # enqueued at arrival (no admission latency); routed at dispatch
    at = t + out.gateway_delay_us
    # The instance counts a request as gone when it processes the step that completes it, at
    # that step's start tick: within the last step before its completion (E2E - post-decode).
    longest_step = 50_000
    assert out.itl_step_us.max() < longest_step
    done_at = t + out.e2e_us - int(latency.post_decode_time_us(latency_model()))
    surely_there = done_at - longest_step  # in flight at any time before this
    left_queue = np.where(dispatched, at, np.where(out.status == so.GATEWAY_EXPIRED, t + ttl, -1))
    band = -priority  # lower = more important
    tenant = np.array([str(x) or "default" for x in reqs.tenant_id])
    busiest = 0
    for r in np.flatnonzero(dispatched):
        d = at[r]
        in_flight = dispatched & (at < d) & (surely_there > d)  # a lower bound
        assert in_flight.sum() < limit, r
        busiest = max(busiest, int(in_flight.sum()))
        # nobody more important waited (shed requests are sheddable: never more important)
        waiting = (t < d) & (left_queue > d)
        assert not np.any(waiting & (band < band[r])), r
        # oldest first: in the band (global-strict) or in the tenant's flow (round-robin)
        same = dispatched & (band == band[r]) & (t < t[r])
        if fairness == "round-robin":
            same &= tenant == tenant[r]
        assert (at[same] <= d).all(), r
    assert busiest >= limit - 2  # the limit was reached (the bound is not loose)
