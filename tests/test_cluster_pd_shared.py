"""Shared prefill-decode pods and per-pool latency backends (blis-features §3.10), without a
simulation: topology validation, BLIS's "decider has no effect" warning (run) / error (replay),
which deployment each slot runs, the per-slot backend model, and the PD section's print
condition and contention lines. The simulations (cases H01-H04 request by request and byte for
byte) are the slow reference tests: tests/test_cli.py (H01-H03 replays and runs) and
tests/test_run_blis_diff.py (H04, run only)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.cluster.deployments import PoolDeployment, stack_deployments
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.config import load_gpu, load_model
from blis_jax.engine.params import make_engine_params
from blis_jax.errors import ConfigError
from blis_jax.latency import BatchFeatures, build_latency_model, queueing_time_us, step_time_us
from blis_jax.latency.model import PerSlotKindModel, per_slot_kinds
from blis_jax.output import PDSummary, format_pd_section
from blis_jax.scenario import ScenarioConfig, SyntheticWorkload, TraceWorkload
from blis_jax.scenario.resolve import resolve_deployment


def test_shared_pods_are_in_both_pools():
    c = ClusterConfig(num_instances=5, prefill_instances=1, decode_instances=1, prefill_decode_instances=2).validate()
    prefill, decode = (np.asarray(m).tolist() for m in c.pool_masks())
    assert prefill == [1, 0, 1, 1, 0] and decode == [0, 1, 1, 1, 0]
    assert c.pd and not c.decider_ignored


@pytest.mark.parametrize("settings", [dict(prefill_decode_instances=3),                      # shared only
                                      dict(prefill_instances=2, prefill_decode_instances=2),  # no decode-only
                                      dict(decode_instances=1, prefill_decode_instances=1)])  # no prefill-only
def test_topologies_with_shared_pods_are_accepted(settings):
    assert ClusterConfig(num_instances=4, **settings).validate().pd


def test_pools_need_both_roles_without_shared_pods():
    with pytest.raises(ConfigError, match="--prefill-decode-instances"):
        ClusterConfig(num_instances=4, prefill_instances=2).validate()
    with pytest.raises(ConfigError, match="sum to 5"):
        ClusterConfig(num_instances=4, prefill_instances=2, prefill_decode_instances=3).validate()


def test_decider_without_prefill_only_pool():
    """BLIS: `run` warns that the decider "has no effect" and then disaggregates between the
    shared pods (H04); `replay` refuses the same flags."""
    cluster = ClusterConfig(num_instances=2, prefill_decode_instances=2, pd_decider="always")
    assert cluster.decider_ignored
    assert not dataclasses.replace(cluster, pd_decider="never").decider_ignored
    warnings = []
    run = ScenarioConfig(cluster=cluster, workload=SyntheticWorkload(num_requests=4))
    resolve_deployment(run, horizon_us=None, warn=warnings.append)
    assert len(warnings) == 1 and 'pd_decider="always" has no effect because' in warnings[0]
    replay = dataclasses.replace(run, workload=TraceWorkload(header="t.yaml", data="t.csv"))
    with pytest.raises(ConfigError, match="has no effect because"):
        resolve_deployment(replay, horizon_us=None, warn=warnings.append)


def _pool(model, blocks):
    return PoolDeployment(latency_model=model, total_kv_blocks=blocks, max_model_len=0, hardware="H100", tp=1,
                          kv_bytes_per_token=1.0)


def test_shared_pods_run_the_decode_deployment():
    arch, gpu = load_model("meta-llama/llama-3.1-8b-instruct"), load_gpu("H100")
    base = build_latency_model("trained-physics", arch, gpu, 1)
    params = make_engine_params(total_kv_blocks=100)
    prefill_role = np.array([1, 0, 1, 0], bool)   # slot 0 prefill-only, 1 decode-only, 2 shared, 3 unassigned
    decode_role = np.array([0, 1, 1, 0], bool)
    only_prefill = stack_deployments(base, params, 4, prefill_role, decode_role, prefill=_pool(base, 7))
    assert np.asarray(only_prefill.total_kv_blocks).tolist() == [7, 100, 100, 100]  # shared: not the prefill's
    both = stack_deployments(base, params, 4, prefill_role, decode_role, prefill=_pool(base, 7),
                             decode=_pool(base, 9))
    assert np.asarray(both.total_kv_blocks).tolist() == [7, 9, 9, 100]


def _feats(progress, new, input_len):
    n = len(progress)
    progress, new, input_len = (jnp.asarray(x, jnp.int64) for x in (progress, new, input_len))
    return BatchFeatures(scheduled=jnp.ones(n, bool), is_prefill=progress < input_len, new_tokens=new,
                         progress=progress, input_len=input_len)


def test_per_slot_backend_model_equals_each_backend():
    """A cluster mixing backends stacks one structure; each slot computes exactly what its own
    backend computes (step time, enqueue delay with the cluster's alpha, post-decode time)."""
    arch, gpu = load_model("qwen/qwen3-14b"), load_gpu("H100")
    alpha = (15563.2, 777.35, 45.9)
    physics = build_latency_model("trained-physics", arch, gpu, 1)
    roof = build_latency_model("roofline", arch, gpu, 2, alpha=alpha)
    same = per_slot_kinds([physics, physics])
    assert same[0] is physics   # one backend: unchanged
    mixed = per_slot_kinds([physics, roof])
    assert all(isinstance(m, PerSlotKindModel) for m in mixed)
    assert len({jax.tree.structure(m) for m in mixed}) == 1
    feats = _feats([0, 700, 1200], [512, 1, 1], [512, 600, 1100])
    decode = _feats([600, 900], [1, 1], [500, 800])

    @jax.jit   # one program per structure (eager evaluation compiles dozens of small ones)
    def figures(model):
        return (step_time_us(model, feats), queueing_time_us(model, 1186), model.post_decode_time(),
                model.decode_run_step_times(decode, jnp.arange(3, dtype=jnp.int64)))

    for own, slot in ((physics, mixed[0]), (roof, mixed[1])):
        for got, want in zip(figures(slot), figures(own)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(figures(mixed[1])[1]) == int(15563.2 + 777.35 * 1186)


def _summary(disaggregated, in_flight=None):
    return PDSummary(disaggregated=disaggregated, dropped_at_decode=0, prefill_throughput=2.0,
                     decode_throughput=1.0, load_imbalance=2.0, parent_ttft_us=np.array([10, 20]),
                     transfer_us=np.array([5, 7]), transfers_in_flight=in_flight)


def test_pd_section_print_condition_and_contention_lines():
    assert format_pd_section(_summary(0)) == ""   # H01: no request disaggregated, no section
    plain = format_pd_section(_summary(2))
    assert plain.startswith("=== PD Metrics ===\nDisaggregated Requests: 2\n")
    assert plain.endswith("KV Transfer Duration (us): mean=6.0 p50=6.0 p95=6.9 p99=7.0\n")
    queued = format_pd_section(_summary(2, np.array([1, 2, 1, 3])))
    assert queued == plain + "Peak Concurrent Transfers: 3\nMean Transfer Queue Depth: 1.7500\n"
