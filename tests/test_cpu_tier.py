"""Legacy CPU KV tier (engine/cpu_tier.py): invariants over a small run under GPU and CPU pressure.

After every few events: every GPU block is either free or referenced (free count + referenced
blocks = total), the CPU store holds at most its capacity, and its key -> slot map and slots
agree one to one. The run must actually reload from CPU and evict from it (else the
invariants would hold vacuously)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.engine import cpu_tier
from blis_jax.engine import simulate as sim
from blis_jax.engine.dims import choose_dims
from blis_jax.workload.requests import make_request_set
from engine_helpers import latency_model, params_from  # noqa: E402
from shared_data import BLIS_DIFF, needs_blis_diff as needs_shared  # noqa: E402

TOTAL_KV_BLOCKS = 48
CPU_BLOCKS = 20


def _scenario(groups_n: int = 4, seed: int = 5):
    rng = np.random.default_rng(seed)
    n = 30
    groups = rng.integers(0, groups_n, n)
    requests = make_request_set(request_id=np.arange(n), arrival_us=np.arange(n) * 4000,
                                input_len=64 + rng.integers(10, 120, n), output_len=rng.integers(5, 40, n),
                                prefix_group=np.array([f"g{g}" for g in groups]), prefix_len=np.full(n, 64))
    params = params_from(dict(max_num_seqs=8, max_num_batched_tokens=256, total_kv_blocks=TOTAL_KV_BLOCKS))
    params = dataclasses.replace(params, cpu=cpu_tier.make_params(CPU_BLOCKS, 16, 2.0, 10))
    dims = choose_dims(input_len=requests.input_len, output_len=requests.output_len,
                       prefix_group=requests.prefix_group, prefix_len=requests.prefix_len, max_num_seqs=8,
                       max_num_batched_tokens=256, total_kv_blocks=TOTAL_KV_BLOCKS, block_size=16)
    dims = sim.with_cpu_tier(dims, cpu_tier.CpuTier(blocks=CPU_BLOCKS, bandwidth=2.0, base_latency_us=10))
    return requests, params, dims


@pytest.mark.slow  # two compilations (~25 s each on 2 cores)
def test_blocks_conserved_and_cpu_within_capacity():
    requests, params, dims = _scenario()
    req = sim.request_arrays(requests, dims)
    model = latency_model()
    state = sim.start(dims, params, req, model)
    advance = jax.jit(sim.run_until, static_argnums=0)
    limit, checks = 0, 0
    while True:
        limit += 7
        state = advance(dims, state, params, req, model, jnp.int64(limit))
        s = jax.device_get(state)
        total = TOTAL_KV_BLOCKS
        referenced = int(np.sum(s.block_ref[:total] > 0))
        assert int(s.free_count) + referenced == total, "GPU blocks: free + referenced != total"
        assert np.all(s.block_ref[:total] >= 0)
        assert np.array_equal(s.block_free[:total], s.block_ref[:total] == 0)
        occupied = s.cpu_slot_key >= 0
        assert int(occupied.sum()) == int(s.cpu_count) <= CPU_BLOCKS, "CPU entries over capacity"
        assert not occupied[CPU_BLOCKS:].any()
        mapped = np.nonzero(s.cpu_key_slot >= 0)[0]
        assert len(mapped) == int(s.cpu_count)
        assert np.array_equal(s.cpu_slot_key[s.cpu_key_slot[mapped]], mapped), "key -> slot -> key mismatch"
        assert int(s.cpu_evictions) <= int(s.cpu_stores)
        checks += 1
        if bool(sim.finished(state, params, req)):
            break
    assert int(s.result) == 0 and checks > 3
    assert int(s.cpu_evictions) > 0, "the scenario must evict from CPU"
    assert int(s.finished) == len(requests)


@pytest.mark.slow
def test_reloads_add_hits_and_step_time():
    """With the CPU tier, prefixes evicted from GPU come back as hits and each costs step time."""
    requests, params, dims = _scenario(groups_n=10)
    out = sim.simulate_instance(requests, dataclasses.replace(params, cpu=None), latency_model(), block_size=16)
    tiered = sim.simulate_instance(requests, dataclasses.replace(params, cpu=None), latency_model(), block_size=16,
                                   cpu_tier=cpu_tier.CpuTier(blocks=400, bandwidth=2.0, base_latency_us=10))
    assert int(tiered.kv_hits[0]) > int(out.kv_hits[0])
    _, stores, evictions = (int(c[0]) for c in tiered.cpu_tier_counts)
    assert stores > 0 and evictions == 0
    # each reload makes a step 18 µs longer: some request's latency grows
    assert (tiered.e2e_us != out.e2e_us).any()
    assert out.cpu_tier_counts is None


def test_reload_time():
    assert cpu_tier.reload_time_us(16, 2.0, 10) == 18   # G01: 10 + ceil(16 / 2)
    assert cpu_tier.reload_time_us(16, 0.5, 40) == 72   # G02: 40 + ceil(16 / 0.5)
    assert cpu_tier.reload_time_us(16, 100.0, 0) == 1   # BLIS defaults: ceil(0.16)


def test_cpu_tier_settings_are_validated():
    from blis_jax.errors import ConfigError
    from blis_jax.scenario.config import Deployment

    assert Deployment(kv_cpu_blocks=10, kv_transfer_bandwidth=0.5, kv_transfer_base_latency=40).kv_cpu_blocks == 10
    for bad in (dict(kv_cpu_blocks=-1), dict(kv_transfer_bandwidth=0.0), dict(kv_transfer_base_latency=-3)):
        with pytest.raises(ConfigError):
            Deployment(**bad)


@pytest.mark.slow  # one compilation (~25 s on 2 cores) and the eager oracle
def test_reloads_as_the_oracle():
    """The engine's reloads against the eager reference of BLIS's tiered allocation
    (tests/reference_tiered.py) on a small run under GPU pressure with chunked prefills and
    preemptions: re-keyed own blocks, reloads stopped by a GPU block, prefixes past the chunk.
    The CPU store never evicts here (test_cpu_lru_as_the_oracle has it evict)."""
    requests, params, _ = _scenario(groups_n=10)
    out, res, kv, store = _engine_and_oracle(requests, params, 400)
    assert kv.reloads > 20 and res.counters["preemption_count"] > 0 and kv.evictions == 0
    _assert_same_run(requests, out, res, kv)
    # every hashed block stored, those at shifted token positions too (BLIS hashes them)
    shifted = [k for k in _ref_store(kv) if k[2] == "shifted"]
    assert len(shifted) > 0 and store == _ref_store(kv)
    _, stores, evictions = (int(c[0]) for c in out.cpu_tier_counts)
    assert (stores, evictions) == (kv.stores, 0)


def _engine_and_oracle(requests, params, cpu_blocks: int):
    """The engine's run with a CPU tier of `cpu_blocks` blocks, and the eager oracle's (result, KV cache)."""
    from blis_diff import TraceRequest
    from reference_engine import EngineConfig
    from reference_tiered import simulate_tiered
    from test_reference_engine import latency_hooks

    tier = cpu_tier.CpuTier(blocks=cpu_blocks, bandwidth=2.0, base_latency_us=10)
    params = dataclasses.replace(params, cpu=None)
    state, dims, code, itl_reader = sim._drive(requests, None, params, latency_model(), block_size=16, cpu_tier=tier)
    out = sim.to_output(state, dims, params, requests, code, itl_reader)
    reqs = [TraceRequest(request_id=int(requests.request_id[i]), arrival_us=int(requests.arrival_us[i]),
                         input_len=int(requests.input_len[i]), output_len=int(requests.output_len[i]), deadline_us=0,
                         prefix_group=str(requests.prefix_group[i]), prefix_len=int(requests.prefix_len[i]),
                         slo_class="", priority=1) for i in range(len(requests.request_id))]
    case = dict(model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100", tp=1, latency_model="trained-physics")
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, total_kv_blocks=TOTAL_KV_BLOCKS, block_size=16)
    res, kv = simulate_tiered(reqs, cfg, latency_hooks(case, [int(x) for x in requests.input_len]), tier.blocks,
                              cpu_tier.reload_time_us(16, tier.bandwidth, tier.base_latency_us))
    return out, res, kv, _cpu_store(requests, dims, jax.device_get(state))


def _cpu_store(requests, dims, s):
    """The engine's CPU store at the end, least recently used first, with the reference's keys."""
    req = sim.request_arrays(requests, dims)
    names = {int(g): str(n) for g, n in zip(np.asarray(req.prefix_group), requests.prefix_group)}
    shared = dims.prefix_groups * dims.prefix_blocks

    def ref_key(k):
        if k < shared:
            return ("g", names[k // dims.prefix_blocks], k % dims.prefix_blocks)
        r, j = divmod(k - shared, dims.blocks_per_request)
        if r >= dims.num_requests:   # kv.unique_key: a block at a shifted token position
            return ("r", int(requests.request_id[r - dims.num_requests]), "shifted", j)
        return ("r", int(requests.request_id[r]), 0, j)

    held = np.nonzero(s.cpu_slot_key >= 0)[0]
    return [ref_key(int(k)) for k in s.cpu_slot_key[held[np.argsort(s.cpu_slot_stamp[held])]]]


def _ref_store(kv):
    """The reference's CPU store, least recently used first, its keys of blocks at shifted token
    positions (offset -1 or a gap, see reference_tiered.py) as the engine's (one per request and index)."""
    return [k[:2] + ("shifted",) + k[3:] if k[0] == "r" and k[2] != 0 else k for k in kv.cpu]


def _assert_same_run(requests, out, res, kv):
    for i, rid in enumerate(int(x) for x in requests.request_id):
        assert (res.requests[rid]["ttft_us"], res.requests[rid]["e2e_us"]) == \
            (int(out.ttft_us[i]), int(out.e2e_us[i])), rid
    assert (int(out.kv_hits[0]), int(out.kv_misses[0])) == (kv.hits, kv.misses)


@pytest.mark.slow  # one compilation (~25 s on 2 cores) and the eager oracle
@pytest.mark.parametrize("seed, cpu_blocks", [(5, 40), (28, 50)])
def test_cpu_lru_as_the_oracle(seed, cpu_blocks):
    """A CPU store far smaller than the blocks passing through it (6 shared prefixes, a pass of
    up to ~100 blocks): the engine's LRU against the eager reference's sequential one. Which
    prefixes are still on CPU when a request reloads (TTFTs) depends on which entries one pass
    evicts: the least recent of the old entries and the pass's new ones together (seed 5: evicting
    the old ones first, then storing the new ones, is off), each key stamped with its last use in
    the pass (seed 28: its first use is off). The final store is the reference's, in LRU order.
    The store and eviction counts are the reference's less the keys it stores twice in one pass
    (evicted by that pass before a later use), which the engine's pass does not count."""
    requests, params, _ = _scenario(groups_n=6, seed=seed)
    out, res, kv, store = _engine_and_oracle(requests, params, cpu_blocks)
    assert kv.evictions > 100 and kv.restores > 0 and res.counters["preemption_count"] > 0
    _assert_same_run(requests, out, res, kv)
    assert store == _ref_store(kv)
    _, stores, evictions = (int(c[0]) for c in out.cpu_tier_counts)
    assert (stores, evictions) == (kv.stores - kv.restores, kv.evictions - kv.restores)


def test_reload_failure_warning_only_when_counted():
    """The warning is said once with the count over instances, and never without a failure or a tier."""
    from types import SimpleNamespace

    from blis_jax.scenario.simulate import _warn_cpu_reload_failures

    said = []
    for counts in (None, np.array([0]), np.array([3, 4])):
        _warn_cpu_reload_failures(SimpleNamespace(cpu_reload_failures=counts), said.append)
    assert len(said) == 1 and said[0].startswith("7 allocation(s) failed after reloading blocks from the CPU tier")


@needs_shared
@pytest.mark.slow  # one compilation and run (~75 s on 2 cores; after test_cli's G02 replay, the run only)
def test_reload_failures_counted_and_warned_on_g02():
    """G02 is off BLIS by the no-rollback quirk: its allocations that fail after a reload are
    counted and `simulate` says so instead of staying silent. (G01, as BLIS, counts none and
    warns nothing: tests/test_cli.py::test_replay_all_single_instance_cases.)"""
    from blis_jax import simulate
    from test_api_parity import case_config

    said = []
    out = simulate(case_config(next(BLIS_DIFF.glob("G02_*"))), warn=said.append).output
    failures = int(out.cpu_reload_failures.sum())
    assert failures > 0
    assert [w for w in said if "CPU tier" in w] == [
        f"{failures} allocation(s) failed after reloading blocks from the CPU tier; BLIS keeps the reloaded prefix "
        "held by the waiting request and blis-jax does not, so figures under this KV pressure differ from BLIS's "
        "(preemptions, TTFT)"]


@pytest.mark.slow  # compiles a LoRA engine program with a CPU tier (~25 s on 2 cores)
def test_a_head_blocked_on_its_adapter_counts_no_cpu_miss():
    """BLIS's LoRA gate stops admission before any allocation, so a head waiting for its adapter's
    cold load is no CPU miss. With GPU blocks to spare no allocation fails: no miss at all."""
    from test_lora import _lora_scenario

    requests, adapters, _, params, dims = _lora_scenario()   # 400 GPU blocks for 8 short requests at most
    tier = cpu_tier.CpuTier(blocks=64, bandwidth=2.0, base_latency_us=10)
    dims = sim.with_cpu_tier(dims, tier)
    params = dataclasses.replace(params, cpu=cpu_tier.make_params(tier.blocks, 16, tier.bandwidth,
                                                                  tier.base_latency_us))
    req = sim.request_arrays(requests, dims, adapters=adapters)
    model = latency_model()
    state = sim.start(dims, params, req, model)
    state = jax.jit(sim.run_until, static_argnums=0)(dims, state, params, req, model, jnp.int64(1_000_000))
    s = jax.device_get(state)
    assert bool(sim.finished(state, params, req)) and int(s.result) == 0
    assert int(s.lora_loads.sum()) >= 4 and int(s.cpu_stores) > 0   # heads waited on cold loads; blocks mirrored
    assert int(s.cpu_misses) == 0


@needs_shared
@pytest.mark.slow  # the eager oracle on G02, twice, checking the blocks every few steps (~20 s)
def test_oracle_no_rollback_holds_blocks_conserved_on_g02():
    """The eager oracle's no-rollback mode (tests/reference_tiered.py) on G02: allocations that fail
    after a reload leave their prefix held by the waiting request; GPU blocks stay conserved
    (every block free or referenced, each reference one entry of a running or waiting request's
    block list, the waiting holders' included), and the holding raises preemptions over the run
    that claims nothing on failure, as BLIS's G02 notes describe (189 vs 91 with a rollback patch)."""
    from blis_diff import load_case
    from reference_tiered import TieredEngine
    from test_reference_engine import engine_config, latency_hooks

    c = load_case("G02")
    flags = c.case["other_flags"]
    reload_us = cpu_tier.reload_time_us(c.case["block_size"], flags["kv_transfer_bandwidth"],
                                        flags["kv_transfer_base_latency"])
    lat = latency_hooks(c.case, [r.input_len for r in c.requests])
    preemptions, checks, held_seen = {}, 0, 0
    for no_rollback in (False, True):
        eng = TieredEngine(c.requests, engine_config(c.case), lat, flags["kv_cpu_blocks"], reload_us,
                           record_steps=False, no_rollback=no_rollback)
        kv, step = eng.kv, eng._step

        def checked_step(now, eng=eng, kv=kv, step=step):
            nonlocal checks, held_seen
            step(now)
            if eng.c["step_count"] % 7:
                return
            assert_oracle_blocks_conserved(kv)
            waiting = {r.request_id for r in eng.wait}
            assert kv.holders <= waiting and all(kv.req_blocks[h] for h in kv.holders)
            assert set(kv.req_blocks) <= waiting | {r.request_id for r in eng.running}
            held_seen += len(kv.holders)
            checks += 1

        eng._step = checked_step
        res = eng.run()
        assert res.counters["completed"] == len(c.requests) and kv.ref == [0] * kv.n
        assert kv.reload_failures > 0 and not kv.holders   # every holder was admitted in the end
        preemptions[no_rollback] = res.counters["preemption_count"]
    assert checks > 1000 and held_seen > 100
    assert preemptions[True] > 1.5 * preemptions[False]


def assert_oracle_blocks_conserved(kv) -> None:
    """The eager oracle's GPU blocks: each refcount is the block's entries in the requests' block
    lists (held ones included), and the free list is the unreferenced blocks."""
    refs = [0] * kv.n
    for blocks in kv.req_blocks.values():
        for b in blocks:
            refs[b] += 1
    assert refs == kv.ref, "a block's refcount is not its entries in the requests' block lists"
    assert set(kv.free) == {b for b in range(kv.n) if refs[b] == 0}, "free list != unreferenced blocks"

@needs_shared
@pytest.mark.slow  # the eager oracle on G02, checking the blocks every few steps (~12 s)
def test_oracle_partial_hold_fits_blis_g02_to_5_45_s():
    """The eager oracle's partial_hold failure path (tests/reference_tiered.py, a fit of BLIS's
    no-rollback quirk, not BLIS's code) on G02: every request whose first token (resp. completion)
    BLIS records before 5.45 s has its TTFT (resp. E2E) within 0.5 ms of BLIS's (with the default
    failure path 26 of 42 TTFTs and 8 of 19 E2Es; 27 holds a claim of only shared blocks at
    4.12 s and 26 is preempted at 4.15 s as in BLIS); GPU blocks stay conserved while requests hold."""
    from blis_diff import load_case
    from reference_tiered import TieredEngine
    from test_reference_engine import engine_config, latency_hooks

    c = load_case("G02")
    flags = c.case["other_flags"]
    reload_us = cpu_tier.reload_time_us(c.case["block_size"], flags["kv_transfer_bandwidth"],
                                        flags["kv_transfer_base_latency"])
    lat = latency_hooks(c.case, [r.input_len for r in c.requests])
    eng = TieredEngine(c.requests, engine_config(c.case), lat, flags["kv_cpu_blocks"], reload_us,
                       record_steps=False, partial_hold=True)
    kv, step = eng.kv, eng._step
    shared_seen = 0

    def checked_step(now):
        nonlocal shared_seen
        step(now)
        if eng.c["step_count"] % 5:
            return
        assert_oracle_blocks_conserved(kv)
        assert kv.shared_holders <= kv.holders <= {r.request_id for r in eng.wait}
        shared_seen += len(kv.shared_holders)

    eng._step = checked_step
    res = eng.run()
    assert res.counters["completed"] == len(c.requests) and kv.ref == [0] * kv.n and not kv.holders
    assert shared_seen > 0
    ttft_off, e2e_off, n_ttft, n_e2e = [], [], 0, 0
    for rid, want in c.results.items():
        got, arrival = res.requests[rid], c.requests[rid].arrival_us
        if arrival + want["ttft_us"] < 5_450_000:
            n_ttft += 1
            if abs(got["ttft_us"] - want["ttft_us"]) > 500:
                ttft_off.append(rid)
        if arrival + want["e2e_us"] < 5_450_000:
            n_e2e += 1
            if abs(got["e2e_us"] - want["e2e_us"]) > 500:
                e2e_off.append(rid)
    assert n_ttft == 42 and n_e2e == 19
    assert not ttft_off and not e2e_off, (ttft_off, e2e_off)


@needs_shared
@pytest.mark.slow  # the eager oracle on G02's trace (~5 s)
def test_g02_without_the_cpu_tier_is_blis_without_offload():
    """G02's trace without the CPU tier reproduces the BLIS run without the offload flags that G02
    records (key_outcomes.without_offload): the base from which G02's CPU-tier divergence is
    measured (tests/reference_tiered.py) is BLIS's."""
    from blis_diff import load_case
    from reference_engine import simulate
    from test_reference_engine import engine_config, latency_hooks

    c = load_case("G02")
    want = c.case["key_outcomes"]["without_offload"]
    res = simulate(c.requests, engine_config(c.case), latency_hooks(c.case, [r.input_len for r in c.requests]),
                   record_steps=False)
    done = [r for r in res.requests.values() if r["status"] == "completed"]
    assert (len(done), res.counters["preemption_count"]) == (want["completed"], want["preemptions"])
    assert res.counters["cache_hit_rate"] == pytest.approx(want["cache_hit_rate"], abs=1e-12)
    assert round(np.mean([r["ttft_us"] for r in done]) / 1000, 3) == want["ttft_mean_ms"]
    assert round(np.mean([r["e2e_us"] for r in done]) / 1000, 3) == want["e2e_mean_ms"]


@pytest.mark.parametrize("m, key_space", [(50, 100), (300, 40), (50, 1000), (1000, 100_000)])
def test_first_and_last_use_of_each_key_in_a_pass(m, key_space):
    """The mirror's per-pass first and last use of each key, on both of its paths (a scatter over
    a small key space, a sort of the pass over a large one), against a direct search."""
    from blis_jax.engine.cpu_tier import _first_and_last_use

    rng = np.random.default_rng(m + key_space)
    keys = rng.integers(0, key_space + 1, m)   # key_space: no key
    first, last = (np.asarray(a) for a in _first_and_last_use(jnp.asarray(keys), key_space))
    for i in np.flatnonzero(keys < key_space):
        same = np.flatnonzero(keys == keys[i])
        assert (first[i], last[i]) == (same[0], same[-1]), i


@pytest.mark.slow  # eager, jitted and vmapped passes (~15 s on 2 cores)
def test_a_long_padded_pass_runs_on_its_valid_keys_as_on_the_whole_pass():
    """lru_pass on a long padded pass (its valid keys compacted when they fit short_pass, else
    the whole pass) keeps the entries, their LRU order and the counts of the whole pass, pass
    after pass, in and out of jit and under vmap (lanes on either path)."""
    from types import SimpleNamespace

    from blis_jax.engine.cpu_tier import BIG, LruStore, _pass, lru_pass, short_pass

    dims = SimpleNamespace(kv_blocks=16, cpu_keys=600, cpu_blocks=64)
    short, m = short_pass(dims), 8 * short_pass(dims)
    capacity = jnp.int64(48)
    rng = np.random.default_rng(7)

    def passes(n_valid):   # valid keys at random positions of the padded pass, some repeated
        keys = rng.integers(0, dims.cpu_keys, (6, m))
        valid = np.zeros((6, m), bool)
        for p in range(6):
            valid[p, rng.choice(m, n_valid[p], replace=False)] = True
        return jnp.asarray(np.where(valid, keys, dims.cpu_keys)), jnp.asarray(valid)

    def empty():
        return LruStore(jnp.full(dims.cpu_blocks, -1, jnp.int64), jnp.full(dims.cpu_blocks, BIG, jnp.int64),
                        jnp.full(dims.cpu_keys, -1, jnp.int32), jnp.int64(0))

    def run(fn, keys, valid):
        store, count, seen = empty(), jnp.int64(0), []
        for p in range(keys.shape[0]):
            store, n_new, evict = fn(store, dims, capacity, count, keys[p], valid[p], jnp.asarray(True))
            count = jnp.sum(store.slot_key >= 0).astype(jnp.int64)
            occupied = np.asarray(store.slot_key) >= 0
            by_use = np.asarray(store.slot_key)[occupied][np.argsort(np.asarray(store.slot_stamp)[occupied])]
            seen.append((by_use.tolist(), np.asarray(store.key_slot).tolist(), int(n_new), int(evict)))
        return seen

    n_valid = [short // 2, short, short + 5, 3, short * 3, 0]   # both paths, and a pass with none
    keys, valid = passes(n_valid)
    whole = run(_pass, keys, valid)
    assert run(lru_pass, keys, valid) == whole
    jitted = jax.jit(lambda store, *a: lru_pass(store, dims, *a))
    assert run(lambda store, _, *a: jitted(store, *a), keys, valid) == whole
    assert any(e > 0 for *_, e in whole) and any(n > 0 for *_, n, _ in whole)
    # two lanes, one over short_pass where the other fits, at every pass
    keys2, valid2 = passes([short * 2, 1, short // 3, short + 1, 2, short * 4])
    lanes = jax.vmap(lambda k, v: lru_pass(empty(), dims, capacity, jnp.int64(0), k, v, jnp.asarray(True)))
    for p in range(6):
        store, n_new, evict = lanes(jnp.stack([keys[p], keys2[p]]), jnp.stack([valid[p], valid2[p]]))
        for lane, (k, v) in enumerate([(keys[p], valid[p]), (keys2[p], valid2[p])]):
            one = _pass(empty(), dims, capacity, jnp.int64(0), k, v, jnp.asarray(True))
            assert np.array_equal(np.asarray(store.key_slot[lane]), np.asarray(one[0].key_slot))
            assert (int(n_new[lane]), int(evict[lane])) == (int(one[1]), int(one[2]))
