"""Sweep lanes that differ only in an unbound max-num-seqs share one run (sweep/shared_runs.py),
and CPU sweeps run several lanes per device one after another (batch.py "map" chunks).

The scenarios are test_sweep.py's small ones (24 requests, 600 KV blocks), so the lanes run on
the program shape the sweep tests already compiled: max-num-seqs 2, 4 and 8 all take 8 batch
slots. Scenarios on the cluster engine share runs by the same rule (`-m slow`: a weighted-routing
cluster program of their own).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_helpers import latency_model

from blis_jax.engine import simulate as sim
from blis_jax.engine.params import make_engine_params
from blis_jax.latency import output_token_time_us, post_decode_time_us
from blis_jax.sweep import batch, shared_runs
from blis_jax.sweep.grid import parse_grid
from blis_jax.sweep.lane import InstanceLane
from blis_jax.sweep.runner import run_sweep
from blis_jax.workload.distribution import (
    DistributionWorkload,
    GaussianLength,
    generate_distribution,
)

BASE = {"num-requests": 24, "total-kv-blocks": 600, "max-num-batched-tokens": 512,
        "prompt-tokens": 150, "prompt-tokens-max": 300, "output-tokens": 30, "output-tokens-max": 60}
# at 2 req/s requests rarely overlap; at 40 req/s the batch fills every limit
GRID = {"base": BASE, "axes": {"rate": [2, 40], "max-num-seqs": [2, 4, 8]}}


def peak_from_outputs(out, requests, model) -> int:
    """Most requests between admission and the end of their last step at once, from the
    per-request outputs alone (no preemption here: each request is admitted once). E2E also
    counts α2 per token and the post-decode overhead after the last step (as in
    test_engine_invariants.check_final)."""
    a2, post = int(output_token_time_us(model)), int(post_decode_time_us(model))
    start = requests.arrival_us + out.sched_delay_us
    end = (requests.arrival_us + out.e2e_us - np.where(requests.output_len > 0, post, 0)
           - (out.num_itl + 1) * a2)
    times = np.concatenate([start, end])
    delta = np.concatenate([np.ones_like(start), -np.ones_like(end)])
    order = np.lexsort((delta, times))  # at equal times, leave before join (the next step starts after)
    return int(np.max(np.cumsum(delta[order])))


@pytest.fixture(scope="module")
def runs():
    simulated = []
    real = shared_runs.run_lanes

    def counting(lanes, reduce, **options):
        simulated.append([int(lane.params.max_num_seqs) for lane in lanes])
        return real(lanes, reduce, **options)

    shared_runs.run_lanes = counting
    try:
        shared = run_sweep(parse_grid(GRID))
    finally:
        shared_runs.run_lanes = real
    separate = run_sweep(parse_grid(GRID), shared_runs=False)
    return shared, separate, simulated


def test_shared_rows_equal_separate_runs(runs):
    shared, separate, _ = runs
    assert [(r["rate"], r["max-num-seqs"]) for r in shared.rows] == [(a, m) for a in (2, 40) for m in (2, 4, 8)]
    assert all(r["result"] == "ok" for r in shared.rows)
    assert shared.rows == separate.rows
    # the limit binds at 40 req/s (every max-num-seqs differs) and not at 2 req/s
    busy = [r["ttft_p99_ms"] for r in shared.rows if r["rate"] == 40]
    idle = [r["ttft_p99_ms"] for r in shared.rows if r["rate"] == 2]
    assert len(set(busy)) == 3 and len(set(idle)) == 1


def test_unbound_runs_are_simulated_once(runs):
    _, _, simulated = runs
    # stage 1: both rates at max-num-seqs 2; the idle family is answered there, the busy one
    # goes on to 4, then 8 (each stage with max-num-seqs slots)
    assert simulated == [[2, 2], [4], [8]]


@pytest.mark.slow  # ~11 s of compilation: the default suite's time budget
def test_peak_batch_size_is_the_most_requests_running_at_once():
    workload = DistributionWorkload(rate=40.0, num_requests=24, prompt=GaussianLength(150, 50, 20, 300),
                                    output=GaussianLength(30, 10, 10, 60))
    requests = generate_distribution(workload, seed=0)

    model = latency_model()
    for limit in (2, 3, 8):
        params = make_engine_params(max_num_seqs=limit, total_kv_blocks=600, max_num_batched_tokens=512)
        out = sim.simulate_instance(requests, params, model)
        assert int(out.preemption_count[0]) == 0
        peak = int(out.peak_batch_size[0])
        assert peak == peak_from_outputs(out, requests, model) and 1 <= peak <= limit
        if limit < 8:  # 40 req/s fills small batches
            assert peak == limit


def test_family_key_separates_every_other_input():
    requests = generate_distribution(DistributionWorkload(rate=5.0, num_requests=10), seed=1)

    def lane(**changes):
        settings = {"max_num_seqs": 4, "total_kv_blocks": 600, **changes.pop("params", {})}
        return InstanceLane(requests=changes.pop("requests", requests), params=make_engine_params(**settings),
                            model=changes.pop("model", latency_model()), **changes)

    key = shared_runs.family_key(lane())
    assert shared_runs.family_key(lane(params={"max_num_seqs": 64})) == key
    other_requests = generate_distribution(DistributionWorkload(rate=5.0, num_requests=10), seed=2)
    model = latency_model()
    slower = dataclasses.replace(model, alpha=model.alpha * 2)
    for different in (lane(params={"total_kv_blocks": 601}), lane(requests=other_requests), lane(model=slower),
                      lane(block_size=32), lane(scheduler="sjf")):
        assert shared_runs.family_key(different) != key


@pytest.mark.slow  # 28 s: the default suite's time budget
def test_mapped_chunks_equal_one_lane_per_device(monkeypatch):
    """Several lanes per device in one program (lax.map), the last chunk padded with idle
    lanes, give each lane's own `simulate_instance` output."""

    monkeypatch.setattr(batch, "CPU_LANES_PER_DEVICE", 2)
    lanes = []
    for k, rate in enumerate((3.0, 40.0, 10.0, 25.0, 6.0)):
        workload = DistributionWorkload(rate=rate, num_requests=24, prompt=GaussianLength(150, 50, 20, 300),
                                        output=GaussianLength(30, 10, 10, 60))
        params = make_engine_params(max_num_seqs=4, total_kv_blocks=600, max_num_batched_tokens=512)
        lanes.append(InstanceLane(requests=generate_distribution(workload, seed=k), params=params,
                                  model=latency_model()))
    modes = []
    real_launch = batch._launch

    def spy(lanes_, chunk, plan, mesh):
        modes.append((plan.mode, len(chunk)))
        return real_launch(lanes_, chunk, plan, mesh)

    monkeypatch.setattr(batch, "_launch", spy)
    outs = batch.run_lanes(lanes, lambda _, o: o)
    ndev = len(batch.sharding.scenario_mesh().devices.flat)
    assert all(mode == "map" for mode, _ in modes) and modes[0][1] == 2 * ndev
    assert sum(n for _, n in modes) == 5 and modes[-1][1] < 2 * ndev  # a partial last chunk
    for lane, out in zip(lanes, outs):
        want = sim.simulate_instance(lane.requests, lane.params, lane.model)
        for field in ("status", "ttft_us", "e2e_us", "itl_sum_us", "num_itl", "sched_delay_us", "itl_step_us",
                      "itl_runs", "peak_batch_size", "sim_end_us"):
            np.testing.assert_array_equal(getattr(out, field), getattr(want, field), err_msg=field)


@pytest.mark.slow  # its own weighted-routing cluster program: ~15 s of CI time
def test_cluster_engine_scenarios_share_unbound_runs(monkeypatch):
    """Scenarios on the shared-clock cluster engine (weighted routing) share a run the same way:
    rows equal separate runs, and a family whose instances never reach max-num-seqs is run once."""
    from blis_jax.sweep import clusters

    calls = []
    real = clusters.ClusterScenario.simulate

    def counting(self, slots):
        calls.append(int(self.params.max_num_seqs))
        return real(self, slots)

    monkeypatch.setattr(clusters.ClusterScenario, "simulate", counting)
    grid = {"base": {**BASE, "num-requests": 48, "num-instances": 2, "routing-policy": "weighted"},
            "axes": {"rate": [2, 80], "max-num-seqs": [2, 4, 8]}}
    shared = run_sweep(parse_grid(grid))
    shared_calls, calls[:] = list(calls), []
    separate = run_sweep(parse_grid(grid), shared_runs=False)
    assert shared.rows == separate.rows and all(r["result"] == "ok" for r in shared.rows)
    assert len(calls) == 6 and sorted(shared_calls) == [2, 2, 4, 8]
    busy = [r["ttft_p99_ms"] for r in shared.rows if r["rate"] == 80]
    assert len(set(busy)) == 3
