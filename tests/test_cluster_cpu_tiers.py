"""KV tiers below the GPU cache on multi-instance clusters (issue #24): the legacy CPU tier
(`--kv-cpu-blocks`, engine/cpu_tier.py) and the multi-tier offload chain (`--kv-offload-config`,
engine/offload.py), each instance with its own store and counters.

Round-robin reads no instance state and, with no admission or routing latency, each request
reaches its instance at its arrival time; an instance then serves exactly what a lone instance
serves given the requests routed to it. So every instance's per-request results and tier
counters must equal those of `simulate_instance` on its share (checked first for a plain
cluster), and the KV Thrashing Rate is the mean of the instances' own rates (blis-features
§1.9). The chain's jitter draws come from one `kv-offload` stream that every instance builds
from the same seed (blis-rng §10.3), as a lone run does."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.cluster import simulate as csim
from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster
from blis_jax.config.kv_offload import OffloadConfig, OffloadTier
from blis_jax.engine import cpu_tier
from blis_jax.engine import simulate as sim
from blis_jax.engine.output import is_completed
from blis_jax.errors import ConfigError
from blis_jax.metrics import kv_cache_metrics
from blis_jax.workload.requests import make_request_set
from cluster_helpers import after_each_chunk  # noqa: E402
from engine_helpers import latency_model, params_from  # noqa: E402
from test_offload_engine import tiny_offload_buffers  # noqa: E402

INSTANCES = 3
TOTAL_KV_BLOCKS = 40
SETTINGS = dict(max_num_seqs=6, max_num_batched_tokens=256, total_kv_blocks=TOTAL_KV_BLOCKS)
BLOCK_BYTES = 50_000
TIER = OffloadTier(n_read_threads=2, n_write_threads=2, read_bandwidth=10.0, write_bandwidth=20.0, base_latency=50.0,
                   latency_jitter_stddev=0.2)
# 64 CPU blocks hold the 8 prefixes (32 blocks) past the GPU: reloads on every instance
CPU = cpu_tier.CpuTier(blocks=64, bandwidth=2.0, base_latency_us=10)
SEED = 7


def _rows(n: int = 90, seed: int = 3):
    """Shared 64-token prefixes of 8 groups, an arrival every ~0.5 ms: each instance of three gets
    every third request (a third of the rate), enough to push prefixes out of its 40 GPU blocks
    and back from CPU (and out of the chain's 12 CPU blocks to its fs tier, as
    tests/test_offload_engine.py's run on one instance)."""
    rng = np.random.default_rng(seed)
    return dict(request_id=np.arange(n), arrival_us=np.arange(n) * 500 + rng.integers(0, 300, n),
                input_len=64 + rng.integers(8, 60, n), output_len=rng.integers(2, 12, n),
                prefix_group=np.array([f"g{g}" for g in rng.integers(0, 8, n)]), prefix_len=np.full(n, 64))


def _requests(rows=None):
    return make_request_set(**(rows or _rows()))


def _share(rows, k: int, instances: int = INSTANCES):
    """The requests round-robin routes to instance k (arrival order = request order here)."""
    return make_request_set(**{name: col[k::instances] for name, col in rows.items()})


def _offload(cpu_blocks: int = 12, tier=TIER):
    return OffloadConfig(cpu_bytes_to_use=cpu_blocks * BLOCK_BYTES + 999, per_block_bytes=BLOCK_BYTES, tiers=(tier,))


def _cluster(requests, tiers: dict, instances: int = INSTANCES, **kwargs):
    config = ClusterConfig(num_instances=instances, routing_policy="round-robin", seed=SEED)
    return simulate_cluster(requests, params_from(SETTINGS), latency_model(), config, block_size=16,
                            **tiers, **kwargs)


def _lone(requests, tiers: dict):
    return sim.simulate_instance(requests, params_from(SETTINGS), latency_model(), block_size=16, seed=SEED, **tiers)


def _tier_counts(out, i: int) -> dict:
    counts = {}
    if out.cpu_tier_counts is not None:
        counts.update(zip(("cpu_misses", "cpu_stores", "cpu_evictions"), (int(c[i]) for c in out.cpu_tier_counts)))
        counts["cpu_reload_failures"] = int(out.cpu_reload_failures[i])
    if out.offload_counts is not None:
        counts.update({k: int(v[i]) for k, v in out.offload_counts.items()})
    return counts


def _assert_instances_are_lone_runs(rows, out, tiers: dict):
    """Every instance's requests and counters as a lone run of its share; returns the lone runs."""
    n = len(rows["request_id"])
    assert np.array_equal(out.handled_by, np.arange(n) % INSTANCES)
    lones = []
    for k in range(INSTANCES):
        lone = _lone(_share(rows, k), tiers)
        mine = np.arange(n)[k::INSTANCES]
        for field in ("status", "ttft_us", "e2e_us", "itl_sum_us", "num_itl", "sched_delay_us", "output_tokens"):
            got, want = getattr(out, field)[mine], getattr(lone, field)
            bad = np.flatnonzero(got != want)
            assert not len(bad), f"instance {k}, {field}: first divergence at request {mine[bad[0]]}: " \
                                 f"cluster {got[bad[0]]}, lone run {want[bad[0]]}"
        for field in ("preemption_count", "kv_hits", "kv_misses", "kv_allocation_failures", "peak_batch_size"):
            assert int(getattr(out, field)[k]) == int(getattr(lone, field)[0]), (k, field)
        assert _tier_counts(out, k) == _tier_counts(lone, 0), k
        lones.append(lone)
    assert np.all(is_completed(out.status))
    return lones


def _conservation_check(seen: list, capacity: int):
    """After every chunk, on every instance: GPU blocks free or referenced, the CPU store within
    its capacity with its slots and key map one to one."""
    def check(cs):
        s = cs.instances
        for i in range(INSTANCES):
            ref = np.asarray(s.block_ref[i][:TOTAL_KV_BLOCKS])
            assert np.all(ref >= 0)
            assert int(s.free_count[i]) + int(np.sum(ref > 0)) == TOTAL_KV_BLOCKS, f"instance {i}: blocks lost"
            slot_key, key_slot = np.asarray(s.cpu_slot_key[i]), np.asarray(s.cpu_key_slot[i])
            occupied = slot_key >= 0
            assert int(occupied.sum()) == int(s.cpu_count[i]) <= capacity and not occupied[capacity:].any()
            mapped = np.nonzero(key_slot >= 0)[0]
            assert np.array_equal(np.sort(slot_key[occupied]), mapped)
            assert np.array_equal(slot_key[key_slot[mapped]], mapped)
        seen.append(int(np.sum(np.asarray(s.cpu_count))))
    return check


def _router_signals_ignore_the_store(seen: list):
    """`advance_chunk` patched: after every chunk, what the router reads of each instance (its
    prefix-cache blocks, its load signals) is unchanged when every CPU entry is dropped and when
    every key is put on CPU (BLIS's offload tiers are invisible to its prefix scorers, blis-features
    §2.10). `seen` gets the prefix blocks on CPU and not on the GPU (the cases that matter)."""
    from unittest import mock

    from blis_jax.cluster import loop

    advance = csim.advance_chunk

    def signals(instances, cd, total):
        return jax.device_get((loop.group_blocks_cached(instances, cd.engine),
                               loop.live_signals(instances, total, cd.engine.block_size)))

    def observed(cd, cs, inputs, limit):
        cs, done = advance(cd, cs, inputs, limit)
        s, total = cs.instances, inputs[1].total_kv_blocks
        want = signals(s, cd, total)
        for key_slot in (jnp.full_like(s.cpu_key_slot, -1), jnp.zeros_like(s.cpu_key_slot)):
            got = signals(dataclasses.replace(s, cpu_key_slot=key_slot), cd, total)
            assert jax.tree.all(jax.tree.map(np.array_equal, got, want)), "a router signal read the CPU store"
        e = cd.engine
        keys = np.arange(e.prefix_groups * e.prefix_blocks).reshape(e.prefix_groups, e.prefix_blocks)
        on_cpu = np.asarray(s.cpu_key_slot)[:, keys] >= 0
        seen.append(int(np.sum(on_cpu & ~want[0])))
        return cs, done

    return mock.patch.object(csim, "advance_chunk", observed)


@pytest.mark.slow  # two compilations (cluster, lone instance), ~40 s on 2 cores
def test_plain_round_robin_cluster_is_its_instances():
    """The identity the tier tests rest on, without a tier."""
    rows = _rows()
    _assert_instances_are_lone_runs(rows, _cluster(_requests(rows), {}), {})


@pytest.mark.slow  # two compilations (cluster, lone instance), ~50 s on 2 cores
@pytest.mark.parametrize("tier", ["cpu_tier", "offload"])
def test_each_instance_is_a_lone_run_with_its_own_store(tier):
    # the chain: slower writes into 10 CPU blocks, so that pinned blocks refuse promotions on
    # every instance (at 12 blocks and 20 bytes/µs, refusals hang on single steps' timing), and
    # 150 requests, so that every instance also completes some (a group promoted before comes
    # back as a warm load: at 90 requests two instances complete none)
    rows = _rows(150 if tier == "offload" else 90)
    tiers = {"cpu_tier": CPU} if tier == "cpu_tier" else \
        {"offload": _offload(cpu_blocks=10, tier=dataclasses.replace(TIER, write_bandwidth=5.0))}
    seen, cpu_only = [], []
    with _router_signals_ignore_the_store(cpu_only), \
            after_each_chunk(_conservation_check(seen, CPU.blocks if tier == "cpu_tier" else 10)):
        out = _cluster(_requests(rows), tiers, events_per_chunk=8)
    assert len(seen) > 3 and max(seen) > 0 and max(cpu_only) > 0
    lones = _assert_instances_are_lone_runs(rows, out, tiers)
    # the tier is exercised on every instance, differently (else "mean over instances" is untested)
    counts = [_tier_counts(out, k) for k in range(INSTANCES)]
    if tier == "cpu_tier":
        assert all(c["cpu_evictions"] > 0 for c in counts)
        rates = [c["cpu_evictions"] / c["cpu_stores"] for c in counts]
    else:
        assert all(c["promotions_done"] > 0 for c in counts)
        assert all(c["promotions_refused"] > 0 for c in counts)
        rates = [c["promotions_refused"] / c["promotions_attempted"] for c in counts]
    # KV Thrashing Rate: the mean of the instances' rates (each a lone run's own metric)
    thrashing = kv_cache_metrics(out).thrashing_rate
    assert thrashing == pytest.approx(np.mean([kv_cache_metrics(lone).thrashing_rate for lone in lones]), abs=1e-12)
    assert thrashing == pytest.approx(np.mean(rates), abs=1e-12)
    # the tier changes every instance's run (else the identity above would say little about it)
    plain = _cluster(_requests(rows), {})
    for k in range(INSTANCES):
        assert not np.array_equal(out.ttft_us[k::INSTANCES], plain.ttft_us[k::INSTANCES]), k


@pytest.mark.slow  # one cluster compilation, then runs of the same program
@pytest.mark.parametrize("tier", ["cpu_tier", "offload"])
def test_tier_figures_do_not_recompile(tier):
    requests = _requests(_rows())
    variants = ([{"cpu_tier": CPU}, {"cpu_tier": dataclasses.replace(CPU, blocks=40)},
                 {"cpu_tier": dataclasses.replace(CPU, bandwidth=0.5, base_latency_us=200)}]
                if tier == "cpu_tier" else
                [{"offload": _offload()}, {"offload": _offload(cpu_blocks=14)},
                 {"offload": _offload(tier=dataclasses.replace(TIER, read_bandwidth=3.0))}])
    outs = [_cluster(requests, variants[0])]
    before = csim.compiled_programs()
    outs += [_cluster(requests, v) for v in variants[1:]]
    assert csim.compiled_programs() == before
    assert len({tuple(o.ttft_us.tolist()) for o in outs}) == len(outs), "the figures do change the run"


@pytest.mark.parametrize("cluster, match", [
    (dict(prefill_instances=1, decode_instances=2), "PD disaggregation"),
])
@pytest.mark.parametrize("tier", ["cpu_tier", "offload"])
def test_unsupported_clusters_are_refused(cluster, match, tier):
    tiers = {"cpu_tier": CPU} if tier == "cpu_tier" else {"offload": _offload()}
    config = ClusterConfig(num_instances=3, routing_policy="round-robin", **cluster)
    with pytest.raises(ConfigError, match=match):
        simulate_cluster(_requests(_rows(n=6)), params_from(SETTINGS), latency_model(), config, block_size=16,
                         kv_bytes_per_token=1000.0, **tiers)


def test_offload_in_a_cluster_needs_fcfs():
    with pytest.raises(ConfigError, match="fcfs"):
        simulate_cluster(_requests(_rows(n=6)), params_from(SETTINGS), latency_model(),
                         ClusterConfig(num_instances=2), block_size=16, scheduler="sjf", offload=_offload())


def test_cpu_thrashing_rate_is_the_mean_over_instances():
    """Per-instance rates 1/4 and 0 (and an instance without stores, 0): mean 1/12, where the
    pooled ratio would be 1/8."""
    from blis_jax.metrics import cpu_tier_thrashing_rate

    counts = (np.array([0, 0, 0]), np.array([4, 4, 0]), np.array([1, 0, 0]))
    assert cpu_tier_thrashing_rate(counts) == pytest.approx(1 / 12)
    assert cpu_tier_thrashing_rate((np.array([3]), np.array([8]), np.array([2]))) == pytest.approx(0.25)


@pytest.mark.slow  # compiles the cluster at three sizes (~45 s on 2 cores)
def test_full_offload_buffers_grow_and_rerun_in_a_cluster(monkeypatch):
    """An instance's chain running out of pending jobs or jitter draws (OFFLOAD_FULL) stops the
    cluster for a rerun with more (engine/growth.py), and the run that fits is the one planned
    large from the start."""
    requests = _requests(_rows(n=45))
    tiers = {"offload": _offload(tier=dataclasses.replace(TIER, write_bandwidth=2.0, latency_jitter_stddev=0.3))}
    planned = _cluster(requests, tiers)
    sizes = tiny_offload_buffers(monkeypatch)
    grown = _cluster(requests, tiers)
    assert len(sizes) >= 2 and sizes[0] == (4, 64), sizes
    assert grown.result == 0 and planned.result == 0
    for field in ("status", "ttft_us", "e2e_us"):
        assert np.array_equal(getattr(grown, field), getattr(planned, field)), field
    assert {k: v.tolist() for k, v in grown.offload_counts.items()} == \
        {k: v.tolist() for k, v in planned.offload_counts.items()}
