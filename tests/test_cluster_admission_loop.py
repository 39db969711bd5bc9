"""Load-reading admission in the cluster loop: tier-shed and gaie-legacy (blis-features §3.3).

Both read a RouterState built at the admission time. With live signals
(`--snapshot-refresh-interval 0`) what they read follows from the run's own per-request
times, so each decision can be re-derived from the output:

* tier-shed (threshold 0): the busiest instance's EffectiveLoad is > 0 exactly while some
  admitted request is in flight (routed at its arrival, gone at arrival + E2E - the
  post-decode overhead, which is added after the request leaves). A request of priority < 0
  (batch, sheddable, background) must be rejected then and admitted when every instance is
  idle; every other class is always admitted.
* gaie-legacy on one instance (KV threshold out of reach, queue-depth threshold 3): a
  sheddable request is rejected iff at least 3 requests wait in the queue (enqueued at arrival
  + α0, scheduled at arrival + scheduling delay; no preemption with this KV pool).

Requests whose decision time lies within a margin of one of those edges are not checked (the
order of same-tick events is tested elsewhere); the tests assert enough decisions of both
kinds remain.
"""

from __future__ import annotations

import numpy as np
import pytest
from cluster_helpers import mixed_requests
from engine_helpers import latency_model

from blis_jax import latency
from blis_jax.cluster.admission import cluster_priority
from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster
from blis_jax.engine import output as so
from blis_jax.engine.params import make_engine_params
from blis_jax.metrics import anomaly_counters

MARGIN_US = 1_000


def workload(n: int, rate: float, seed: int):
    return mixed_requests(n, rate, seed, ["standard", "critical", "sheddable", "batch", "background"])


@pytest.mark.slow  # a cluster program of its own (CI time; the policies' unit tests run by default)
def test_tier_shed_sheds_low_priorities_while_any_instance_is_busy():
    requests = workload(200, 2.0, 11)
    model = latency_model()
    out = simulate_cluster(requests, make_engine_params(total_kv_blocks=4000, max_num_seqs=16), model,
                           ClusterConfig(num_instances=2, admission_policy="tier-shed",
                                         snapshot_refresh_interval_us=0))
    assert out.result == 0
    rejected = out.status == so.REJECTED
    admitted = ~rejected
    assert so.is_completed(out.status[admitted]).all()
    t = requests.arrival_us
    gone = t + out.e2e_us - int(latency.post_decode_time_us(model))
    low = cluster_priority(requests.priority) < 0
    assert not rejected[~low].any()
    checked = {True: 0, False: 0}
    for r in np.flatnonzero(low):
        before = admitted[:r]
        busy = np.any(before & (gone[:r] > t[r] + MARGIN_US))
        idle = np.all(~before | (gone[:r] < t[r] - MARGIN_US))
        if busy or idle:
            assert rejected[r] == busy, (r, busy)
            checked[bool(busy)] += 1
    print("tier-shed checked", checked)
    assert checked[True] >= 15 and checked[False] >= 15, checked
    counters = anomaly_counters(out, requests)
    assert counters.rejected_admission == rejected.sum()
    assert {c for c, _ in counters.shed_by_class} <= {"batch", "sheddable", "background"}
    # nothing lost: every request is rejected or completed
    assert (rejected | so.is_completed(out.status)).all()


@pytest.mark.slow
def test_gaie_legacy_sheds_sheddable_requests_when_the_queue_is_saturated():
    requests = workload(200, 14.0, 5)
    model = latency_model()
    out = simulate_cluster(requests, make_engine_params(total_kv_blocks=20_000, max_num_seqs=4), model,
                           ClusterConfig(num_instances=1, admission_policy="gaie-legacy",
                                         snapshot_refresh_interval_us=0, queue_depth_threshold=3,
                                         kv_cache_util_threshold=1e9))
    assert out.result == 0 and out.preemption_count.sum() == 0
    rejected = out.status == so.REJECTED
    admitted = ~rejected
    t = requests.arrival_us
    enqueued = t + int(latency.queueing_time_us(model, 1))
    scheduled = t + out.sched_delay_us
    low = cluster_priority(requests.priority) < 0
    assert not rejected[~low].any()
    checked = {True: 0, False: 0}
    for r in np.flatnonzero(low):
        before = admitted[:r]
        waiting_surely = before & (enqueued[:r] < t[r] - MARGIN_US) & (scheduled[:r] > t[r] + MARGIN_US)
        waiting_maybe = before & (enqueued[:r] <= t[r] + MARGIN_US) & (scheduled[:r] >= t[r] - MARGIN_US)
        if waiting_surely.sum() == waiting_maybe.sum():  # no edge near t[r]
            saturated = waiting_surely.sum() >= 3
            assert rejected[r] == saturated, (r, int(waiting_surely.sum()))
            checked[bool(saturated)] += 1
    print("gaie checked", checked)
    assert checked[True] >= 10 and checked[False] >= 10, checked
