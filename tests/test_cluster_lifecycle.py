"""Node pools and the instance lifecycle in the cluster loop, configured in Python (no YAML):
invariants at every chunk boundary (INV-A: GPUs in use = GPUs held by non-terminated instances;
states only move forward; every decided request routed, rejected at admission or rejected at
routing, exactly one; nothing routed to an instance before it is Active) and the routing
BLIS's rules give (requests before the first instance is Active are rejected at routing;
round-robin over the routable instances only; the pending instance gets nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.engine import output as so
from blis_jax.metrics import anomaly_counters, metrics_output
from blis_jax.scenario import ScenarioConfig, resolve, simulate
from blis_jax.scenario.config import SyntheticWorkload
from blis_jax.workload.distribution import GaussianLength

from cluster_helpers import after_each_chunk  # noqa: E402

pytestmark = pytest.mark.slow   # one cluster compile (~20 s on 2 cores)


def scenario() -> ScenarioConfig:
    return ScenarioConfig(
        workload=SyntheticWorkload(rate=40.0, num_requests=120, prompt=GaussianLength(200, 50, 16, 400),
                                   output=GaussianLength(40, 10, 8, 80)),
        cluster=ClusterConfig(num_instances=3, node_pools=(
            NodePool(name="p", gpu_type="H100", gpus_per_node=2, gpu_memory_gib=80.0, initial_nodes=1, max_nodes=1),),
            instance_lifecycle=InstanceLifecycle(loading_delay=Delay(mean=1.5, stddev=0.8))),
        seed=2)


class Checker:
    def __init__(self, resolved):
        self.r = resolved
        self.n = len(resolved.requests)
        self.loaded = np.asarray(resolved.startup.loaded_at_us)
        self.previous = None
        self.boundaries = 0
        self.seen_loading = False  # a boundary with one instance Active and one still Loading

    def __call__(self, cs) -> None:
        n, life = self.n, cs.lifecycle
        state = np.asarray(life.state)
        assert set(state.tolist()) <= {lc.ABSENT, lc.LOADING, lc.ACTIVE}
        assert state[2] == lc.ABSENT, "the pending instance holds a slot state"
        if self.previous is not None:   # forward only
            assert all(a == b or lc.allowed(a, b) for a, b in zip(self.previous, state)), (self.previous, state)
        self.previous = state
        self.seen_loading |= bool(np.any(state == lc.LOADING) and np.any(state == lc.ACTIVE))
        in_use, held = (int(x) for x in lc.gpus_in_use(life))
        assert in_use == held == 2, "INV-A: GPUs in use != GPUs held by live instances"
        handled = np.asarray(cs.handled_by[:n])
        rejected, routing_rejected = np.asarray(cs.rejected[:n]), np.asarray(cs.routing_rejected[:n])
        decided = int(cs.next_request)
        outcomes = (handled >= 0).astype(int) + rejected + routing_rejected
        assert np.array_equal(outcomes, (np.arange(n) < decided).astype(int)), "a request with 0 or 2 outcomes"
        assert np.all(handled < 2), "routed to the pending instance"
        arrival = self.r.requests.arrival_us
        routed = handled >= 0
        assert np.all(arrival[routed] >= self.loaded[handled[routed]]), "routed before the instance was Active"
        assert np.all(arrival[routing_rejected] < self.loaded[:2].min())
        self.boundaries += 1


def test_lifecycle_invariants_and_routing():
    r = resolve(scenario())
    assert r.startup.placed == (True, True, False)
    loaded = np.asarray(r.startup.loaded_at_us[:2])
    assert np.all(loaded > 0)
    check = Checker(r)
    with after_each_chunk(check):
        result = simulate(r, events_per_chunk=120)
    assert check.boundaries >= 3 and check.seen_loading, (check.boundaries, loaded)
    out, requests = result.output, result.requests
    arrival = requests.arrival_us
    # rejected at routing exactly while nothing was routable; round-robin over the routable ones
    want_rejected = arrival < loaded.min()
    assert want_rejected.any() and not want_rejected.all()
    assert np.array_equal(out.status == so.ROUTING_REJECTED, want_rejected)
    counter, want = 0, np.full(len(requests), -1)
    for i in np.flatnonzero(~want_rejected):
        routable = np.flatnonzero(loaded <= arrival[i])
        want[i] = routable[counter % len(routable)]
        counter += 1
    assert np.array_equal(out.handled_by, want)
    assert out.num_instances == 2                                 # the pending instance is absent
    assert anomaly_counters(out, requests).rejected_routing == int(want_rejected.sum())
    m = metrics_output(out, requests)
    assert m["injected_requests"] == len(requests) - int(want_rejected.sum()) == m["completed_requests"]
    assert "rejected at routing" in result.report() or "Rejected Requests (Routing)" in result.report()
