"""The autoscaler in the cluster loop, configured in Python: invariants at every chunk boundary
(INV-A: GPUs in use = GPUs held by non-terminated instances, never more than the pool has;
states only move forward; autoscaler-created instances take the slots after the startup ones,
in order; every decided request has exactly one outcome; a drained instance is routed nothing
more), then the run's own record of what happened (scale-ups and drains both occurred, each
new instance named, loaded and served requests)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster.autoscaler import AutoscalerConfig
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.scenario import Deployment, ScenarioConfig, resolve, simulate
from blis_jax.scenario.resolve import resolve_deployment
from blis_jax.scenario.config import SyntheticWorkload
from blis_jax.workload.distribution import GaussianLength

from cluster_helpers import after_each_chunk  # noqa: E402

pytestmark = pytest.mark.slow   # one cluster compile


GPUS = 4


def scenario() -> ScenarioConfig:
    # a small KV cache under a steady load: the two warm instances saturate, the autoscaler adds
    # instances (up to the pool's 4 GPUs), and drains them once the requests run out
    return ScenarioConfig(
        deployment=Deployment(total_kv_blocks=400),
        workload=SyntheticWorkload(rate=30.0, num_requests=240, prompt=GaussianLength(600, 100, 100, 900),
                                   output=GaussianLength(150, 30, 50, 250)),
        cluster=ClusterConfig(
            num_instances=2, node_pools=(NodePool(name="p", gpu_type="H100", gpus_per_node=GPUS, gpu_memory_gib=80.0,
                                                  initial_nodes=1, max_nodes=1, cost_per_hour=3.0),),
            instance_lifecycle=InstanceLifecycle(loading_delay=Delay(mean=0.5, stddev=0.2),
                                                 warm_start_initial_instances=True),
            autoscaler=AutoscalerConfig(interval_us=250_000, scale_up_stabilization_window_us=500_000,
                                        hpa_scrape_delay=Delay(mean=0.1, stddev=0.05))),
        seed=5)


class Checker:
    def __init__(self, n: int):
        self.n, self.previous, self.routed_when_drained, self.boundaries, self.decided = n, None, {}, 0, 0

    def __call__(self, cs) -> None:
        life, ss = cs.lifecycle, cs.scaling
        state = np.asarray(life.state)
        if self.previous is not None and (len(state) != len(self.previous) or int(cs.next_request) < self.decided):
            self.previous, self.routed_when_drained = None, {}   # the driver reran with larger buffers
        self.decided = int(cs.next_request)
        if self.previous is not None:
            assert all(a == b or lc.allowed(a, b) for a, b in zip(self.previous, state)), (self.previous, state)
        self.previous = state
        in_use, held = (int(x) for x in lc.gpus_in_use(life))
        assert in_use == held <= GPUS, "INV-A"
        live = np.flatnonzero(state != lc.ABSENT)
        assert np.array_equal(live, np.arange(int(ss.next_slot))), "instances are not the first slots, in order"
        seq = np.asarray(ss.slot_seq)[2:int(ss.next_slot)]
        assert np.array_equal(seq, np.arange(1, len(seq) + 1)), "autoscaler-created slots out of order"
        n = self.n
        handled = np.asarray(cs.handled_by[:n])
        outcomes = (handled >= 0).astype(int) + np.asarray(cs.rejected[:n]) + np.asarray(cs.routing_rejected[:n])
        assert np.array_equal(outcomes, (np.arange(n) < int(cs.next_request)).astype(int))
        routed = np.asarray(cs.routed)
        for slot in np.flatnonzero(state >= lc.DRAINING):
            first = self.routed_when_drained.setdefault(int(slot), int(routed[slot]))
            assert routed[slot] == first, f"instance {slot} was routed a request after its drain"
        self.boundaries += 1


def test_autoscaled_cluster_invariants_and_events():
    r = resolve(scenario())
    check = Checker(len(r.requests))
    with after_each_chunk(check):
        result = simulate(r, events_per_chunk=150)
    out = result.output
    log = [message for _, _, message in out.cluster_log]
    placed = [m for m in log if m.startswith("[actuator] scale-up: placed instance autoscale-")]
    drained = [m for m in log if m.startswith("[actuator] scale-down: draining instance")]
    assert check.boundaries >= 5
    assert placed and drained, log
    assert len(placed) <= GPUS - 2 or any("PlaceInstance failed" in m for m in log)
    names = out.instance_names
    assert names[:2] == ("instance_0", "instance_1") and len(names) == 2 + len(placed)
    assert all(f"placed instance {name} " in " ".join(placed) for name in names[2:])
    served = np.bincount(out.handled_by[out.handled_by >= 0], minlength=len(names))
    assert np.all(served[2:] > 0), "a new instance served nothing"
    assert out.status.tolist().count(3) + out.status.tolist().count(4) == len(r.requests)   # all completed
    assert all(f"autoscale-meta-llama/llama-3.1-8b-instruct-{k:06d}" in names for k in range(1, len(placed) + 1))


def test_we9_tick_schedule():
    """WE-9: 60 s ticks with a 200 s horizon tick at 0, 60, 120, 180 s; with no horizon, 100 ms
    ticks stop at the first tick with no arrival pending and nothing in flight, and the run
    ends with every request completed."""
    from blis_jax.workload.requests import make_request_set

    base = ScenarioConfig(cluster=ClusterConfig(num_instances=1, model_autoscaler_interval_us=60e6))
    requests = make_request_set(request_id=np.arange(10), arrival_us=np.arange(10) * 7_000 + 1_000,
                                input_len=np.full(10, 200), output_len=np.full(10, 20))
    ticks = []

    def run(config, horizon_us):
        r = dataclasses.replace(resolve_deployment(config, horizon_us=horizon_us), requests=requests)
        with after_each_chunk(lambda cs: ticks.append(int(cs.scaling.ticks))):
            return simulate(r)

    run(base, 200_000_000)
    assert ticks[-1] == 4
    fast = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, model_autoscaler_interval_us=100_000))
    out = run(fast, None).output
    assert out.completed_mask().all()
    done_at = int((requests.arrival_us + out.e2e_us).max())
    assert ticks[-1] == done_at // 100_000 + 2     # ticks at 0 … the first one after the last completion
