"""Arrival processes of the workload spec (spec §4.4) and the keyed variates they draw from.

Every random number in the workload layer is *keyed*: variate i of a stream is drawn from
`fold_in(fold_in(stream_key, i), draw)`, never from a sequential generator. So a request's
draws depend only on (seed, client, stream, request index) — generating more requests, or
generating them in other chunk sizes, cannot change earlier ones. `lengths.py` shares the
primitives below.

Inter-arrival times (IATs) are integer µs, at least 1. Rates are req/s; λ = rate/10⁶ per µs,
floored at 10⁻¹⁵ as in BLIS.

* `poisson`:  ⌊Exp(1)/λ⌋
* `constant`: ⌊1/λ⌋ every time (computed through λ, exactly as the CLI workload)
* `gamma`:    explicit `shape`/`scale` (µs) when both > 0 — the rate is then ignored — else
  shape = 1/CV², scale = CV²/λ; shape < 0.01 falls back to Poisson. Marsaglia–Tsang sampling
  on keyed normals and uniforms (`keyed_gamma`), with the u^{1/α} boost for α < 1.
* `weibull`:  explicit shape/scale, or k from CV by bisection on
  CV(k) = √(Γ(1+2/k)/Γ(1+1/k)² − 1) over [0.1, 100] (tolerance 10⁻³), scale = (1/λ)/Γ(1+1/k);
  sample scale·(−ln u)^{1/k}.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.workload.distribution import constant_iat_us

ARRIVAL_PROCESSES = ("poisson", "gamma", "weibull", "constant")
WEIBULL_CV_RANGE = (0.01, 10.4)
WEIBULL_SHAPE_BRACKET = (0.1, 100.0)
WEIBULL_SHAPE_TOL = 1e-3
GAMMA_MIN_SHAPE = 0.01     # below this, gamma falls back to Poisson
_MIN_RATE_PER_US = 1e-15

# ------------------------------------------------------------------------ keyed variates

# Every draw goes through a compiled block of one of two sizes (larger requests loop over big
# blocks, smaller ones are padded): two compilations per process, cheap small calls (a cohort
# member draws a handful of values), and padding cannot influence the real values because each
# is keyed by its own index.
_BLOCK = 8192
_SMALL_BLOCK = 512
_GAMMA_BOOST_DRAW = 0xFFFF   # the u^{1/α} boost of α < 1 uses its own sub-draw


@jax.jit
def _block_draws(key: jax.Array, ids: jax.Array, draw: jax.Array) -> tuple[jax.Array, jax.Array]:
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(key, i), draw))(ids)
    # 1 − U[0,1) lies in (0, 1]: safe for log and for negative powers.
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float64))(keys)
    z = jax.vmap(lambda k: jax.random.normal(k, dtype=jnp.float64))(keys)
    return u, z


@dataclasses.dataclass(frozen=True, eq=False)
class KeyColumn:
    """One stream key per element, held as raw key data on the host, so that many streams
    (e.g. every round of every session of a client) are drawn in one call: `fold` and the
    keyed draws accept it in place of a single key and give each element exactly the value
    its own key would."""

    data: np.ndarray  # uint32 [n, *key data shape]
    impl: str  # the keys' PRNG implementation (jax.random.key_impl)

    @staticmethod
    def of(keys) -> KeyColumn:
        keys = list(keys)
        return KeyColumn(np.stack([np.asarray(jax.random.key_data(k)) for k in keys]),
                         str(jax.random.key_impl(keys[0])))

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, rows) -> KeyColumn:
        return KeyColumn(self.data[rows], self.impl)


def _blocks(values: np.ndarray):
    """(start, real size, block of `values` zero-padded to a block size) covering `values`:
    fixed block shapes, so few compilations (padding values are dropped by the caller)."""
    for lo in range(0, values.shape[0], _BLOCK):
        size = min(_BLOCK, values.shape[0] - lo)
        block = np.zeros((_SMALL_BLOCK if size <= _SMALL_BLOCK else _BLOCK, *values.shape[1:]), np.uint32)
        block[:size] = values[lo:lo + size]
        yield lo, size, block


@functools.partial(jax.jit, static_argnames="impl")
def _block_draws_each(data: jax.Array, ids: jax.Array, draw: jax.Array, impl: str):
    """`_block_draws` with one stream key per element (the same values element by element)."""
    keys = jax.random.wrap_key_data(data, impl=impl)
    keys = jax.vmap(lambda k, i: jax.random.fold_in(jax.random.fold_in(k, i), draw))(keys, ids)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float64))(keys)
    z = jax.vmap(lambda k: jax.random.normal(k, dtype=jnp.float64))(keys)
    return u, z


@functools.partial(jax.jit, static_argnames="impl")
def _fold_each(data: jax.Array, values: jax.Array, impl: str) -> jax.Array:
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(data, impl=impl), values)
    return jax.random.key_data(keys)


def _draws(key, idx, draw: int, which: int) -> np.ndarray:
    """Variate `which` (0 uniform, 1 normal) of elements `idx`, from one stream key or a
    `KeyColumn` as long as `idx`."""
    arr = np.asarray(idx, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        return np.zeros(0, dtype=np.float64)
    if arr.min() < 0 or arr.max() >= 2**32:
        raise ConfigError(f"keyed draw: request index {int(arr.max())} outside the 32-bit index space; "
                          "generate fewer requests per client")
    column = isinstance(key, KeyColumn)
    if column and len(key) != arr.size:
        raise ValueError(f"keyed draw: {len(key)} stream keys for {arr.size} elements")
    key_blocks = _blocks(key.data) if column else None
    out = np.empty(arr.size, dtype=np.float64)
    for lo, size, ids in _blocks(arr):
        if column:
            values = _block_draws_each(next(key_blocks)[2], ids, jnp.uint32(draw), impl=key.impl)[which]
        else:
            values = _block_draws(key, jnp.asarray(ids), jnp.uint32(draw))[which]
        out[lo:lo + size] = np.asarray(values)[:size]
    return out


_fold_in = jax.jit(jax.random.fold_in)


def fold(key, data):
    """`jax.random.fold_in(key, data)` through a compiled call (eager fold_in costs ~0.3 ms).
    A `KeyColumn` folds each of its keys with `data` (a scalar, or one value per key)."""
    if not isinstance(key, KeyColumn):
        return _fold_in(key, np.uint32(data))
    values = np.broadcast_to(np.asarray(data, np.uint32), (len(key),))
    out = np.empty_like(key.data)
    for (lo, size, block), (_, _, padded) in zip(_blocks(key.data), _blocks(values)):
        out[lo:lo + size] = np.asarray(_fold_each(block, padded, impl=key.impl))[:size]
    return KeyColumn(out, key.impl)


def keyed_uniform(key: jax.Array, idx, draw: int = 0) -> np.ndarray:
    """Uniforms in (0, 1]: element i from `fold_in(fold_in(key, idx[i]), draw)`."""
    return _draws(key, idx, draw, 0)


def keyed_normal(key: jax.Array, idx, draw: int = 0) -> np.ndarray:
    """Standard normals, keyed like `keyed_uniform`."""
    return _draws(key, idx, draw, 1)


def keyed_gamma(key: jax.Array, idx, alpha: float, draw: int = 0) -> np.ndarray:
    """Standard Gamma(alpha, 1) variates by Marsaglia–Tsang, keyed like `keyed_uniform`.

    Attempt j of element i uses sub-draws (draw·2¹⁶ + 2j) for the normal and (… + 2j + 1) for
    the uniform, so an element's value never depends on which others were rejected. α < 1
    samples Gamma(α+1) and multiplies by u^{1/α}.
    """
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    a = alpha + 1.0 if alpha < 1.0 else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = np.empty(idx.size, dtype=np.float64)
    pending = np.arange(idx.size)
    base = draw << 16
    attempt = 0
    while pending.size:
        if 2 * attempt + 1 >= _GAMMA_BOOST_DRAW:
            raise AssertionError("Marsaglia–Tsang did not accept after 32k attempts")
        k = key[pending] if isinstance(key, KeyColumn) else key
        z = keyed_normal(k, idx[pending], base + 2 * attempt)
        u = keyed_uniform(k, idx[pending], base + 2 * attempt + 1)
        v = (1.0 + c * z) ** 3
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = (v > 0) & (np.log(u) < 0.5 * z * z + d - d * v + d * np.log(np.where(v > 0, v, 1.0)))
        out[pending[ok]] = d * v[ok]
        pending = pending[~ok]
        attempt += 1
    if alpha < 1.0:
        out *= keyed_uniform(key, idx, base + _GAMMA_BOOST_DRAW) ** (1.0 / alpha)
    return out


def index_range(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


# ----------------------------------------------------------------------------- Weibull


def weibull_cv(shape: float) -> float:
    """Coefficient of variation of a Weibull distribution with shape k."""
    g1 = math.lgamma(1.0 + 1.0 / shape)
    g2 = math.lgamma(1.0 + 2.0 / shape)
    return math.sqrt(max(math.exp(g2 - 2.0 * g1) - 1.0, 0.0))


def weibull_shape_for_cv(cv: float) -> float:
    """Shape k with CV(k) = cv, by bisection over [0.1, 100] to a width of 10⁻³ (BLIS)."""
    lo, hi = WEIBULL_SHAPE_BRACKET
    while hi - lo > WEIBULL_SHAPE_TOL:
        mid = 0.5 * (lo + hi)
        if weibull_cv(mid) > cv:   # CV falls as k grows
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------- the processes


@dataclasses.dataclass(frozen=True)
class ArrivalProcess:
    """A resolved arrival process: kind plus its numbers in µs.

    `kind` is the sampling law actually used (a gamma with shape < 0.01 is `poisson`).
    `shape`/`scale_us` parametrise gamma and Weibull; `mean_iat_us` is the continuous mean.
    """

    kind: str
    mean_iat_us: float
    shape: float = 1.0
    scale_us: float = 0.0

    def continuous_iats(self, key: jax.Array, idx) -> np.ndarray:
        """IATs (µs, float64, before flooring) of the arrivals with indices `idx`."""
        idx = np.asarray(idx, dtype=np.int64)
        if self.kind == "constant":
            return np.full(idx.shape, self.mean_iat_us, dtype=np.float64)
        if self.kind == "poisson":
            return -np.log(keyed_uniform(key, idx)) * self.mean_iat_us
        if self.kind == "gamma":
            return keyed_gamma(key, idx, self.shape) * self.scale_us
        if self.kind == "weibull":
            return self.scale_us * (-np.log(keyed_uniform(key, idx))) ** (1.0 / self.shape)
        raise AssertionError(self.kind)

    def iats_us(self, key: jax.Array, idx) -> np.ndarray:
        """Integer IATs (µs, ≥ 1) of the arrivals with indices `idx`."""
        idx = np.asarray(idx, dtype=np.int64)
        if self.kind == "constant":
            return np.full(idx.shape, max(1, int(self.mean_iat_us)), dtype=np.int64)
        x = np.floor(self.continuous_iats(key, idx))
        return np.maximum(np.minimum(x, 2.0**62), 1.0).astype(np.int64)


def rate_per_us(rate: float) -> float:
    return max(rate / 1e6, _MIN_RATE_PER_US)


def check_arrival(process: str, cv: float | None, shape: float | None, scale: float | None, path: str) -> None:
    """Raise ConfigError (naming `path`.key) for an impossible arrival spec."""
    if process not in ARRIVAL_PROCESSES:
        raise ConfigError(f"{path}.process: {process!r} is not an arrival process; use one of "
                          f"{', '.join(ARRIVAL_PROCESSES)}")
    for name, value in (("cv", cv), ("shape", shape), ("scale", scale)):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ConfigError(f"{path}.{name}: {value!r} must be a finite number ≥ 0")
    if cv is not None and cv == 0 and process in ("gamma", "weibull"):
        raise ConfigError(f"{path}.cv: 0 is not a valid coefficient of variation; use cv > 0, or "
                          "process: constant for evenly spaced arrivals")
    explicit = (shape or 0) > 0 and (scale or 0) > 0
    if process == "weibull" and not explicit:
        c = 1.0 if cv is None else cv
        lo, hi = WEIBULL_CV_RANGE
        if not lo <= c <= hi:
            raise ConfigError(f"{path}.cv: {c} must be in [{lo}, {hi}] for weibull (the shape bisection "
                              "only reaches that range); or give both shape and scale")


def make_arrival(process: str, rate: float, *, cv: float | None = None, shape: float | None = None,
                 scale: float | None = None, path: str = "arrival") -> ArrivalProcess:
    """Resolve a spec arrival (`process`, `cv`, `shape`, `scale` µs) at `rate` req/s."""
    check_arrival(process, cv, shape, scale, path)
    mean = 1.0 / rate_per_us(rate)
    explicit = (shape or 0) > 0 and (scale or 0) > 0
    if process == "constant":
        return ArrivalProcess("constant", float(constant_iat_us(rate)))
    if process == "poisson":
        return ArrivalProcess("poisson", mean)
    if process == "gamma":
        if explicit:
            k, theta = float(shape), float(scale)
        else:
            c2 = (1.0 if cv is None else cv) ** 2
            k, theta = 1.0 / c2, c2 * mean
        if k < GAMMA_MIN_SHAPE:
            return ArrivalProcess("poisson", mean)
        return ArrivalProcess("gamma", k * theta, shape=k, scale_us=theta)
    # weibull
    if explicit:
        k, lam = float(shape), float(scale)
    else:
        k = weibull_shape_for_cv(1.0 if cv is None else cv)
        lam = mean / math.gamma(1.0 + 1.0 / k)
    return ArrivalProcess("weibull", lam * math.gamma(1.0 + 1.0 / k), shape=k, scale_us=lam)


def normalized_arrivals_us(process: ArrivalProcess, key: jax.Array, count: int, start_us: int,
                           duration_us: int) -> np.ndarray:
    """`count` arrivals whose sampled IATs are rescaled to span [start, start+duration] exactly.

    Used for per-window generation (spec §4.6) and inference-perf's normalized-exponential
    sampler (§4.4): the last arrival lands on the window end.
    """
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    iats = np.maximum(process.continuous_iats(key, index_range(0, count)), 1e-9)
    cum = np.cumsum(iats)
    offsets = np.floor(cum * (duration_us / cum[-1]))
    return start_us + np.minimum(offsets, duration_us).astype(np.int64)
