"""BLIS's length and arrival samplers on Go streams (workload/go_samplers.py, blis-rng §3.2-3.3).

The blis-diff traces pin Gaussian, exponential, lognormal lengths and Poisson / Gamma / Weibull
arrivals exactly (test_go_generation.py). The rest of §3 has no BLIS reference: these tests check
its rules (draw counts, bounds, Go's rounding) and the laws' moments on 20 000 draws.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from blis_jax.rng.go_rand import GoRand
from blis_jax.workload import go_samplers as gs

N = 20_000


def _draw(sampler, seed=7, n=N):
    r = GoRand(seed)
    return np.array([sampler(r) for _ in range(n)], dtype=np.float64), r


def test_constant_draws_nothing_and_zero_becomes_one():
    r = GoRand(1)
    assert gs.length_sampler("constant", {"value": 7.9}).sample(r) == 7      # trunc, as Go's int()
    assert gs.length_sampler("constant", {"value": 0}).sample(r) == 1
    assert r.drawn == 0


def test_gaussian_degenerate_bounds_return_min_without_a_draw():
    r = GoRand(1)
    assert gs.length_sampler("gaussian", {"mean": 100, "std_dev": 5, "min": 3, "max": 3}).sample(r) == 3
    assert r.drawn == 0


def test_gaussian_clamps_not_resamples():
    x, _ = _draw(gs.length_sampler("gaussian", {"mean": 100, "std_dev": 50, "min": 80, "max": 120}))
    assert x.min() == 80 and x.max() == 120
    # P(N(100, 50) < 80) = Φ(−0.4) = 0.3446: the bound carries that mass
    assert abs((x == 80).mean() - 0.3446) < 0.02


def test_exponential_bounds_apply_only_when_positive():
    x, _ = _draw(gs.length_sampler("exponential", {"mean": 200}))
    assert x.min() >= 1 and abs(x.mean() / 200 - 1) < 0.03
    y, _ = _draw(gs.length_sampler("exponential", {"mean": 200, "min": 50, "max": 400}))
    assert y.min() == 50 and y.max() == 400


def test_lognormal_moments_and_overflow():
    x, _ = _draw(gs.length_sampler("lognormal", {"mu": 5.0, "sigma": 0.5}))
    assert abs(np.log(x).mean() - 5.0) < 0.02
    huge = gs.length_sampler("lognormal", {"mu": 800.0, "sigma": 1.0, "min": 9})
    assert huge.sample(GoRand(1)) == 9                      # exp overflows: min (BLIS)


def test_pareto_lognormal_mixture_weight():
    s = gs.length_sampler("pareto_lognormal", {"alpha": 2.0, "xm": 1000.0, "mu": 3.0, "sigma": 0.1,
                                              "mix_weight": 0.3})
    x, _ = _draw(s)
    # Pareto part ≥ xm = 1000; lognormal part ≈ e³ ≈ 20
    assert abs((x >= 1000).mean() - 0.3) < 0.015


def test_empirical_bins_and_draws():
    s = gs.length_sampler("empirical", {"30": 3, "10": 1, "20": 0})
    x, r = _draw(s, n=4000)
    assert set(np.unique(x)) == {10, 30} and abs((x == 30).mean() - 0.75) < 0.03
    assert r.drawn == 4000                                   # one Float64 per sample
    one = gs.length_sampler("empirical", {"42": 1.0})
    r = GoRand(3)
    assert one.sample(r) == 42 and r.drawn == 0


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 3.5])
def test_gamma_iat_mean_and_cv(cv):
    lam = 1e-4                                               # 100 req/s
    x, _ = _draw(gs.arrival_sampler("gamma", lam, cv=cv))
    assert abs(x.mean() * lam - 1) < 0.06
    assert abs(x.std() / x.mean() / cv - 1) < 0.08


@pytest.mark.parametrize("cv", [0.5, 1.5])
def test_weibull_iat_mean_and_cv(cv):
    lam = 1e-4
    x, _ = _draw(gs.arrival_sampler("weibull", lam, cv=cv))
    assert abs(x.mean() * lam - 1) < 0.04
    assert abs(x.std() / x.mean() / cv - 1) < 0.06


def test_weibull_shape_bisection():
    k = gs.weibull_shape(1.0)
    assert abs(k - 1.0) < 0.01                               # CV 1: exponential
    g1 = math.gamma(1 + 1 / gs.weibull_shape(0.5))
    assert abs(math.sqrt(math.gamma(1 + 2 / gs.weibull_shape(0.5)) / (g1 * g1) - 1) - 0.5) < 0.001


def test_constant_and_poisson_iats():
    r = GoRand(1)
    assert gs.arrival_sampler("constant", 1e-5)(r) == 99999 and r.drawn == 0   # ⌊1/λ⌋ through λ
    x, r = _draw(gs.arrival_sampler("poisson", 1e-3), n=5000)
    assert x.min() >= 1 and abs(x.mean() / 1000 - 1) < 0.05


def test_normalized_exponential_spans_the_duration_then_exhausts():
    s = gs.normalized_exponential(GoRand(5), 50, 10_000_000)
    r = GoRand(9)
    iats = [s(r) for _ in range(50)]
    assert s(r) == 0 and r.drawn == 0                        # draws only from its sub-stream
    assert 10_000_000 - 50 <= sum(iats) <= 10_000_000 and min(iats) >= 1
