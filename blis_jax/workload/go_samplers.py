"""BLIS's length and arrival samplers on Go `math/rand` streams (blis-rng.md §3.2–3.3).

Each sampler is a callable taking the `GoRand` stream it draws from and returning an integer;
the draws, their order and the float arithmetic (left to right, Go's rounding: `go_round`
ties away from zero, `int(x)` truncation) follow BLIS exactly, so a seeded stream gives
BLIS's values.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections.abc import Callable, Mapping

from blis_jax.rng.go_rand import GoRand, go_log, go_round

Sampler = Callable[[GoRand], int]

MIN_RATE_PER_US = 1e-15          # BLIS raises smaller rates to this
_TINY = 5e-324                   # 2⁻¹⁰⁷⁴, BLIS's replacement for a uniform draw of 0
GAMMA_MIN_SHAPE = 0.01


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:        # Go's Exp returns +Inf
        return math.inf


def _pow(x: float, y: float) -> float:
    try:
        return math.pow(x, y)
    except OverflowError:
        return math.inf
    except ValueError:
        return math.nan


class LengthSampler(abc.ABC):
    """A BLIS length sampler: `sample(stream)` → int; `draws` is False for samplers that
    never touch the stream (constant, degenerate Gaussian, ≤ 1 empirical bin)."""

    draws = True

    @abc.abstractmethod
    def sample(self, r: GoRand) -> int:
        """One length drawn from `r`."""

    def __call__(self, r: GoRand) -> int:
        return self.sample(r)


class Gaussian(LengthSampler):
    def __init__(self, mean: float, std: float, lo: int | float, hi: int | float):
        self.mean, self.std, self.lo, self.hi = mean, std, lo, hi
        self.draws = lo != hi

    def sample(self, r: GoRand) -> int:
        if self.lo == self.hi:
            return int(self.lo)
        v = r.norm_float64() * self.std + self.mean
        c = min(self.hi, max(self.lo, v))
        return max(int(go_round(c)), 1)


class Exponential(LengthSampler):
    def __init__(self, mean: float, lo: int, hi: int):
        self.mean, self.lo, self.hi = mean, lo, hi

    def sample(self, r: GoRand) -> int:
        return _bounded(go_round(r.exp_float64() * self.mean), self.lo, self.hi)


class Lognormal(LengthSampler):
    def __init__(self, mu: float, sigma: float, lo: int, hi: int):
        self.mu, self.sigma, self.lo, self.hi = mu, sigma, lo, hi

    def sample(self, r: GoRand) -> int:
        v = _exp(self.mu + self.sigma * r.norm_float64())
        if not math.isfinite(v):
            return self.lo if self.lo > 0 else 1
        return _bounded(go_round(v), self.lo, self.hi)


class ParetoLognormal(LengthSampler):
    def __init__(self, alpha: float, xm: float, mu: float, sigma: float, mix_weight: float):
        self.alpha, self.xm, self.mu, self.sigma, self.mix = alpha, xm, mu, sigma, mix_weight

    def sample(self, r: GoRand) -> int:
        if r.float64() < self.mix:
            u = r.float64() or _TINY
            p = _pow(u, 1.0 / self.alpha)
            v = self.xm / p if p != 0 else math.inf
        else:
            v = _exp(self.mu + self.sigma * r.norm_float64())
        if not math.isfinite(v):
            return 1
        return max(int(go_round(v)), 1)


class Constant(LengthSampler):
    draws = False

    def __init__(self, value: int):
        self.value = value if value >= 1 else 1

    def sample(self, r: GoRand) -> int:
        return self.value


class Empirical(LengthSampler):
    def __init__(self, params: Mapping[str, float]):
        pairs = sorted((int(float(str(k))), float(p)) for k, p in params.items())
        total = 0.0
        for _, p in pairs:
            total += p
        kept = [(k, p) for k, p in pairs if p > 0]
        self.keys = [k for k, _ in kept]
        cdf, acc = [], 0.0
        for _, p in kept:
            acc += p / total
            cdf.append(acc)
        if cdf:
            cdf[-1] = 1.0
        self.cdf = cdf
        self.draws = len(kept) > 1

    def sample(self, r: GoRand) -> int:
        if not self.keys:
            return 1
        if len(self.keys) == 1:
            return self.keys[0]
        u = r.float64()
        return self.keys[min(bisect.bisect_left(self.cdf, u), len(self.keys) - 1)]


def _bounded(k: float, lo: int, hi: int) -> int:
    if lo > 0 and k < lo:
        k = lo
    if hi > 0 and k > hi:
        k = hi
    return max(int(k), 1)


def length_sampler(dist_type: str, params: Mapping[str, float]) -> LengthSampler:
    """The BLIS sampler of a (validated) length distribution spec. Integer parameters
    (`min`, `max`, `value`) are truncated as Go's `int(x)` does."""
    p = {k: float(v) for k, v in params.items()} if dist_type != "empirical" else params
    if dist_type == "gaussian":
        # An absent bound is unbounded here (BLIS would read 0); specs normally give both.
        lo = int(p["min"]) if "min" in p else -math.inf
        hi = int(p["max"]) if "max" in p else math.inf
        return Gaussian(p["mean"], p["std_dev"], lo, hi)
    if dist_type == "exponential":
        return Exponential(p["mean"], int(p.get("min", 0)), int(p.get("max", 0)))
    if dist_type == "lognormal":
        return Lognormal(p["mu"], p["sigma"], int(p.get("min", 0)), int(p.get("max", 0)))
    if dist_type == "pareto_lognormal":
        return ParetoLognormal(p["alpha"], p["xm"], p["mu"], p["sigma"], p["mix_weight"])
    if dist_type == "constant":
        return Constant(int(p["value"]))
    if dist_type == "empirical":
        return Empirical(params)
    raise ValueError(dist_type)


# ---------------------------------------------------------------------------- arrivals


def gamma_variate(r: GoRand, shape: float, scale: float) -> float:
    """Marsaglia–Tsang with the small-shape boost, in BLIS's draw order."""
    if shape < 1:
        u = r.float64()
        g = gamma_variate(r, shape + 1, scale)
        return g * _pow(u, 1.0 / shape)
    d = shape - 1.0 / 3.0
    c = 1.0 / math.sqrt(9 * d)
    while True:
        while True:
            x = r.norm_float64()
            v = 1 + c * x
            if v > 0:
                break
        v = v * v * v
        u = r.float64()
        if u < 1 - 0.0331 * (x * x) * (x * x):
            return d * v * scale
        if go_log(u) < 0.5 * x * x + d * (1 - v + go_log(v)):
            return d * v * scale


def weibull_shape(cv: float) -> float:
    """BLIS's bisection for the Weibull shape of a coefficient of variation."""
    lo, hi = 0.1, 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        g1 = math.gamma(1 + 1 / mid)
        c = math.sqrt(math.gamma(1 + 2 / mid) / (g1 * g1) - 1)
        if abs(c - cv) < 0.001:
            return mid
        if c > cv:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def arrival_sampler(process: str, rate_per_us: float, *, cv: float | None = None, shape: float | None = None,
                    scale: float | None = None) -> Sampler:
    """Inter-arrival sampler (integer µs) of a client's arrival spec at λ = `rate_per_us`."""
    lam = max(rate_per_us, MIN_RATE_PER_US)
    explicit = shape is not None and scale is not None and shape > 0 and scale > 0
    if process == "constant":
        iat = max(int(1.0 / lam), 1)
        return lambda r: iat
    if process == "gamma":
        if explicit:
            k, theta = float(shape), float(scale)
        else:
            c = 1.0 if cv is None or cv <= 0 else float(cv)
            k = 1.0 / (c * c)
            theta = 1.0 / lam * c * c
            if k < GAMMA_MIN_SHAPE:
                return poisson_sampler(lam)
        return lambda r: max(int(gamma_variate(r, k, theta)), 1)
    if process == "weibull":
        if explicit:
            k, lam_w = float(shape), float(scale)
        else:
            c = 1.0 if cv is None or cv <= 0 else float(cv)
            k = weibull_shape(c)
            lam_w = 1.0 / lam / math.gamma(1 + 1 / k)
        inv_k = 1 / k

        def weibull(r: GoRand) -> int:
            u = r.float64() or _TINY
            return max(int(lam_w * _pow(-go_log(u), inv_k)), 1)
        return weibull
    return poisson_sampler(lam)


def poisson_sampler(rate_per_us: float) -> Sampler:
    lam = max(rate_per_us, MIN_RATE_PER_US)
    return lambda r: max(int(r.exp_float64() / lam), 1)


def normalized_exponential(sub: GoRand, count: int, duration_us: int) -> Sampler:
    """inference-perf's sampler: `count` intervals drawn now from `sub`, rescaled to sum to
    about `duration_us`; each call returns the next (drawing nothing), then 0 (exhausted)."""
    rate = count / duration_us if duration_us else 0.0
    raw = [sub.exp_float64() / rate for _ in range(count)] if count else []
    total = 0.0
    for x in raw:
        total += x
    f = duration_us / total if total else 0.0
    intervals = iter([max(int(x * f), 1) for x in raw])
    return lambda r: next(intervals, 0)
