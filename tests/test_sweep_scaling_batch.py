"""A grid of autoscaler policies as one batched program (sweep/scaling_batch.py): every run
equals its own `simulate_cluster` run (every output field: per-request results, counters, the
scaling log, instance names and the lifecycle timeline); a second grid with other numbers
reuses the compiled program (no retrace); the timeline agrees with the scaling log."""

from __future__ import annotations

import dataclasses
import re

import chex
import numpy as np
import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster.autoscaler import AnalyzerConfig, AutoscalerConfig
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster
from blis_jax.scenario import Deployment, ScenarioConfig, resolve
from blis_jax.scenario.config import SyntheticWorkload
from blis_jax.sweep import scaling_batch
from blis_jax.workload.distribution import GaussianLength

pytestmark = pytest.mark.slow   # two cluster compiles (the batched program, one single run's)


def scenario(up: float, window: float, loading: Delay, nodes: int, scrape: float = 0.1):
    # two warm instances saturate a small KV cache; the autoscaler adds instances on the pool's
    # nodes (4 GPUs each) and drains them once the requests run out
    pool = NodePool(name="p", gpu_type="H100", gpus_per_node=4, gpu_memory_gib=80.0, initial_nodes=nodes,
                    max_nodes=nodes, cost_per_hour=3.0)
    return resolve(ScenarioConfig(
        deployment=Deployment(total_kv_blocks=400),
        workload=SyntheticWorkload(rate=30.0, num_requests=120, prompt=GaussianLength(600, 100, 100, 900),
                                   output=GaussianLength(150, 30, 50, 250)),
        cluster=ClusterConfig(
            num_instances=2, node_pools=(pool,),
            instance_lifecycle=InstanceLifecycle(loading_delay=loading, warm_start_initial_instances=True),
            autoscaler=AutoscalerConfig(interval_us=250_000, scale_up_stabilization_window_us=window,
                                        hpa_scrape_delay=Delay(mean=scrape, stddev=0.05),
                                        analyzer=AnalyzerConfig(scale_up_threshold=up))),
        seed=5))


GRID_A = [scenario(0.8, 500_000, Delay(0.5, 0.2), 1), scenario(0.6, 0, Delay(0.2, 0.2), 2),
          scenario(0.9, 1_000_000, Delay(1.0, 0.0), 1)]
GRID_B = [scenario(0.7, 250_000, Delay(0.3, 0.1), 2, scrape=0.2), scenario(0.85, 0, Delay(0.0, 0.0), 1),
          scenario(0.6, 750_000, Delay(2.0, 0.5), 2, scrape=0.05)]


@pytest.fixture(scope="module")
def batched():
    """Both grids, batched, with the lane program allowed one trace in all."""
    scaling_batch._PROGRAMS.clear()
    chex.clear_trace_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scaling_batch, "_lane_chunk", chex.assert_max_traces(scaling_batch._lane_chunk, n=1))
        a = scaling_batch.simulate_batched(GRID_A, mode="map")
        reports = []
        b = scaling_batch.simulate_batched(GRID_B, mode="map", progress=lambda *report: reports.append(report))
    return a, b, scaling_batch.compiled_programs(), reports


def single(s):
    return simulate_cluster(s.requests, s.params, s.latency_model, s.cluster, block_size=s.block_size,
                            scheduler=s.scheduler, preemption_policy=s.preemption_policy, startup=s.startup,
                            hardware=s.hardware)


def assert_same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert np.array_equal(np.asarray(x), np.asarray(y)), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("grid", ["a", "b"])
def test_batched_runs_equal_single_runs(batched, grid):
    outs, scenarios = (batched[0], GRID_A) if grid == "a" else (batched[1], GRID_B)
    for s, out in zip(scenarios, outs):
        assert out.result == 0
        assert_same(out, single(s))
    # the settings matter: the runs differ (else equality would prove little)
    assert len({(o.cluster_log, o.instance_names) for o in outs}) == len(outs)


def test_other_numbers_reuse_the_compiled_program(batched):
    assert batched[2] == 1   # both grids: one program (the fixture's trace counter allows one trace)


def test_progress_reports_the_batch_after_each_chunk(batched):
    reports, total = batched[3], sum(len(s.requests) for s in GRID_B)
    done, clocks = [d for d, _, _ in reports], [us for _, _, us in reports]
    assert reports and done == sorted(done) and done[-1] == total   # every request of the batch left
    assert {t for _, t, _ in reports} == {total} and clocks == sorted(clocks) and clocks[0] > 0


def test_timeline_agrees_with_the_scaling_log(batched):
    placed = re.compile(r"scale-up: placed instance (\S+) for")
    draining = re.compile(r"scale-down: draining instance (\S+) for")
    for out in batched[0] + batched[1]:
        entered = out.instance_entered
        index = {name: k for k, name in enumerate(out.instance_names)}
        seen = 0
        for when, _, message in out.cluster_log:
            if m := placed.search(message):
                row = entered[index[m.group(1)]]
                assert when == (row[lc.LOADING] if row[lc.LOADING] >= 0 else row[lc.ACTIVE])
                seen += 1
            elif m := draining.search(message):
                assert entered[index[m.group(1)], lc.DRAINING] == when
                seen += 1
        assert seen > 0
        for row in entered:   # states only move forward in time
            times = row[row >= 0]
            assert np.all(np.diff(times) >= 0), row
