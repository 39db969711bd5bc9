"""blis-infra §7 worked examples WE-15 (GPU inventory), WE-17 (collector: per-model grouping and
pending supply, as the tick's analysis sees it, and through the loop's own collect) and WE-18
(model filter and routability)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp

from blis_jax.cluster import autoscaler as asc
from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster import loop, signals
from blis_jax.cluster.node_pools import free_gpu_slots

# ------------------------------------------------------------------------------ WE-15 GPU inventory


def test_we15_gpu_inventory():
    a100 = {"A100": 8}   # one Ready A100 node with 8 GPUs
    assert free_gpu_slots(a100, [], 1) == {("A100", 1): 8}
    assert free_gpu_slots(a100, [("A100", 2, lc.ACTIVE)], 1)[("A100", 2)] == 6
    states = (lc.LOADING, lc.WARMING_UP, lc.ACTIVE, lc.DRAINING, lc.SCHEDULING, lc.TERMINATED)
    assert free_gpu_slots(a100, [("A100", 1, s) for s in states], 1) == {("A100", 1): 8 - 4}
    assert free_gpu_slots(a100, [], 0) == {("A100", 1): 8}   # cluster TP 0 lists TP 1
    assert free_gpu_slots(a100, [("A100", 1, lc.ACTIVE)] * 10, 1) == {("A100", 1): 0}   # clamped from -2
    assert free_gpu_slots({}, [("A100", 1, lc.ACTIVE)], 1) == {}   # no node pools: empty


# ------------------------------------------------------------------------------ WE-17 collector

K, U, D, A = 0.8, 0.8, 0.4, 512.0
MODEL_A, MODEL_B = 0, 1   # model ids in byte order of their names
A100_1, H100_2 = 0, 1
VARIANTS = asc.Variants.of([("A100", 1, 10.0), ("H100", 2, 20.0)])
analyze = jax.jit(asc.analyze, static_argnums=3)


def _replicas(model, variant, capacity, used, queue, routable, loading, pending):
    arr = lambda v, t: jnp.asarray(v, t)  # noqa: E731
    return asc.Replicas(routable=arr(routable, bool), loading=arr(loading, bool), model=arr(model, jnp.int32),
                        variant=arr(variant, jnp.int32), capacity_tokens=arr(capacity, jnp.int64),
                        used_tokens=arr(used, jnp.int64), queue_depth=arr(queue, jnp.int64),
                        pending_tokens=arr(pending, jnp.int64))


def _params():
    return asc.AnalyzerParams.of(asc.AnalyzerConfig(K, U, D, A))


def test_we17_models_grouped_with_their_replicas():
    # i1, i2: modelA on (A100, 1); i3: modelB on (H100, 2) with C 20 000, U 14 000, Q 5; slot 4 empty
    rep = _replicas(model=[MODEL_A, MODEL_A, MODEL_B, 0], variant=[A100_1, A100_1, H100_2, 0],
                    capacity=[10_000, 10_000, 20_000, 0], used=[1000, 1000, 14_000, 0], queue=[0, 0, 5, 0],
                    routable=[True, True, True, False], loading=[False] * 4, pending=[0] * 4)
    an = analyze(rep, _params(), VARIANTS, 2)
    assert an.count.tolist() == [[2, 0], [0, 1]]
    assert an.supply[MODEL_B].tolist() == [0.0, 20_000 * K]   # its capacity copied unchanged
    # modelB: demand 14 000 + 5·512 = 16 560 → required 16 560/0.8 − 16 000 = 4700
    assert float(an.required[MODEL_B]) == 16_560 / U - 16_000
    assert float(an.required[MODEL_A]) == 0.0


def test_we17_loading_replicas_are_pending_supply_and_a_loading_only_model_has_no_replicas():
    def required(loading_slots, model_of_loading=MODEL_A):
        loading = [False, False, *(k < loading_slots for k in range(2))]
        rep = _replicas(model=[MODEL_A, MODEL_A, model_of_loading, model_of_loading], variant=[A100_1] * 4,
                        capacity=[40_000, 0, 0, 0], used=[36_000, 0, 0, 0], queue=[0] * 4,
                        routable=[True, False, False, False], loading=loading, pending=[0, 0, 10_000, 10_000])
        return analyze(rep, _params(), VARIANTS, 2)

    base = 36_000 / U - 40_000 * K   # 13 000 with no pending supply
    assert float(required(0).required[MODEL_A]) == base
    assert float(required(1).required[MODEL_A]) == base - 10_000 * K == 5000   # one loading replica: 10 000 tokens
    assert float(required(2).required[MODEL_A]) == 0.0   # two (20 000 tokens): 13 000 − 16 000 < 0, suppressed
    only = required(2, model_of_loading=MODEL_B)   # modelB has loading replicas only
    assert only.count[MODEL_B].tolist() == [0, 0] and float(only.required[MODEL_B]) == 0.0


# WE-17 again, through the tick's own collect: the live engine signals of each instance, the
# snapshot refresh over the routable ones, then `collect_replicas` (16-token blocks)


def _collect(states, models, variants, total_blocks, used_blocks, queue):
    n = len(states)
    zeros = jnp.zeros(n, jnp.int64)
    engines = SimpleNamespace(   # the fields of the stacked engine states that live_signals reads
        free_count=jnp.asarray(total_blocks, jnp.int64) - jnp.asarray(used_blocks, jnp.int64),
        wait_len=jnp.asarray(queue, jnp.int32), batch_len=jnp.zeros(n, jnp.int32), kv_hits=zeros, kv_misses=zeros,
        preemptions=zeros, lora_slot=jnp.zeros((n, 0), jnp.int32))
    life = lc.make(states)
    cp = _cparams(models, [-1], total_kv_blocks=total_blocks)
    live = loop.live_signals(engines, cp.total_kv_blocks, 16)
    seen = signals.refresh(signals.init_snapshot(n), live, 1_000_000, lc.routable(life)).signals
    return loop.collect_replicas(life, jnp.asarray(variants, jnp.int32), seen, cp, 16)


def test_we17_through_the_collect():
    # i1, i2: modelA on (A100, 1), C 10 000 tokens; i3: modelB on (H100, 2), C 20 000, U 14 000 (KV 0.7), Q 5
    rep = _collect([lc.ACTIVE] * 3, [MODEL_A, MODEL_A, MODEL_B], [A100_1, A100_1, H100_2], [625, 625, 1250],
                   [0, 0, 875], [0, 0, 5])
    assert (rep.capacity_tokens.tolist(), rep.used_tokens.tolist(), rep.queue_depth.tolist()) == (
        [10_000, 10_000, 20_000], [0, 0, 14_000], [0, 0, 5])   # copied unchanged
    an = analyze(rep, _params(), VARIANTS, 2)
    assert an.count.tolist() == [[2, 0], [0, 1]]
    assert an.supply[MODEL_B].tolist() == [0.0, 20_000 * K]
    assert float(an.required[MODEL_B]) == 16_560 / U - 16_000


def test_we17_loading_snapshots_through_the_collect():
    # modelA: one Active replica (C 40 000, U 36 000); one or two Loading replicas of 10 000 tokens,
    # whose live state is not read (a Loading instance is not routable: zero load, capacity pending)
    def required(loading):
        states = [lc.ACTIVE] + [lc.LOADING] * loading + [lc.TERMINATED] * (2 - loading)
        rep = _collect(states, [MODEL_A] * 3, [A100_1] * 3, [2500, 625, 625], [2250, 300, 300], [0, 4, 4])
        assert rep.used_tokens.tolist()[1:] == [0, 0] and rep.queue_depth.tolist()[1:] == [0, 0]
        assert rep.loading.tolist() == [False] + [k < loading for k in range(2)]
        return float(analyze(rep, _params(), VARIANTS, 2).required[MODEL_A])

    assert required(0) == 36_000 / U - 40_000 * K == 13_000
    assert required(1) == 13_000 - 10_000 * K == 5000
    assert required(2) == 0.0


# ------------------------------------------------------------------------------ WE-18 model filter


def _cparams(instance_model, request_model, total_kv_blocks=None):
    slots = len(instance_model)
    blocks = jnp.full(slots, 100, jnp.int64) if total_kv_blocks is None else jnp.asarray(total_kv_blocks, jnp.int64)
    return loop.ClusterParams(active=jnp.ones(slots, bool), admission_latency_us=jnp.int64(0),
                              routing_latency_us=jnp.int64(0), prefill_role=jnp.zeros(slots, bool),
                              decode_role=jnp.ones(slots, bool), pd=None, kv_bytes_per_token=jnp.float64(0),
                              total_kv_blocks=blocks, max_model_len=jnp.zeros(slots, jnp.int64),
                              gateway=None, instance_model=jnp.asarray(instance_model, jnp.int32),
                              request_model=jnp.asarray(request_model, jnp.int32))


def test_we18_model_filter():
    llama, qwen = 0, 1
    cp = _cparams([llama, llama, qwen, qwen], [llama, -1])
    routable = lc.routable(lc.make([lc.ACTIVE] * 4))
    assert loop.eligible(cp, routable, 0).tolist() == [True, True, False, False]   # 2 snapshots, all llama
    # two model-m instances, both Draining: none for a model-m request
    cp = _cparams([0, 0], [0])
    assert not loop.eligible(cp, lc.routable(lc.make([lc.DRAINING, lc.DRAINING])), 0).any()
    # an untagged request on a 3-instance cluster: all 3
    cp = _cparams([0, 0, 0], [-1])
    assert int(loop.eligible(cp, lc.routable(lc.make([lc.ACTIVE] * 3)), 0).sum()) == 3


def test_we18_loading_instances_are_pending_supply_not_snapshots():
    # the tick's collect: routable instances are replicas, Loading ones pending supply with their
    # configured capacity (total blocks × block size) and no load
    life = lc.make([lc.ACTIVE, lc.LOADING], loaded_at=[0, 5_000_000])
    routable, loading = lc.routable(life), life.state == lc.LOADING
    assert routable.tolist() == [True, False] and loading.tolist() == [False, True]
    rep = asc.Replicas(routable=routable, loading=loading, model=jnp.zeros(2, jnp.int32),
                       variant=jnp.zeros(2, jnp.int32), capacity_tokens=jnp.asarray([1600, 0], jnp.int64),
                       used_tokens=jnp.zeros(2, jnp.int64), queue_depth=jnp.zeros(2, jnp.int64),
                       pending_tokens=jnp.asarray([1600, 1600], jnp.int64))
    an = analyze(rep, _params(), VARIANTS, 2)
    assert an.count[0].tolist() == [1, 0]   # one replica (the Active one); the Loading one is pending only
    assert not bool(an.zero_capacity[1])   # a Loading instance is no routable replica (no warning)
