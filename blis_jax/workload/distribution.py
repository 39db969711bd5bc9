"""CLI distribution workload (`blis run --workload distribution`, spec §4.1–4.2, §4.5).

BLIS synthesises one client with *constant* arrivals at `--rate` (IAT = ⌊1/λ⌋ µs with
λ = rate/10⁶, first arrival at one IAT) and clamped-Gaussian prompt/output lengths. The
lengths come from BLIS's Go `math/rand` streams (`distribution_spec` → the BLIS-exact
generator, blis-rng.md §4.1): `--seed` gives the requests `blis run --seed` gives.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.naming import name
from blis_jax.workload.requests import RequestSet


DEFAULT_TIMEOUT_S = 300.0
SHARED_PREFIX_GROUP = "shared"
DISTRIBUTION_CLIENT = "distribution"
# Guard against a horizon-only workload that would allocate an absurd number of rows.
MAX_GENERATED_REQUESTS = 50_000_000
_MIN_RATE_PER_US = 1e-15  # BLIS floors λ here before dividing


@dataclasses.dataclass(frozen=True)
class GaussianLength:
    """round(clamp(N(mean, std), min, max)) tokens, at least 1 (spec §4.5)."""

    mean: float
    std: float
    min: int
    max: int

    def check(self, flag: str) -> None:
        """Raise ConfigError naming the CLI flag (`--prompt-tokens`, ...) of a bad figure."""
        if not math.isfinite(self.mean):
            raise ConfigError(f"{flag}: mean {self.mean} is not a finite number")
        if not math.isfinite(self.std) or self.std < 0:
            raise ConfigError(f"{flag}-stdev: {self.std} must be a finite number ≥ 0")
        for suffix, value in (("-min", self.min), ("-max", self.max)):
            if isinstance(value, bool) or not float(value).is_integer():
                raise ConfigError(f"{flag}{suffix}: {value} must be an integer token count")
        if self.min < 1:
            raise ConfigError(f"{flag}-min: {self.min} must be ≥ 1 (a request needs at least one token)")
        if self.min > self.max:
            raise ConfigError(f"{flag}-min {self.min} > {flag}-max {self.max}; raise the max or lower the min")


PROMPT_DEFAULT = GaussianLength(mean=512, std=256, min=2, max=7000)
OUTPUT_DEFAULT = GaussianLength(mean=512, std=256, min=2, max=7000)


@dataclasses.dataclass(frozen=True)
class DistributionWorkload:
    """The `run` flags that define a synthetic workload (BLIS defaults).

    `num_requests` 0 means "bounded by the horizon only". `timeout_s` < 0 disables client
    timeouts; 0 is rejected as in BLIS. `horizon_us` drops arrivals after it.
    """

    rate: float = 1.0
    num_requests: int = 100
    prompt: GaussianLength = PROMPT_DEFAULT
    output: GaussianLength = OUTPUT_DEFAULT
    prefix_tokens: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    horizon_us: int | None = None
    client_id: str = DISTRIBUTION_CLIENT

    def __post_init__(self) -> None:
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) \
                or not math.isfinite(self.rate) or self.rate <= 0:
            raise ConfigError(f"{name('workload.rate')}: {self.rate!r} must be a finite number of requests/s > 0")
        _check_int(name("workload.num_requests"), self.num_requests, minimum=0)
        _check_int(name("workload.prefix_tokens"), self.prefix_tokens, minimum=0)
        if self.horizon_us is not None:
            _check_int(name("horizon_us"), self.horizon_us, minimum=1)
        if self.num_requests == 0 and self.horizon_us is None:
            raise ConfigError(f"{name('workload.num_requests')} is 0 and no {name('horizon_us')} is set; give at "
                              "least one bound")
        if not isinstance(self.timeout_s, (int, float)) or math.isnan(self.timeout_s) or self.timeout_s == 0:
            raise ConfigError(f"{name('workload.timeout_s')}: {self.timeout_s!r} s is invalid; use seconds > 0, or "
                              "< 0 to disable")
        self.prompt.check(name("workload.prompt"))
        self.output.check(name("workload.output"))


def constant_iat_us(rate: float) -> int:
    """BLIS constant inter-arrival time: ⌊1/λ⌋ µs with λ = rate/10⁶, at least 1.

    Computed through λ exactly as Go does, not as ⌊10⁶/rate⌋: for rate 10 the float
    reciprocal is 99999.99… and BLIS traces show IAT 99999.
    """
    lam = max(rate / 1e6, _MIN_RATE_PER_US)
    return max(1, int(1.0 / lam))


def arrival_times_us(rate: float, num_requests: int, horizon_us: int | None = None) -> np.ndarray:
    """Arrivals k·IAT for k = 1..n, cut at `num_requests` (0 = no cap) and at the horizon."""
    iat = constant_iat_us(rate)
    n = num_requests
    if horizon_us is not None:
        # BLIS's generator stops at the first arrival at or past the horizon (blis-rng §5.3).
        by_horizon = (horizon_us - 1) // iat
        n = by_horizon if n == 0 else min(n, by_horizon)
    if n > MAX_GENERATED_REQUESTS:
        raise ConfigError(f"--horizon: {n} requests would be generated (limit {MAX_GENERATED_REQUESTS}); "
                          "set --num-requests or a shorter horizon")
    return np.arange(1, n + 1, dtype=np.int64) * np.int64(iat)


def generate_distribution(workload: DistributionWorkload, seed: int) -> RequestSet:
    """Synthesise the workload; same (workload, seed) → identical arrays (the same immutable
    request set: a sweep's scenarios that differ only in engine settings share it)."""
    return _generate_distribution(workload, int(seed))


def distribution_spec(workload: DistributionWorkload):
    """BLIS's synthesized spec of the flags (blis-rng.md §4.1): one client with constant
    arrivals at `rate` and clamped Gaussian lengths (prefix group "shared" with --prefix-tokens)."""
    from types import MappingProxyType

    from blis_jax.workload.spec import ArrivalSpec, ClientSpec, DistSpec, WorkloadSpec

    def gaussian(d: GaussianLength) -> DistSpec:
        return DistSpec("gaussian", MappingProxyType({"mean": float(d.mean), "std_dev": float(d.std),
                                                      "min": float(d.min), "max": float(d.max)}))

    grouped = workload.prefix_tokens > 0
    client = ClientSpec(id=workload.client_id, rate_fraction=1.0, arrival=ArrivalSpec("constant"),
                        input_distribution=gaussian(workload.prompt), output_distribution=gaussian(workload.output),
                        prefix_group=SHARED_PREFIX_GROUP if grouped else "",
                        prefix_length=workload.prefix_tokens if grouped else None)
    return WorkloadSpec(aggregate_rate=float(workload.rate), num_requests=workload.num_requests, clients=(client,))


@functools.lru_cache(maxsize=64)
def _generate_distribution(workload: DistributionWorkload, seed: int) -> RequestSet:
    from blis_jax.workload.generate import generate_workload

    arrival_times_us(workload.rate, workload.num_requests, workload.horizon_us)   # size guard
    return generate_workload(distribution_spec(workload), seed, num_requests=workload.num_requests,
                             horizon_us=workload.horizon_us, timeout_s=workload.timeout_s, synthesized=True).requests


def _check_int(flag: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{flag}: {value!r} must be an integer")
    if value < minimum:
        raise ConfigError(f"{flag}: {value} must be ≥ {minimum}")
