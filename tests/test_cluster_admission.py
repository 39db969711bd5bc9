"""Cluster admission (blis-features §3.3): always-admit, reject-all, token-bucket, and the
load-reading tier-shed and gaie-legacy (decisions on hand-built RouterStates here; in the
cluster loop in test_cluster_loop.py)."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cluster_helpers import router_state
from shared_data import needs_blis_diff

from blis_jax.cluster import admission as adm
from blis_jax.errors import ConfigError


@pytest.fixture(autouse=True)
def _strict_dtypes():
    # Implicit dtype promotion inside the cluster code would be a silent int/float mix-up.
    with jax.numpy_dtype_promotion("strict"):
        yield


def decide(policy, now, input_len):
    return adm.admit(policy, jnp.asarray(now, jnp.int64), jnp.asarray(input_len, jnp.int64))


def run_decisions(policy, times, lengths):
    """Admission decisions for requests in arrival order, as one jitted scan."""

    def body(p, x):
        p, ok = adm.admit(p, x[0], x[1])
        return p, ok

    xs = jnp.stack([jnp.asarray(times, jnp.int64), jnp.asarray(lengths, jnp.int64)], axis=1)
    return jax.jit(lambda p, xs: jax.lax.scan(body, p, xs))(policy, xs)


def reference_token_bucket(capacity, rate, times, lengths):
    """Independent pure-Python model of BLIS's bucket (float64 = Python float)."""
    tokens, last, out = float(capacity), 0, []
    for t, n in zip(times, lengths):
        elapsed = t - last
        if elapsed > 0:
            tokens = min(float(capacity), tokens + float(elapsed) * rate / 1e6)
            last = t
        ok = tokens >= float(n)
        if ok:
            tokens -= float(n)
        out.append(ok)
    return out, tokens, last


def test_always_admit_and_reject_all():
    for policy, expected in ((adm.make_admission("always-admit"), True), (adm.make_admission("reject-all"), False)):
        _, oks = run_decisions(policy, [0, 5, 5, 10**10], [1, 10**6, 0, 7])
        assert np.asarray(oks).tolist() == [expected] * 4


def test_token_bucket_hand_example():
    # capacity 100 tokens, refill 1000 tokens/s = 1 token per ms.
    tb = adm.token_bucket(100, 1000)
    tb, ok = decide(tb, 0, 60)  # full bucket: 100 >= 60 -> admit, 40 left
    assert bool(ok) and float(tb.tokens) == 40.0
    tb, ok = decide(tb, 0, 50)  # 40 < 50 -> reject, a rejected request is not charged
    assert not bool(ok) and float(tb.tokens) == 40.0
    tb, ok = decide(tb, 5_000, 45)  # +5 tokens after 5 ms -> 45 >= 45 (equality admits)
    assert bool(ok) and float(tb.tokens) == 0.0 and int(tb.last_refill_us) == 5_000
    tb, ok = decide(tb, 5_000, 1)  # no time elapsed -> nothing refilled
    assert not bool(ok)
    tb, ok = decide(tb, 1_000_000, 100)  # +995 capped at the capacity 100
    assert bool(ok) and float(tb.tokens) == 0.0


def test_token_bucket_fractional_refill():
    # 3 tokens/s: 333,334 µs give 1.000002 tokens, 333,333 µs only 0.999999.
    tb, ok = decide(adm.token_bucket(10, 3), 0, 10)
    assert bool(ok) and float(tb.tokens) == 0.0
    _, ok = decide(tb, 333_333, 1)
    assert not bool(ok)
    tb2, ok = decide(tb, 333_334, 1)
    assert bool(ok) and float(tb2.tokens) == pytest.approx(2e-6, abs=1e-12)


def test_token_bucket_cost_is_input_length_including_prefix():
    # A 20-token prompt (e.g. 16 shared-prefix + 4 own tokens) costs 20, not 4.
    tb, ok = decide(adm.token_bucket(20, 0), 0, 20)
    assert bool(ok) and float(tb.tokens) == 0.0
    _, ok = decide(tb, 10**9, 1)  # zero refill rate: the budget never comes back
    assert not bool(ok)


def test_token_bucket_matches_reference_on_random_arrivals():
    rng = np.random.default_rng(1)
    times = np.cumsum(rng.integers(0, 3_000, 400)).tolist()
    lengths = rng.integers(1, 800, 400).tolist()
    expected, tokens, last = reference_token_bucket(5_000, 150_000.5, times, lengths)
    tb, oks = run_decisions(adm.token_bucket(5_000, 150_000.5), times, lengths)
    assert np.asarray(oks).tolist() == expected
    assert 0 < sum(expected) < len(expected)  # both outcomes occur, so the check has teeth
    assert float(tb.tokens) == tokens and int(tb.last_refill_us) == last


def test_jit_matches_eager_and_no_retrace_on_new_numbers():
    times, lengths = [0, 10, 2_000, 2_000, 9_000], [30, 30, 30, 5, 50]
    eager, oks = adm.token_bucket(60, 10_000), []
    for t, n in zip(times, lengths):
        eager, ok = decide(eager, t, n)
        oks.append(bool(ok))
    tb, jit_oks = run_decisions(adm.token_bucket(60, 10_000), times, lengths)
    assert np.asarray(jit_oks).tolist() == oks
    chex.assert_trees_all_equal(tb, eager)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def one(p, t, n):
        return adm.admit(p, t, n)

    for cap, rate in ((60, 10_000), (1, 2), (1e6, 0.5)):
        one(adm.token_bucket(cap, rate), jnp.asarray(3, jnp.int64), jnp.asarray(4, jnp.int64))


def test_vmap_over_buckets_matches_loop():
    # Each bucket first sees an 8-token request at t=0, then (vmapped) a 6-token one at 4 ms.
    buckets = [decide(adm.token_bucket(c, r), 0, 8)[0] for c, r in ((10, 1000), (50, 0), (5, 1e6))]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *buckets)
    now, n = jnp.asarray([4_000, 4_000, 4_000]), jnp.asarray([6, 6, 6])
    vb, vok = jax.jit(jax.vmap(adm.admit))(stacked, now, n)
    for i, b in enumerate(buckets):
        b2, ok = decide(b, 4_000, 6)
        assert bool(vok[i]) == bool(ok)
        chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i: x[i], vb), b2)
    # 10-8 = 2, +4 tokens in 4 ms = 6 >= 6; 50-8 = 42 without refill; 5 < 8 rejected at t=0
    # and the refill is capped at the capacity 5 < 6.
    assert np.asarray(vok).tolist() == [True, True, False]


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"token_bucket_capacity": 0}, "--token-bucket-capacity"),
        ({"token_bucket_capacity": float("nan")}, "--token-bucket-capacity"),
        ({"token_bucket_refill_rate": -1}, "--token-bucket-refill-rate"),
        ({"token_bucket_refill_rate": float("inf")}, "--token-bucket-refill-rate"),
    ],
)
def test_bad_token_bucket_flags(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        adm.make_admission("token-bucket", **kwargs)


def test_unknown_policy_names_the_flag_and_choices():
    with pytest.raises(ConfigError, match="--admission-policy.*always-admit, token-bucket, reject-all, tier-shed, "
                                          "gaie-legacy"):
        adm.make_admission("tokenbucket")


@needs_blis_diff
def test_blis_diff_e01_token_bucket_rejections():
    # E01: one instance, token-bucket 20000 tokens / 6000 tokens/s, admission latency 0. The
    # bucket reads only arrival times and prompt lengths, so BLIS's rejections follow from the
    # trace: the rejected count and exactly which requests reached the instance.
    from blis_diff import load_case

    case = load_case("E01")
    assert case["admission_latency_us"] == 0
    other = case["other_flags"]
    policy = adm.make_admission(
        "token-bucket", token_bucket_capacity=other["token_bucket_capacity"],
        token_bucket_refill_rate=other["token_bucket_refill_rate"],
    )
    reqs = case.requests
    _, oks = run_decisions(policy, [r.arrival_us for r in reqs], [r.input_len for r in reqs])
    oks = np.asarray(oks)
    stdout = (case.path / "stdout.txt").read_text()
    rejected = int(re.search(r"Rejected Requests \(Admission\): (\d+)", stdout).group(1))
    assert int((~oks).sum()) == rejected == 214
    admitted_ids = {r.request_id for r, ok in zip(reqs, oks) if ok}
    assert admitted_ids == set(case.request_metrics)
    assert case.metrics["injected_requests"] == len(admitted_ids)


# ================================================================ tier-shed and gaie-legacy


def decide_loaded(policy, priority, rs):
    return bool(adm.admit(policy, jnp.int64(0), jnp.int64(100), jnp.int64(priority), rs)[1])


def test_cluster_priorities_are_the_gaie_convention():
    from blis_jax.workload.requests import slo_priority
    got = {c: int(adm.cluster_priority(slo_priority(c))) for c in
           ("critical", "standard", "", "batch", "sheddable", "background", "unknown")}
    assert got == {"critical": 4, "standard": 3, "": 3, "batch": -1, "sheddable": -2, "background": -3, "unknown": 3}


def test_tier_shed_sheds_low_classes_above_the_busiest_load():
    policy = adm.make_admission("tier-shed", tier_shed_threshold=6)
    assert policy.reads_state and not adm.make_admission("token-bucket").reads_state
    # loads 1+2+3 = 6 and 0; the inactive slot's 50 does not count
    calm = router_state([1, 0, 50], [2, 0, 0], [3, 0, 0], [0.0, 0.0, 0.0], [True, True, False])
    busy = router_state([1, 0, 50], [2, 0, 0], [4, 0, 0], [0.0, 0.0, 0.0], [True, True, False])
    for priority in (4, 3, 0, -1, -2, -3):
        assert decide_loaded(policy, priority, calm)
        assert decide_loaded(policy, priority, busy) == (priority >= 0)
    strict = adm.make_admission("tier-shed", tier_shed_threshold=6, tier_shed_min_priority=4)
    assert [decide_loaded(strict, p, busy) for p in (4, 3, -2)] == [True, False, False]
    nobody = router_state([9], [9], [9], [0.0], [False])  # no routable instance: load 0
    assert decide_loaded(adm.make_admission("tier-shed"), -2, nobody)


def test_gaie_legacy_sheds_sheddable_requests_at_saturation():
    policy = adm.make_admission("gaie-legacy", queue_depth_threshold=4, kv_cache_util_threshold=0.5)
    # per instance max(QD/4, KV/0.5): 0.5 and 1.4 -> mean 0.95; the inactive one is ignored
    below = router_state([2, 0, 99], [0, 0, 0], [0, 0, 0], [0.1, 0.7, 1.0], [True, True, False])
    at = router_state([2, 2, 99], [0, 0, 0], [0, 0, 0], [0.1, 0.75, 1.0], [True, True, False])  # 0.5, 1.5
    assert float(adm.saturation(below, 4.0, 0.5)) == pytest.approx(0.95)
    assert float(adm.saturation(at, 4.0, 0.5)) == pytest.approx(1.0)
    for priority in (4, 3, 0):
        assert decide_loaded(policy, priority, below) and decide_loaded(policy, priority, at)
    for priority in (-1, -2, -3):
        assert decide_loaded(policy, priority, below) and not decide_loaded(policy, priority, at)
    nobody = router_state([0], [0], [0], [0.0], [False])  # saturation 1 without routable instances
    assert not decide_loaded(policy, -2, nobody) and decide_loaded(policy, 3, nobody)


@pytest.mark.parametrize("kwargs, flag", [
    ({"tier_shed_threshold": -1}, "--tier-shed-threshold"),
    ({"tier_shed_min_priority": 0.5}, "--tier-shed-min-priority"),
])
def test_bad_tier_shed_flags(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        adm.make_admission("tier-shed", **kwargs)


@pytest.mark.parametrize("kwargs, flag", [
    ({"queue_depth_threshold": 0}, "--queue-depth-threshold"),
    ({"kv_cache_util_threshold": float("nan")}, "--kv-cache-util-threshold"),
])
def test_bad_gaie_flags(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        adm.make_admission("gaie-legacy", **kwargs)


def test_cli_flags_reach_the_load_reading_policies():
    from blis_jax.cli import build_parser
    from blis_jax.cli.scenario_flags import cluster

    def policy(*flags):
        return cluster(build_parser().parse_args(["run", "--num-instances", "2", *flags])).validate().admission()

    shed = policy("--admission-policy", "tier-shed", "--tier-shed-threshold", "7", "--tier-shed-min-priority", "3")
    assert isinstance(shed, adm.TierShed) and (int(shed.threshold), int(shed.min_priority)) == (7, 3)
    gaie = policy("--admission-policy", "gaie-legacy", "--queue-depth-threshold", "2", "--kv-cache-util-threshold",
                  "0.5")
    assert isinstance(gaie, adm.GaieLegacy)
    assert (float(gaie.qd_threshold), float(gaie.kv_threshold)) == (2.0, 0.5)
    with pytest.raises(ConfigError, match="--queue-depth-threshold"):
        policy("--admission-policy", "gaie-legacy", "--queue-depth-threshold", "-1")
