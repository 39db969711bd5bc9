"""Drain policies of the autoscaler's scale-down (blis-infra §2.6; BLIS library objects, blis-jax
`ClusterConfig.drain_policy` / `--drain-policy`), on BLIS's observed scenario O-9 (§8): two
instances, max-num-seqs 2, 20 requests 100 µs apart; the autoscaler's tick at 50 ms (the first
with a fresh snapshot) drains `instance_0` while it runs 2 requests and queues 8.

Expected (O-9): WAIT → all 20 complete, 10 on instance_0, which ends Terminated; IMMEDIATE → the
2 running requests still complete on the terminated instance, the 8 queued ones vanish from
every count (12 completed), and with deadlines they are later timed out on instance_0;
REDIRECT (WE-8) → all 20 complete, 18 on instance_1, and `total_input_tokens` counts the 8
redirected prompts twice. Conservation: completed + queued + running + dropped + timed out =
the requests that kept an outcome (all 20, except IMMEDIATE's discarded ones)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from blis_jax.cluster import drain
from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster.gateway import FlowControlConfig
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.engine import output as so
from blis_jax.errors import ConfigError
from blis_jax.metrics import goodput_fields, metrics_output
from blis_jax.workload.requests import make_request_set

from cluster_helpers import after_each_chunk  # noqa: E402

N, PROMPT = 20, 100
EVERYTHING_GOOD = {"default": {"e2e_ms": 1e12}}


def test_validation():
    with pytest.raises(ConfigError, match="cluster.drain_policy 'later'"):
        ClusterConfig(drain_policy="later").validate()
    with pytest.raises(ConfigError, match="only the autoscaler's scale-down drains"):
        ClusterConfig(num_instances=2, drain_policy="wait").validate()
    with pytest.raises(ConfigError, match="redirect with flow control"):
        ClusterConfig(num_instances=2, drain_policy="redirect", model_autoscaler_interval_us=1e6,
                      flow_control=FlowControlConfig()).validate()
    for policy in ("bare", "wait", "immediate", "redirect"):
        ClusterConfig(num_instances=2, drain_policy=policy, model_autoscaler_interval_us=1e6).validate()


def test_discarded_requests_time_out_at_their_deadline():
    fields = dict(status=np.zeros(4, np.int8), handled_by=np.asarray([0, 0, 1, 1], np.int32),
                  timed_out=np.asarray([0, 2]), sim_end_us=np.asarray([100, 900]))
    got = drain.discarded_timeouts(fields, discarded_by=np.asarray([0, 0, -1, 1]),
                                   deadline_us=np.asarray([500, 0, 700, 2000]), horizon_us=1500)
    # request 0: deadline 500 fires (instance 0's clock moves there); request 1: no deadline;
    # request 2 was not discarded; request 3's deadline is past the horizon
    assert got["status"].tolist() == [so.TIMED_OUT, 0, 0, 0]
    assert got["timed_out"].tolist() == [1, 2] and got["sim_end_us"].tolist() == [500, 900]


def _requests(deadline_us=None):
    return make_request_set(request_id=np.arange(N), arrival_us=15_000 + np.arange(N) * 100,
                            input_len=np.full(N, PROMPT), output_len=np.full(N, 200), deadline_us=deadline_us)


@pytest.fixture(scope="module")
def runs():
    """One compiled program serves every policy (the policy is a dynamic parameter)."""
    from blis_jax.scenario import ScenarioConfig, resolve, simulate
    from blis_jax.scenario.config import EngineSettings

    out = {}
    for policy, deadline in (("wait", None), ("immediate", None), ("redirect", None), ("immediate", 5_000_000),
                             ("redirect", 5_000_000)):
        requests = _requests(None if deadline is None else np.full(N, deadline))
        scenario = ScenarioConfig(engine=EngineSettings(max_num_seqs=2), cluster=ClusterConfig(
            num_instances=2, model_autoscaler_interval_us=50_000, snapshot_refresh_interval_us=50_000,
            drain_policy=policy))
        final = []
        with after_each_chunk(lambda cs: final.append(jax_states(cs))):
            result = simulate(dataclasses.replace(resolve(scenario), requests=requests))
        out[policy, deadline] = result.output, requests, final[-1]
    return out


def jax_states(cs):
    return np.asarray(cs.lifecycle.state)[:2].tolist(), np.asarray(cs.drain.in_flight_cut)[:2].tolist()


def _drained_instance_0(out):
    assert [line[2] for line in out.cluster_log if "scale-down" in line[2]] == [
        '[actuator] scale-down: draining instance instance_0 for model "meta-llama/llama-3.1-8b-instruct"']


def _conserved(out, requests, kept):
    m = metrics_output(out, requests)
    buckets = m["completed_requests"] + m["still_queued"] + m["still_running"] + m["dropped_unservable"] \
        + m["timed_out_requests"]
    assert buckets == m["injected_requests"] == kept
    return m


@pytest.mark.slow   # compiles a cluster program (~1 min on 2 cores)
def test_wait(runs):
    out, requests, (states, cut) = runs["wait", None]
    _drained_instance_0(out)
    m = _conserved(out, requests, N)
    assert m["completed_requests"] == N and np.bincount(out.handled_by, minlength=2).tolist() == [10, 10]
    assert states == [lc.TERMINATED, lc.ACTIVE] and cut == [0, 0]


@pytest.mark.slow
def test_immediate(runs):
    out, requests, (states, cut) = runs["immediate", None]
    _drained_instance_0(out)
    m = _conserved(out, requests, N - 8)
    done = so.is_completed(out.status)
    assert m["completed_requests"] == 12
    assert int((done & (out.handled_by == 0)).sum()) == 2   # the running batch completed on the terminated instance
    assert int((out.status == so.NOT_ARRIVED).sum()) == 8   # the discarded queue: no outcome, no counter
    assert m["total_input_tokens"] == N * PROMPT             # counted at their enqueue, not again
    assert states == [lc.TERMINATED, lc.ACTIVE] and cut == [10, 0]   # in-flight −= queue (8) + batch (2)
    # BLIS counted the discarded requests' arrivals: goodput's denominator has all 20
    assert goodput_fields(out, requests, EVERYTHING_GOOD)["slo_attainment"] == 12 / 20
    # with deadlines the discarded requests time out on instance_0 at their deadline
    out, requests, _ = runs["immediate", 5_000_000]
    m = _conserved(out, requests, N)
    discarded = (out.handled_by == 0) & (out.status == so.TIMED_OUT)
    assert int(discarded.sum()) == 8 and int(out.timed_out[0]) == 8 and int(out.sim_end_us[0]) == 5_000_000


@pytest.mark.slow
def test_redirect_we8(runs):
    out, requests, (states, cut) = runs["redirect", None]
    _drained_instance_0(out)
    m = _conserved(out, requests, N)
    assert m["completed_requests"] == N
    assert np.bincount(out.handled_by, minlength=2).tolist() == [2, 18]
    assert m["total_input_tokens"] == (N + 8) * PROMPT   # the destination counts them again
    assert states == [lc.TERMINATED, lc.ACTIVE] and cut == [8, 0]
    # a redirected request arrives twice: the per-class injected count (goodput's denominator) has 28
    assert goodput_fields(out, requests, EVERYTHING_GOOD)["slo_attainment"] == 20 / 28
    # the original arrival is kept: the redirected requests' TTFT includes their time on the source
    redirected = (out.handled_by == 1) & (np.arange(N) % 2 == 0)
    assert int(redirected.sum()) == 8
    assert np.all(out.sched_delay_us[redirected] > 50_000 - 15_000 - 2_000)
    # unchanged on the requests that stayed: their figures are the WAIT run's
    wait, _, _ = runs["wait", None]
    stayed = ~redirected
    assert out.ttft_us[stayed & (out.handled_by == 0)].tolist() == wait.ttft_us[stayed & (wait.handled_by == 0)].tolist()
    # with deadlines: every request keeps exactly one outcome
    out, requests, _ = runs["redirect", 5_000_000]
    _conserved(out, requests, N)
