"""Arrival processes (spec §4.4) and length distributions (§4.5): moments and KS tests of the
keyed-JAX samplers (the spec validation `generate` still uses; generation itself now runs on
BLIS's Go streams, workload/go_samplers.py, tested in test_go_samplers.py).

Every sampler draws 10k values from a fixed key, so the tests are deterministic; the
tolerances are still statistical (4 standard errors, KS p > 10⁻³) so that a wrong law fails
and a right one passes for any key.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from scipy import stats

from blis_jax.errors import ConfigError
from blis_jax.workload.arrivals import (
    ArrivalProcess,
    KeyColumn,
    fold,
    index_range,
    keyed_gamma,
    keyed_normal,
    keyed_uniform,
    make_arrival,
    normalized_arrivals_us,
    weibull_cv,
    weibull_shape_for_cv,
)
from blis_jax.workload.distribution import constant_iat_us
from blis_jax.workload.lengths import Empirical, go_round, make_length

N = 10_000
KEY = jax.random.key(2024)
IDX = index_range(0, N)


def _check_moments(x: np.ndarray, dist) -> None:
    """Sample mean within 4 SE of the law's mean; sample CV within 4 SE of its CV.

    The SE of the sample variance uses the law's kurtosis, so heavy tails get honest bounds."""
    mean, var, kurt = (float(v) for v in dist.stats(moments="mvk"))
    sd = math.sqrt(var)
    assert abs(x.mean() - mean) < 4 * sd / math.sqrt(len(x)), (x.mean(), mean)
    rel_var_se = math.sqrt((kurt + 2) / len(x))          # SE of s²/σ²
    cv, sample_cv = sd / mean, x.std() / x.mean()
    assert abs(sample_cv / cv - 1) < 4 * (rel_var_se / 2 + sd / mean / math.sqrt(len(x))), (sample_cv, cv)


def _check_ks(x: np.ndarray, cdf) -> None:
    assert stats.kstest(x, cdf).pvalue > 1e-3


# ------------------------------------------------------------------------------ arrivals


@pytest.mark.parametrize("rate", [10.0, 44.0 * 0.3, 0.5])
def test_poisson_iats(rate):
    p = make_arrival("poisson", rate)
    x = p.continuous_iats(KEY, IDX)
    law = stats.expon(scale=1e6 / rate)
    _check_moments(x, law)
    _check_ks(x, law.cdf)
    ints = p.iats_us(KEY, IDX)
    assert ints.dtype == np.int64 and ints.min() >= 1
    np.testing.assert_array_equal(ints, np.maximum(np.floor(x), 1).astype(np.int64))


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.5, 5.0])   # 2.5 and 5: shape < 1, the u^{1/α} boost
def test_gamma_iats(cv):
    rate = 22.0
    p = make_arrival("gamma", rate, cv=cv)
    assert p.kind == "gamma" and p.shape == pytest.approx(1 / cv**2)
    x = p.continuous_iats(KEY, IDX)
    law = stats.gamma(a=1 / cv**2, scale=cv**2 * 1e6 / rate)
    _check_moments(x, law)
    _check_ks(x, law.cdf)


def test_gamma_explicit_shape_scale_ignores_rate_and_tiny_shape_is_poisson():
    p = make_arrival("gamma", 123.0, shape=3.0, scale=5000.0)
    x = p.continuous_iats(KEY, IDX)
    _check_ks(x, stats.gamma(a=3.0, scale=5000.0).cdf)
    assert p.mean_iat_us == 15000.0
    fallback = make_arrival("gamma", 10.0, cv=11.0)     # shape 1/121 < 0.01
    assert fallback.kind == "poisson" and fallback.mean_iat_us == pytest.approx(1e5)


@pytest.mark.parametrize("cv", [0.3, 1.0, 1.5, 4.0])
def test_weibull_iats(cv):
    rate = 8.0
    p = make_arrival("weibull", rate, cv=cv)
    k = weibull_shape_for_cv(cv)
    assert p.shape == k and weibull_cv(k) == pytest.approx(cv, rel=0.01)
    x = p.continuous_iats(KEY, IDX)
    law = stats.weibull_min(c=k, scale=(1e6 / rate) / math.gamma(1 + 1 / k))
    assert law.mean() == pytest.approx(1e6 / rate)
    _check_moments(x, law)
    _check_ks(x, law.cdf)


def test_weibull_bisection_and_explicit_parameters():
    for cv in (0.0128, 0.1, 0.5, 1.0, 2.0, 10.4):
        k = weibull_shape_for_cv(cv)
        assert 0.1 <= k <= 100
        # Bisection stops at width 1e-3 in k: the CV error is that of a 5e-4 step in k.
        assert abs(weibull_cv(k) - cv) <= abs(weibull_cv(k + 5e-4) - weibull_cv(k - 5e-4)) + 1e-12
    assert weibull_shape_for_cv(1.0) == pytest.approx(1.0, abs=1e-3)   # exponential
    # The bracket [0.1, 100] only reaches CV(100) ≈ 0.0127: below that the shape saturates at
    # 100 (as in BLIS, whose validation still admits cv down to 0.01).
    assert weibull_shape_for_cv(0.01) == pytest.approx(100, abs=1e-3)
    p = make_arrival("weibull", 1.0, shape=2.0, scale=1000.0)
    _check_ks(p.continuous_iats(KEY, IDX), stats.weibull_min(c=2.0, scale=1000.0).cdf)


def test_constant_iats_match_cli_semantics():
    for rate in (9.0, 10.0, 200.0, 1e9):
        p = make_arrival("constant", rate)
        ints = p.iats_us(KEY, index_range(0, 100))
        assert (ints == constant_iat_us(rate)).all()
    assert make_arrival("constant", 10.0).iats_us(KEY, [0])[0] == 99999   # ⌊1/λ⌋ through λ


def test_integer_iats_are_at_least_one_microsecond():
    p = make_arrival("poisson", 5e6)       # mean 0.2 µs
    assert p.iats_us(KEY, IDX).min() == 1


def test_normalized_arrivals_span_the_window_exactly():
    p = make_arrival("poisson", 3.0)
    t = normalized_arrivals_us(p, KEY, 250, 5_000_000, 60_000_000)
    assert len(t) == 250 and t[-1] == 65_000_000 and t[0] > 5_000_000
    assert (np.diff(t) >= 0).all()
    # Rescaled exponential IATs: the normalized spacings are uniform order statistics.
    u = (t[:-1] - 5_000_000) / 60_000_000
    _check_ks(u, stats.uniform.cdf)
    assert len(normalized_arrivals_us(p, KEY, 0, 0, 10)) == 0


@pytest.mark.parametrize("process, kwargs, key", [
    ("weibull", {"cv": 12.0}, "arrival.cv"), ("weibull", {"cv": 0.001}, "arrival.cv"),
    ("gamma", {"cv": -1.0}, "arrival.cv"), ("pareto", {}, "arrival.process"),
    ("gamma", {"shape": -2.0}, "arrival.shape"),
])
def test_bad_arrival_names_the_key(process, kwargs, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        make_arrival(process, 1.0, **kwargs)
    # Explicit shape and scale lift the Weibull CV range.
    assert make_arrival("weibull", 1.0, cv=50.0, shape=0.5, scale=10.0).kind == "weibull"


# -------------------------------------------------------------------------- keyed draws


def test_keyed_draws_depend_only_on_index():
    for data in (0, 7, 0x636C6E74, 2**32 - 1):    # the compiled fold_in is jax.random.fold_in
        assert (jax.random.key_data(fold(KEY, data)) == jax.random.key_data(jax.random.fold_in(KEY, data))).all()
    idx = np.array([5, 70000, 3, 8191, 8192, 123456789])
    for fn in (keyed_uniform, keyed_normal):
        full = fn(KEY, index_range(0, 9000))
        np.testing.assert_array_equal(fn(KEY, [5, 3, 8191]), full[[5, 3, 8191]])
        a = fn(KEY, idx)
        np.testing.assert_array_equal(a, fn(KEY, idx))                       # deterministic
        np.testing.assert_array_equal(a[::-1], fn(KEY, idx[::-1]))           # order-free
        assert not np.array_equal(fn(KEY, idx, draw=1), a)                   # sub-draws differ
    u = keyed_uniform(KEY, IDX)
    assert u.min() > 0 and u.max() <= 1
    g = keyed_gamma(KEY, IDX, 0.3)
    np.testing.assert_array_equal(keyed_gamma(KEY, IDX[7:20], 0.3), g[7:20])


def test_a_key_column_draws_what_each_key_draws():
    """Many streams in one call (closed-loop session rounds): element i of a KeyColumn draw
    equals the draw of its own key, across block boundaries and after a fold."""
    keys = [fold(KEY, s) for s in range(3)]
    rows = np.arange(9000) % 3  # which stream each element uses
    idx = np.arange(9000)[::-1].copy()
    column = fold(KeyColumn.of(keys)[rows], 65)
    for fn in (keyed_uniform, keyed_normal):
        got = fn(column, idx, draw=2)
        for s in range(3):
            mine = rows == s
            np.testing.assert_array_equal(got[mine], fn(fold(keys[s], 65), idx[mine], draw=2))
    per_element = fold(KeyColumn.of(keys), np.array([4, 5, 6]))
    for s in range(3):
        assert (per_element.data[s] == np.asarray(jax.random.key_data(fold(keys[s], 4 + s)))).all()
    g = keyed_gamma(column[:600], idx[:600], 0.3)
    np.testing.assert_array_equal(g[rows[:600] == 1], keyed_gamma(fold(keys[1], 65), idx[:600][rows[:600] == 1], 0.3))
    with pytest.raises(ValueError, match="stream keys for"):
        keyed_uniform(column[:5], idx[:6])


# ------------------------------------------------------------------------------- lengths


def _clamped_rounded_mean(cdf, lo: int, hi: int) -> tuple[float, float]:
    """Exact mean and std of max(1, clamp(round(X), lo, hi)) for continuous X with `cdf`."""
    ks = np.arange(lo, hi + 1, dtype=np.float64)
    upper, lower = cdf(ks + 0.5), cdf(ks - 0.5)
    lower[0], upper[-1] = 0.0, 1.0
    p = upper - lower
    mean = float((p * ks).sum())
    return mean, float(math.sqrt((p * (ks - mean) ** 2).sum()))


def _check_integer_mean(x: np.ndarray, cdf, lo: int, hi: int) -> None:
    mean, std = _clamped_rounded_mean(cdf, lo, hi)
    assert abs(x.mean() - mean) < 4 * std / math.sqrt(len(x)), (x.mean(), mean)


def test_gaussian_lengths():
    d = make_length("gaussian", {"mean": 256, "std_dev": 100, "min": 16, "max": 1024}, "x")
    raw = d.sample_continuous(KEY, IDX)
    _check_ks(raw, stats.norm(256, 100).cdf)
    _check_moments(raw + 1000, stats.norm(1256, 100))        # shifted: CV is defined
    x = d.sample(KEY, IDX)
    assert x.dtype == np.int64 and x.min() >= 16 and x.max() <= 1024
    _check_integer_mean(x, stats.norm(256, 100).cdf, 16, 1024)
    np.testing.assert_array_equal(x, np.clip(go_round(np.clip(raw, 16, 1024)), 1, None).astype(np.int64))


def test_exponential_lengths():
    d = make_length("exponential", {"mean": 1000, "min": 32, "max": 5000}, "x")
    raw = d.sample_continuous(KEY, IDX)
    law = stats.expon(scale=1000)
    _check_ks(raw, law.cdf)
    _check_moments(raw, law)
    x = d.sample(KEY, IDX)
    assert x.min() >= 32 and x.max() <= 5000 and (x == 32).any() and (x == 5000).any()
    _check_integer_mean(x, law.cdf, 32, 5000)


def test_lognormal_lengths():
    d = make_length("lognormal", {"mu": 6.2, "sigma": 0.6, "min": 16, "max": 4096}, "x")
    raw = d.sample_continuous(KEY, IDX)
    law = stats.lognorm(s=0.6, scale=math.exp(6.2))
    _check_ks(raw, law.cdf)
    _check_moments(raw, law)
    x = d.sample(KEY, IDX)
    assert x.min() >= 16 and x.max() <= 4096
    _check_integer_mean(x, law.cdf, 16, 4096)


class _ParetoLognormal(stats.rv_continuous):
    def __init__(self, alpha, xm, mu, sigma, w):
        super().__init__(a=0.0)
        self.p = stats.pareto(b=alpha, scale=xm)
        self.l = stats.lognorm(s=sigma, scale=math.exp(mu))
        self.w = w

    def _cdf(self, x):
        return self.w * self.p.cdf(x) + (1 - self.w) * self.l.cdf(x)

    def _pdf(self, x):
        return self.w * self.p.pdf(x) + (1 - self.w) * self.l.pdf(x)


def test_pareto_lognormal_lengths():
    params = {"alpha": 3.0, "xm": 200.0, "mu": 5.0, "sigma": 0.5, "mix_weight": 0.3}
    d = make_length("pareto_lognormal", params, "x")
    raw = d.sample_continuous(KEY, IDX)
    law = _ParetoLognormal(3.0, 200.0, 5.0, 0.5, 0.3)
    _check_ks(raw, law.cdf)
    pareto, logn = stats.pareto(b=3.0, scale=200.0), stats.lognorm(s=0.5, scale=math.exp(5.0))
    mean = 0.3 * pareto.mean() + 0.7 * logn.mean()
    second = 0.3 * pareto.moment(2) + 0.7 * logn.moment(2)
    assert abs(raw.mean() - mean) < 4 * math.sqrt(second - mean**2) / math.sqrt(N)
    assert abs(np.mean(raw >= 200) - (0.3 + 0.7 * logn.sf(200))) < 4 * math.sqrt(0.25 / N)
    x = d.sample(KEY, IDX)
    assert x.min() >= 1 and x.dtype == np.int64


def test_empirical_lengths():
    d = make_length("empirical", {"100": 0.2, "50": 0.5, "400": 0.25, "7": 0.05, "9": 0.0}, "x")
    assert isinstance(d, Empirical) and d.values == (7, 9, 50, 100, 400)
    x = d.sample(KEY, IDX)
    assert set(np.unique(x)) == {7, 50, 100, 400}
    observed = np.array([(x == v).sum() for v in (7, 50, 100, 400)])
    expected = np.array([0.05, 0.5, 0.2, 0.25]) * N
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    mean = 7 * 0.05 + 50 * 0.5 + 100 * 0.2 + 400 * 0.25
    var = 49 * 0.05 + 2500 * 0.5 + 1e4 * 0.2 + 1.6e5 * 0.25 - mean**2
    assert abs(x.mean() - mean) < 4 * math.sqrt(var / N)
    # Unnormalised weights are normalised.
    w = make_length("empirical", {"10": 2, "20": 6}, "x")
    assert np.asarray(w.probabilities) == pytest.approx([0.25, 0.75])


def test_constant_and_degenerate_lengths():
    assert (make_length("constant", {"value": 300}, "x").sample(KEY, IDX[:50]) == 300).all()
    assert (make_length("constant", {"value": 0}, "x").sample(KEY, IDX[:5]) == 1).all()     # at least 1
    assert (make_length("constant", {"value": 0}, "x").sample(KEY, IDX[:5], floor_at=0) == 0).all()
    g = make_length("gaussian", {"mean": 10, "std_dev": 0}, "x")
    assert (g.sample(KEY, IDX[:5]) == 10).all()
    g = make_length("gaussian", {"mean": 10, "std_dev": 50, "min": 64, "max": 64}, "x")
    assert (g.sample(KEY, IDX[:5]) == 64).all()
    assert go_round(np.array([2.5, -2.5, 0.49])).tolist() == [3.0, -3.0, 0.0]


def test_lengths_are_keyed_per_request():
    d = make_length("lognormal", {"mu": 5, "sigma": 1}, "x")
    full = d.sample(KEY, IDX)
    np.testing.assert_array_equal(d.sample(KEY, IDX[100:200]), full[100:200])
    assert not np.array_equal(d.sample(jax.random.key(1), IDX), full)


@pytest.mark.parametrize("dist_type, params, key", [
    ("gaussian", {"mean": 1, "std_dev": 1, "sd": 3}, "x.params.sd"),
    ("gaussian", {"mean": 1}, "x.params.std_dev"),
    ("gaussian", {"mean": 1, "std_dev": -1}, "x.params.std_dev"),
    ("exponential", {"mean": 10, "min": 50, "max": 20}, "x.params.min"),
    ("exponential", {"mean": 0}, "x.params.mean"),
    ("pareto_lognormal", {"alpha": 1, "xm": 1, "mu": 1, "sigma": 1, "mix_weight": 1.5}, "x.params.mix_weight"),
    ("empirical", {"abc": 1.0}, "x.params.abc"),
    ("empirical", {"10": -1.0}, "x.params.10"),
    ("empirical", {"10": 0.0}, "x.params"),
    ("zipf", {}, "x.type"),
])
def test_bad_length_params_name_the_key(dist_type, params, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        make_length(dist_type, params, "x")


def test_arrival_process_dataclass_is_plain_data():
    p = make_arrival("gamma", 10.0, cv=2.0)
    assert p == ArrivalProcess("gamma", p.mean_iat_us, p.shape, p.scale_us)
