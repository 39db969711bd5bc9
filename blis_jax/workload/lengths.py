"""Token-length distributions of the workload spec (spec §4.5): integer tokens, at least 1.

* `gaussian {mean, std_dev, [min], [max]}`: round(clamp(N(mean, std), min, max)) — clamping,
  not resampling, so the bounds carry point masses; min == max or std 0 is a constant.
* `exponential {mean, [min], [max]}`: round(Exp(1)·mean), then the bounds.
* `lognormal {mu, sigma, [min], [max]}`: round(exp(μ + σz)), then the bounds.
* `pareto_lognormal {alpha, xm, mu, sigma, mix_weight}`: with probability mix_weight a Pareto
  xm/u^{1/α}, else exp(μ + σz); rounded.
* `empirical {"<tokens>": prob, ...}` (or `file:` naming a YAML/JSON mapping of the same):
  normalised inverse CDF over the keys sorted by token count.
* `constant {value}`.

Rounding is Go's math.Round (half away from zero). Every sampler is keyed (see
`arrivals.py`): the value of request `idx[i]` comes from stream `key` at that index, so samples
never depend on how many were drawn or in which order. `sample_continuous` returns the values before rounding and bounds, for tests.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.workload.arrivals import keyed_normal, keyed_uniform

LENGTH_TYPES = ("gaussian", "exponential", "lognormal", "pareto_lognormal", "empirical", "constant")
# type → (required params, optional params); empirical takes token counts as keys instead.
LENGTH_PARAMS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gaussian": (("mean", "std_dev"), ("min", "max")),
    "exponential": (("mean",), ("min", "max")),
    "lognormal": (("mu", "sigma"), ("min", "max")),
    "pareto_lognormal": (("alpha", "xm", "mu", "sigma", "mix_weight"), ()),
    "constant": (("value",), ()),
}
_MAX_TOKENS = float(2**53)   # above float64 integer precision a "token count" is meaningless


def go_round(x: np.ndarray) -> np.ndarray:
    """Go's math.Round: half away from zero."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _finish(x: np.ndarray, lo: float, hi: float, floor_at: int = 1) -> np.ndarray:
    """round, then clamp to [lo, hi], then at least `floor_at` → int64."""
    r = np.clip(go_round(np.clip(x, -_MAX_TOKENS, _MAX_TOKENS)), lo, hi)
    return np.maximum(r, floor_at).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LengthDistribution(abc.ABC):
    """Base of the samplers: `sample(key, idx)` → int64 tokens (≥ `floor_at`)."""

    @abc.abstractmethod
    def sample_continuous(self, key: jax.Array, idx) -> np.ndarray:
        """Values of requests `idx` before rounding and bounds (float64)."""

    @abc.abstractmethod
    def sample(self, key: jax.Array, idx, floor_at: int = 1) -> np.ndarray:
        """Integer token counts of requests `idx` (≥ `floor_at`)."""


@dataclasses.dataclass(frozen=True)
class Gaussian(LengthDistribution):
    mean: float
    std: float
    min: float = 1.0
    max: float = math.inf

    def sample_continuous(self, key, idx):
        return keyed_normal(key, idx) * self.std + self.mean

    def sample(self, key, idx, floor_at=1):
        if self.std == 0 or self.min == self.max:
            return _finish(np.full(np.shape(idx), self.mean if self.min != self.max else self.min), self.min, self.max,
                           floor_at)
        # Clamp first, then round (BLIS), which only differs from round-then-clamp at
        # non-integer bounds.
        c = np.clip(self.sample_continuous(key, idx), self.min, self.max)
        return _finish(c, -math.inf, math.inf, floor_at)


@dataclasses.dataclass(frozen=True)
class Exponential(LengthDistribution):
    mean: float
    min: float = 1.0
    max: float = math.inf

    def sample_continuous(self, key, idx):
        return -np.log(keyed_uniform(key, idx)) * self.mean

    def sample(self, key, idx, floor_at=1):
        return _finish(self.sample_continuous(key, idx), self.min, self.max, floor_at)


@dataclasses.dataclass(frozen=True)
class Lognormal(LengthDistribution):
    mu: float
    sigma: float
    min: float = 1.0
    max: float = math.inf

    def sample_continuous(self, key, idx):
        return np.exp(np.minimum(self.mu + self.sigma * keyed_normal(key, idx), 700.0))

    def sample(self, key, idx, floor_at=1):
        return _finish(self.sample_continuous(key, idx), self.min, self.max, floor_at)


@dataclasses.dataclass(frozen=True)
class ParetoLognormal(LengthDistribution):
    alpha: float
    xm: float
    mu: float
    sigma: float
    mix_weight: float

    def sample_continuous(self, key, idx):
        choose = keyed_uniform(key, idx, draw=0) <= self.mix_weight
        pareto = self.xm / keyed_uniform(key, idx, draw=1) ** (1.0 / self.alpha)
        logn = np.exp(np.minimum(self.mu + self.sigma * keyed_normal(key, idx, draw=2), 700.0))
        return np.where(choose, pareto, logn)

    def sample(self, key, idx, floor_at=1):
        return _finish(self.sample_continuous(key, idx), -math.inf, math.inf, floor_at)


@dataclasses.dataclass(frozen=True)
class Empirical(LengthDistribution):
    values: tuple[int, ...]        # sorted ascending
    cdf: tuple[float, ...]         # normalised cumulative probabilities, last == 1

    def sample_continuous(self, key, idx):
        u = keyed_uniform(key, idx)
        idx = np.searchsorted(np.asarray(self.cdf), 1.0 - u, side="right")
        return np.asarray(self.values, dtype=np.float64)[np.minimum(idx, len(self.values) - 1)]

    def sample(self, key, idx, floor_at=1):
        return _finish(self.sample_continuous(key, idx), -math.inf, math.inf, floor_at)

    @property
    def probabilities(self) -> np.ndarray:
        return np.diff(np.concatenate([[0.0], np.asarray(self.cdf)]))


@dataclasses.dataclass(frozen=True)
class Constant(LengthDistribution):
    value: float

    def sample_continuous(self, key, idx):
        return np.full(np.shape(idx), float(self.value))

    def sample(self, key, idx, floor_at=1):
        return _finish(np.full(np.shape(idx), float(self.value)), -math.inf, math.inf, floor_at)


# ------------------------------------------------------------------------------ building


def make_length(dist_type: str, params: Mapping[str, float], path: str) -> LengthDistribution:
    """Validate `params` for `dist_type` and build the sampler; errors name `path`.params.KEY."""
    if dist_type not in LENGTH_TYPES:
        raise ConfigError(f"{path}.type: {dist_type!r} is not a length distribution; use one of "
                          f"{', '.join(LENGTH_TYPES)}")
    if dist_type == "empirical":
        return _make_empirical(params, path)
    required, optional = LENGTH_PARAMS[dist_type]
    for key in params:
        if key not in required and key not in optional:
            raise ConfigError(f"{path}.params.{key}: unknown parameter for {dist_type}; it takes "
                              f"{', '.join(required + optional)}")
    for key in required:
        if key not in params:
            raise ConfigError(f"{path}.params.{key}: missing; {dist_type} needs {', '.join(required)}")
    p = {k: float(v) for k, v in params.items()}
    for key, value in p.items():
        if not math.isfinite(value):
            raise ConfigError(f"{path}.params.{key}: {value} must be a finite number")

    def nonneg(*keys: str) -> None:
        for k in keys:
            if k in p and p[k] < 0:
                raise ConfigError(f"{path}.params.{k}: {p[k]} must be ≥ 0")

    def positive(*keys: str) -> None:
        for k in keys:
            if p[k] <= 0:
                raise ConfigError(f"{path}.params.{k}: {p[k]} must be > 0")

    lo, hi = p.get("min", 1.0), p.get("max", math.inf)
    nonneg("min", "max")
    if lo > hi:
        raise ConfigError(f"{path}.params.min: {lo} > max {hi}; raise max or lower min")
    if dist_type == "gaussian":
        nonneg("std_dev")
        return Gaussian(p["mean"], p["std_dev"], lo, hi)
    if dist_type == "exponential":
        positive("mean")
        return Exponential(p["mean"], lo, hi)
    if dist_type == "lognormal":
        nonneg("sigma")
        return Lognormal(p["mu"], p["sigma"], lo, hi)
    if dist_type == "pareto_lognormal":
        positive("alpha", "xm")
        nonneg("sigma")
        if not 0 <= p["mix_weight"] <= 1:
            raise ConfigError(f"{path}.params.mix_weight: {p['mix_weight']} must be a probability in [0, 1]")
        return ParetoLognormal(p["alpha"], p["xm"], p["mu"], p["sigma"], p["mix_weight"])
    nonneg("value")
    return Constant(p["value"])


def _make_empirical(params: Mapping[str, float], path: str) -> Empirical:
    if not params:
        raise ConfigError(f"{path}.params: empty; empirical needs {{\"<tokens>\": probability, ...}}")
    pairs: dict[int, float] = {}
    for key, prob in params.items():
        try:
            tokens = float(str(key))
        except ValueError:
            tokens = math.nan
        if not math.isfinite(tokens) or tokens < 0 or tokens != int(tokens):
            raise ConfigError(f"{path}.params.{key}: the key must be a token count (an integer ≥ 0)")
        prob = float(prob)
        if not math.isfinite(prob) or prob < 0:
            raise ConfigError(f"{path}.params.{key}: probability {prob} must be a finite number ≥ 0")
        pairs[int(tokens)] = pairs.get(int(tokens), 0.0) + prob
    total = sum(pairs.values())
    if total <= 0:
        raise ConfigError(f"{path}.params: probabilities sum to 0; give at least one positive weight")
    values = tuple(sorted(pairs))
    cdf = np.cumsum([pairs[v] / total for v in values])
    cdf[-1] = 1.0
    return Empirical(values, tuple(float(c) for c in cdf))
