"""Cluster admission (blis-features §3.3): always-admit, reject-all, token-bucket."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
    with pytest.raises(ConfigError, match="--admission-policy.*always-admit, token-bucket, reject-all"):
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
