"""Routing policies (blis-features §3.5): round-robin, least-loaded, always-busiest, weighted;
tie-breaking, masking of non-routable slots, the policy modules' `route` (Go-stream draws only
on ties, state changes only on a decision), and BLIS reference cases D01 / E05."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cluster_helpers import router_state, strict_dtypes  # noqa: F401 (autouse fixture)
from shared_data import needs_blis_diff

from blis_jax.cluster import pd
from blis_jax.cluster import routing as rt
from blis_jax.cluster import scorers as sc
from blis_jax.cluster import signals as sg
from blis_jax.errors import ConfigError
from blis_jax.rng.go_jax import GoStream, go_stream
from blis_jax.rng.go_rand import GoRand

ACTIVE = [True, True, True, False]


def rstate(qd=(3, 1, 0, 0), bs=(1, 0, 2, 0), in_flight=(0, 3, 1, 0), kvu=(0.25, 0.5, 1.0, 0.0),
           active=ACTIVE) -> sg.RouterState:
    return router_state(qd, bs, in_flight, kvu, active)


def req(cached=(0, 2, 1, 9), keys=(0, 0, 0), num_blocks=0):
    return sc.route_request(100, len(cached), cached_prefix_blocks=jnp.asarray(cached, jnp.int64),
                            block_keys=jnp.asarray(keys, jnp.int64), num_blocks=num_blocks)


# ----------------------------------------------------------------------------- round-robin


def rr_targets(active, n):
    rr, out = rt.init_round_robin(), []
    for _ in range(n):
        rr, t = rt.round_robin(rr, jnp.asarray(active))
        out.append(int(t))
    return rr, out


def test_round_robin_cycles_over_routable_slots():
    _, out = rr_targets([True, False, True, True], 7)
    # counter mod 3 over the filtered list [0, 2, 3].
    assert out == [0, 2, 3, 0, 2, 3, 0]


def test_round_robin_counter_is_shared_across_masks():
    # With PD pools one counter serves both pools, so masks interleave on one count.
    rr, a = rt.round_robin(rt.init_round_robin(), jnp.asarray([True, True, False, False]))
    rr, b = rt.round_robin(rr, jnp.asarray([False, False, True, True]))
    rr, c = rt.round_robin(rr, jnp.asarray([True, True, True, False]))
    assert (int(a), int(b), int(c)) == (0, 3, 2)  # counters 0, 1, 2
    assert int(rr.counter) == 3


def test_round_robin_no_routable_slot():
    rr, out = rr_targets([False] * 4, 3)
    assert out == [-1, -1, -1] and int(rr.counter) == 0  # rejection does not advance it


# ----------------------------------------------------------------------------- least-loaded, busiest


def test_least_loaded_minimum_effective_load():
    # loads QD+BS+in-flight = 4, 4, 3 (slot 3 has load 0 but is not routable).
    assert int(rt.least_loaded(rstate())) == 2


def test_always_busiest_first_wins():
    assert int(rt.always_busiest(rstate())) == 0  # loads 4, 4, 3: the first 4 wins


def test_least_loaded_ties_uniform_among_tied_only():
    rs = rstate(qd=(2, 5, 2, 0), bs=(0, 0, 0, 0), in_flight=(0, 0, 0, 0))  # tied slots 0, 2
    assert int(rt.least_loaded(rs)) == 0  # key=None: lowest index
    choose = jax.jit(jax.vmap(rt.least_loaded, in_axes=(None, 0)))
    picks = np.asarray(choose(rs, jax.random.split(jax.random.key(0), 400)))
    assert set(picks.tolist()) == {0, 2}
    # Uniform: a fair coin over 400 draws stays within 5 sigma (±50) of 200.
    assert abs(int((picks == 0).sum()) - 200) < 50


def test_pick():
    assert int(rt.pick(jnp.zeros(5, bool))) == -1
    assert int(rt.pick(jnp.asarray([False, False, True, True]))) == 2
    eligible = jnp.asarray([True, False, True, False, True])
    picks = np.asarray(jax.vmap(rt.pick, in_axes=(None, 0))(eligible, jax.random.split(jax.random.key(1), 600)))
    counts = [int((picks == i).sum()) for i in range(5)]
    assert counts[1] == counts[3] == 0 and all(abs(c - 200) < 60 for c in (counts[0], counts[2], counts[4]))


# ----------------------------------------------------------------------------- weighted


def test_weighted_default_profile_argmax():
    profile = sc.make_profile(None, 4)
    _, target, total = rt.weighted(profile, rstate(), req())
    # totals 0.1875, 0.7916..., 0.5 (see test_cluster_scorers) => slot 1.
    assert int(target) == 1
    assert np.asarray(total).argmax() == 1


def test_weighted_ties_and_masking():
    profile = sc.make_profile("queue-depth:1", 4)
    rs = rstate(qd=(0, 5, 5, 5), active=[False, True, True, True])
    # Slots 1-3 tie (all equal => 1.0); slot 0 (QD 0, the best) is not routable.
    _, target, _ = rt.weighted(profile, rs, req())
    assert int(target) == 1
    keys = jax.random.split(jax.random.key(2), 300)
    picks = np.asarray(jax.jit(jax.vmap(lambda k: rt.weighted(profile, rs, req(), k)[1]))(keys))
    assert set(picks.tolist()) == {1, 2, 3}


def test_weighted_no_routable_slot():
    profile = sc.make_profile("prefix-affinity:1,no-hit-lru:1", 4, prefix_affinity_capacity=8)
    new, target, _ = jax.jit(rt.weighted)(profile, rstate(active=[False] * 4), req(keys=(1, 2, 3), num_blocks=3))
    assert int(target) == -1
    chex.assert_trees_all_equal(new, profile)  # observers see nothing


def test_weighted_prefix_affinity_observer_pulls_repeat_requests():
    profile = sc.make_profile("prefix-affinity:1", 4, prefix_affinity_capacity=8)
    r = req(keys=(7, 8, 9), num_blocks=3)
    # First: nobody has the blocks (all 0, tie); slot 0 is not routable => lowest routable, 1.
    profile, t1, _ = rt.weighted(profile, rstate(active=[False, True, True, True]), r)
    # Again with every slot routable: the index now holds the blocks on slot 1 only.
    _, t2, total = rt.weighted(profile, rstate(active=[True] * 4), r)
    assert (int(t1), int(t2)) == (1, 1)
    assert np.asarray(total).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_weighted_no_hit_lru_rotates_cold_requests():
    profile = sc.make_profile("no-hit-lru:1", 4)
    rs, cold = rstate(), req(cached=(0, 0, 0, 0))
    step = jax.jit(rt.weighted)
    targets = []
    for _ in range(6):
        profile, t, _ = step(profile, rs, cold)
        targets.append(int(t))
    # Never-used slots first (index order), then least recently used: 0 1 2 0 1 2.
    assert targets == [0, 1, 2, 0, 1, 2]


def test_check_policy():
    assert rt.check_policy("weighted") == "weighted"
    with pytest.raises(ConfigError, match="--routing-policy.*round-robin"):
        rt.check_policy("random")


# ----------------------------------------------------------------------------- jit / vmap


def random_state(rng, n=8):
    active = rng.random(n) < 0.75
    active[0] = True
    return rstate(tuple(rng.integers(0, 4, n)), tuple(rng.integers(0, 3, n)), tuple(rng.integers(0, 3, n)),
                  tuple(rng.random(n)), tuple(active))


def test_jit_matches_eager_and_vmap_matches_loop():
    rng = np.random.default_rng(4)
    profile = sc.make_profile(None, 8)
    states = [random_state(rng) for _ in range(6)]
    reqs = [sc.route_request(64, 8, cached_prefix_blocks=jnp.asarray(rng.integers(0, 3, 8))) for _ in range(6)]
    keys = jax.random.split(jax.random.key(3), 6)

    def decide(rs, r, k):
        return rt.least_loaded(rs, k), rt.always_busiest(rs), rt.weighted(profile, rs, r, k)[1]

    eager = [decide(rs, r, k) for rs, r, k in zip(states, reqs, keys)]
    jitted = [jax.jit(decide)(rs, r, k) for rs, r, k in zip(states, reqs, keys)]
    chex.assert_trees_all_equal(jitted, eager)
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
    batched = jax.jit(jax.vmap(decide))(stack(states), stack(reqs), keys)
    chex.assert_trees_all_equal(batched, stack(eager))
    for (ll, busy, w), rs in zip(eager, states):
        assert bool(rs.active[ll]) and bool(rs.active[busy]) and bool(rs.active[w])


def test_round_robin_scan_no_retrace():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(rr, masks):
        return jax.lax.scan(rt.round_robin, rr, masks)

    masks = jnp.asarray([[True, True, False]] * 5)
    rr, out = run(rt.init_round_robin(), masks)
    assert np.asarray(out).tolist() == [0, 1, 0, 1, 0] and int(rr.counter) == 5
    run(rr, jnp.asarray([[False, True, True]] * 5))  # new values, same program


# ----------------------------------------------------------------------------- BLIS reference cases


@needs_blis_diff
def test_blis_diff_d01_round_robin_targets():
    # D01: 4 instances, round-robin, every request admitted and routed in arrival order, so
    # request k goes to instance k mod 4; BLIS's handled_by must match per request.
    from blis_diff import load_case

    case = load_case("D01")
    assert case["routing_policy"] == "round-robin" and case.num_instances == 4
    _, targets = jax.jit(lambda m: jax.lax.scan(rt.round_robin, rt.init_round_robin(), m))(
        jnp.ones((len(case.requests), 4), bool))
    handled = [case.request_metrics[r.request_id]["handled_by"] for r in case.requests]
    assert handled == [f"instance_{int(t)}" for t in np.asarray(targets)]


@needs_blis_diff
def test_blis_diff_e05_pd_shared_round_robin_counter():
    # E05: 2 prefill + 2 decode pods, decider always, round-robin. Per request the decode pick
    # (decode pool, counter even) then the prefill pick (prefill pool, counter odd) advance one
    # counter, so BLIS decodes everything on instance_2 and prefills on instance_1.
    from blis_diff import load_case

    case = load_case("E05")
    other = case["other_flags"]
    prefill_mask, decode_mask, _ = pd.pool_masks(
        case.num_instances, prefill=other["prefill_instances"], decode=other["decode_instances"])
    cfg = pd.make_pd_config(other["pd_decider"])

    def one(rr, input_len):
        rr, dec = rt.round_robin(rr, decode_mask)
        split = pd.disaggregate(cfg, input_len, jnp.asarray(0, jnp.int64), 16)
        rr2, pre = rt.round_robin(rr, prefill_mask)
        rr = jax.tree.map(lambda a, b: jnp.where(split, a, b), rr2, rr)
        return rr, (dec, jnp.where(split, pre, -1))

    lens = jnp.asarray([r.input_len for r in case.requests], jnp.int64)
    _, (dec, pre) = jax.jit(lambda x: jax.lax.scan(one, rt.init_round_robin(), x))(lens)
    handled = {case.request_metrics[r.request_id]["handled_by"] for r in case.requests}
    assert handled == {"instance_2"}
    assert set(np.asarray(dec).tolist()) == {2} and set(np.asarray(pre).tolist()) == {1}


# ----------------------------------------------------------------------------- policy modules


def stream(seed=7):
    return go_stream(seed)


def drew(before: GoStream, after: GoStream) -> int:
    """Go words consumed between two states of one stream (each draw here takes one)."""
    return int((int(before.tap) - int(after.tap)) % 607)


def test_round_robin_route_advances_once_per_decision_and_never_draws():
    policy, s = rt.make_routing("round-robin"), stream()
    route = jax.jit(lambda p, rs: p.route(rs, None, s))
    targets = []
    for active in ([True, False, True, True],) * 4 + ([False] * 4,) + ([True, True, True, True],):
        policy, t, after = route(policy, rstate(active=active))
        chex.assert_trees_all_equal(after, s)
        targets.append(int(t))
    # counter mod 3 over [0, 2, 3]; no routable slot: -1, counter kept; then counter 4 mod 4.
    assert targets == [0, 2, 3, 0, -1, 0]
    assert int(policy.counter) == 5


def test_least_loaded_route_draws_only_on_ties():
    s = stream(11)
    # loads 4, 4, 3: a unique minimum (slot 2), no draw
    policy, t, after = rt.LeastLoaded().route(rstate(), None, s)
    assert int(t) == 2 and drew(s, after) == 0
    chex.assert_trees_all_equal(after, s)
    # loads 2, 5, 2: slots 0 and 2 tie, one Intn(2) from the Go source picks among them
    rs = rstate(qd=(2, 5, 2, 0), bs=(0, 0, 0, 0), in_flight=(0, 0, 0, 0))
    _, t, after = rt.LeastLoaded().route(rs, None, s)
    assert int(t) == (0, 2)[GoRand(11).intn(2)] and drew(s, after) == 1
    # none routable: -1, no draw
    _, t, after = rt.LeastLoaded().route(rstate(active=[False] * 4), None, s)
    assert int(t) == -1 and drew(s, after) == 0


def test_least_loaded_route_tie_draws_follow_the_go_source():
    rs = rstate(qd=(1, 1, 1, 1), bs=(0, 0, 0, 0), in_flight=(0, 0, 0, 0), active=[True] * 4)
    route = jax.jit(lambda s: rt.LeastLoaded().route(rs, None, s)[1:])
    s, ref, got = stream(3), GoRand(3), []
    for _ in range(20):
        t, s = route(s)
        got.append(int(t))
    assert got == [ref.intn(4) for _ in range(20)]


def test_always_busiest_route_first_wins_without_drawing():
    s = stream()
    rs = rstate(qd=(1, 4, 4, 9), bs=(0, 0, 0, 0), in_flight=(0, 0, 0, 0))  # slot 3 not routable
    _, t, after = rt.AlwaysBusiest().route(rs, None, s)
    assert int(t) == 1
    chex.assert_trees_all_equal(after, s)
    assert int(rt.AlwaysBusiest().route(rstate(active=[False] * 4), None, s)[1]) == -1


def test_weighted_route_ties_draw_and_observers_see_the_choice():
    policy = rt.make_routing("weighted", 4, scorers="prefix-affinity:1")
    r, s = req(keys=(7, 8, 9), num_blocks=3), stream(5)
    # Nobody holds the blocks: all three routable slots tie, one Intn(3).
    policy, t1, s1 = policy.route(rstate(active=[False, True, True, True]), r, s)
    assert int(t1) == (1, 2, 3)[GoRand(5).intn(3)] and drew(s, s1) == 1
    # The index now holds them on t1 only: a unique best, no draw.
    policy, t2, s2 = policy.route(rstate(active=[True] * 4), r, s1)
    assert int(t2) == int(t1) and drew(s1, s2) == 0


def test_weighted_route_no_routable_slot_changes_nothing():
    policy = rt.make_routing("weighted", 4, scorers="prefix-affinity:1,no-hit-lru:1")
    s = stream()
    new, t, after = jax.jit(lambda p: p.route(rstate(active=[False] * 4), req(keys=(1, 2, 3), num_blocks=3), s))(
        policy)
    assert int(t) == -1
    chex.assert_trees_all_equal((new, after), (policy, s))


def test_make_routing_and_what_policies_read():
    assert type(rt.make_routing()) is rt.RoundRobin and int(rt.make_routing().counter) == 0
    assert type(rt.make_routing("least-loaded")) is rt.LeastLoaded
    assert type(rt.make_routing("always-busiest")) is rt.AlwaysBusiest
    weighted = rt.make_routing("weighted", 4)
    assert weighted.scorers == tuple(n for n, _ in sc.parse_profile(sc.DEFAULT_PROFILE))
    # round-robin reads no instance state; least-loaded's EffectiveLoad has the live in-flight counts
    assert not rt.RoundRobin.reads_signals and not rt.make_routing().reads_in_flight
    assert rt.LeastLoaded().reads_in_flight and rt.AlwaysBusiest().reads_in_flight
    assert weighted.reads_signals and not weighted.reads_in_flight
    assert rt.make_routing("weighted", 4, scorers="queue-depth:1,active-requests:1").reads_in_flight
    with pytest.raises(ConfigError, match="--routing-policy 'random'"):
        rt.make_routing("random")
    with pytest.raises(ConfigError, match="--routing-scorers is used by --routing-policy weighted only"):
        rt.make_routing("least-loaded", 4, scorers="queue-depth:1")
    with pytest.raises(ConfigError, match="--routing-scorers: unknown scorer 'qd'"):
        rt.make_routing("weighted", 4, scorers="qd:1")


def test_route_new_numbers_same_program_and_vmap_lanes():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def route(policy, rs, s):
        return policy.route(rs, req(), s)

    rs = rstate()
    w = rt.make_routing("weighted", 4, scorers="queue-depth:1,kv-utilization:1")
    # queue-depth 0, 2/3, 1 and 1 - KV 0.75, 0.5, 0 on the routable slots: totals .375, .583, .5
    _, t, _ = route(w, rs, stream())
    # other weights, same program: kv-utilization alone now decides (slot 0: KV 0.25)
    heavy = rt.Weighted(dataclasses.replace(w.profile, weights=jnp.asarray([1e-9, 1.0 - 1e-9])))
    _, t_heavy, _ = route(heavy, rs, stream())
    assert (int(t), int(t_heavy)) == (1, 0)
    # one round-robin counter per lane
    rr = rt.RoundRobin(counter=jnp.arange(4, dtype=jnp.int64))
    new, targets = jax.vmap(lambda p: p.route(rs, None, stream())[:2])(rr)
    assert np.asarray(targets).tolist() == [0, 1, 2, 0] and np.asarray(new.counter).tolist() == [1, 2, 3, 4]
