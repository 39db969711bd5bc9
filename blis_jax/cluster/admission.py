"""Cluster admission policies (blis-features §3.3).

An admission decision happens at `arrival + admission_latency`, once per request, in arrival
order (same-tick arrivals in push order). Each policy is an `eqx.Module` whose numbers are
arrays (changing a capacity or a rate never recompiles) and whose `admit` is pure:

    policy, admitted = admit(policy, now_us, input_len)

* `always-admit` (BLIS default): admit.
* `reject-all`: reject.
* `token-bucket`: the bucket starts full (`capacity` tokens, last refill at t = 0). At each
  decision: `elapsed = now - last_refill`; if `elapsed > 0` the bucket gains
  `elapsed * rate / 1e6` tokens (float64, capped at `capacity`) and `last_refill = now`. The
  request costs its input length (prompt tokens including any shared prefix); it is admitted
  iff `tokens >= cost`, and only an admitted request is charged. Units: capacity in tokens,
  rate in tokens per second (`--token-bucket-capacity 10000`, `--token-bucket-refill-rate
  1000`).

The first three do not read engine state, so a request set's decisions follow from its
arrival times and prompt lengths alone. Two policies read the cluster's load through a
RouterState built at the admission time (the stale snapshot, refreshed by that build as a
routing build refreshes it, and the always-current in-flight counts); their
`reads_state` is True and the cluster loop then runs each admission as its own event:

* `tier-shed`: maxLoad = the largest EffectiveLoad (queue depth + batch size + in flight) over
  the routable instances (0 when none). Admit iff maxLoad <= `threshold` (default 0) or the
  request's priority >= `min_priority` (default 0, BLIS's value when the policy is chosen with
  --admission-policy), so by default batch, sheddable and background requests are shed as soon
  as any instance holds a request.
* `gaie-legacy`: requests of priority >= 0 are always admitted; a sheddable one (priority < 0)
  is rejected iff the pool saturation >= 1, saturation = the mean over routable instances of
  max(queue depth / `qd_threshold`, KV utilization / `kv_threshold`) (defaults 5 and 0.8;
  1 when no instance is routable).

Priorities are the cluster (GAIE) convention, higher = more important: critical 4, standard 3
(also empty or unknown), batch -1, sheddable -2, background -3 (`cluster_priority`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int64

from blis_jax.cluster._numerics import exact_div
from blis_jax.cluster.signals import RouterState, effective_load
from blis_jax.errors import ConfigError

ADMISSION_POLICIES = ("always-admit", "token-bucket", "reject-all", "tier-shed", "gaie-legacy")
# The instance (vLLM) priority of a class is MAX_CLUSTER_PRIORITY - its cluster priority.
MAX_CLUSTER_PRIORITY = 4


def cluster_priority(instance_priority):
    """GAIE convention (higher = more important) from the instance convention (lower = more
    urgent): critical 0 -> 4, standard 1 -> 3, batch 5 -> -1, sheddable 6 -> -2, background 7 -> -3."""
    return MAX_CLUSTER_PRIORITY - instance_priority


class AbstractAdmission(eqx.Module):
    """An admission policy: `admit(now_us, input_len, priority, rs) -> (policy, admitted)`,
    pure. `priority` (cluster convention) and `rs` (the RouterState at `now_us`) are read only
    by policies whose `reads_state` is True; the others accept None for both."""

    reads_state: ClassVar[bool] = False

    @abc.abstractmethod
    def admit(
        self, now_us: Int64[Array, ""], input_len: Int64[Array, ""], priority=None, rs: RouterState | None = None
    ) -> tuple[AbstractAdmission, Bool[Array, ""]]:
        """Decide one request at `now_us`; returns the updated policy state."""


class AlwaysAdmit(AbstractAdmission):
    def admit(self, now_us, input_len, priority=None, rs=None):
        del now_us, input_len, priority, rs
        return self, jnp.asarray(True)


class RejectAll(AbstractAdmission):
    def admit(self, now_us, input_len, priority=None, rs=None):
        del now_us, input_len, priority, rs
        return self, jnp.asarray(False)


class TierShed(AbstractAdmission):
    threshold: Int64[Array, ""]  # admit everything while the busiest instance's load is <= this
    min_priority: Int64[Array, ""]  # above it, admit only priorities >= this
    reads_state: ClassVar[bool] = True

    def admit(self, now_us, input_len, priority=None, rs=None):
        del now_us, input_len
        max_load = jnp.max(jnp.where(rs.active, effective_load(rs), 0))
        return self, (max_load <= self.threshold) | (jnp.asarray(priority, jnp.int64) >= self.min_priority)


class GaieLegacy(AbstractAdmission):
    qd_threshold: Float64[Array, ""]  # queue depth at which an instance counts as saturated
    kv_threshold: Float64[Array, ""]  # KV utilization likewise
    reads_state: ClassVar[bool] = True

    def admit(self, now_us, input_len, priority=None, rs=None):
        del now_us, input_len
        return self, (jnp.asarray(priority, jnp.int64) >= 0) | (saturation(rs, self.qd_threshold,
                                                                            self.kv_threshold) < 1.0)


def saturation(rs: RouterState, qd_threshold, kv_threshold) -> Float64[Array, ""]:
    """Mean over routable instances of max(QD / qd_threshold, KV utilization / kv_threshold);
    1 when none is routable."""
    qd = exact_div(rs.signals.queue_depth.astype(jnp.float64), qd_threshold)
    kv = exact_div(rs.signals.kv_utilization, kv_threshold)
    n = jnp.sum(rs.active)
    total = jnp.sum(jnp.where(rs.active, jnp.maximum(qd, kv), 0.0))
    return jnp.where(n > 0, exact_div(total, jnp.maximum(n, 1).astype(jnp.float64)), 1.0)


class TokenBucket(AbstractAdmission):
    capacity: Float64[Array, ""]  # tokens
    refill_rate: Float64[Array, ""]  # tokens per second
    tokens: Float64[Array, ""]  # current level (float64, as BLIS)
    last_refill_us: Int64[Array, ""]  # µs of the last refill (0 at construction)

    def admit(self, now_us, input_len, priority=None, rs=None):
        del priority, rs
        now_us = jnp.asarray(now_us, jnp.int64)
        elapsed = now_us - self.last_refill_us
        refilled = elapsed > 0
        # Same operations as BLIS: float64(elapsed) * rate / 1e6 (a true division), then the cap.
        gained = jnp.minimum(self.capacity, self.tokens + exact_div(elapsed.astype(jnp.float64) * self.refill_rate, 1e6))
        tokens = jnp.where(refilled, gained, self.tokens)
        last = jnp.where(refilled, now_us, self.last_refill_us)
        cost = jnp.asarray(input_len, jnp.int64).astype(jnp.float64)
        admitted = tokens >= cost
        tokens = jnp.where(admitted, tokens - cost, tokens)
        return dataclasses.replace(self, tokens=tokens, last_refill_us=last), admitted


def token_bucket(capacity: float = 10_000, refill_rate: float = 1_000) -> TokenBucket:
    """A full bucket at t = 0 (defaults: BLIS's `--token-bucket-capacity 10000`,
    `--token-bucket-refill-rate 1000` tokens/s)."""
    for flag, value, low_ok in (
        ("--token-bucket-capacity", capacity, False),
        ("--token-bucket-refill-rate", refill_rate, True),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value!r}")
        if value < 0 or (value == 0 and not low_ok):
            bound = ">= 0" if low_ok else "> 0"
            raise ConfigError(f"{flag} must be {bound}, got {value!r}")
    cap = jnp.asarray(float(capacity), jnp.float64)
    return TokenBucket(
        capacity=cap,
        refill_rate=jnp.asarray(float(refill_rate), jnp.float64),
        tokens=cap,
        last_refill_us=jnp.asarray(0, jnp.int64),
    )


def tier_shed(threshold: int = 0, min_priority: int = 0) -> TierShed:
    for flag, value in (("--tier-shed-threshold", threshold), ("--tier-shed-min-priority", min_priority)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
    if threshold < 0:
        raise ConfigError(f"--tier-shed-threshold must be >= 0 (requests of load), got {threshold}")
    return TierShed(threshold=jnp.asarray(threshold, jnp.int64), min_priority=jnp.asarray(min_priority, jnp.int64))


def gaie_legacy(qd_threshold: float = 5.0, kv_threshold: float = 0.8) -> GaieLegacy:
    for flag, value in (("--queue-depth-threshold", qd_threshold), ("--kv-cache-util-threshold", kv_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{flag} must be a finite number > 0, got {value!r}")
    return GaieLegacy(qd_threshold=jnp.asarray(float(qd_threshold), jnp.float64),
                      kv_threshold=jnp.asarray(float(kv_threshold), jnp.float64))


def make_admission(
    policy: str = "always-admit", *, token_bucket_capacity: float = 10_000,
    token_bucket_refill_rate: float = 1_000, tier_shed_threshold: int = 0, tier_shed_min_priority: int = 0,
    queue_depth_threshold: float = 5.0, kv_cache_util_threshold: float = 0.8,
) -> AbstractAdmission:
    """Admission policy from BLIS's `--admission-policy` name and its settings' flags."""
    if policy == "always-admit":
        return AlwaysAdmit()
    if policy == "reject-all":
        return RejectAll()
    if policy == "token-bucket":
        return token_bucket(token_bucket_capacity, token_bucket_refill_rate)
    if policy == "tier-shed":
        return tier_shed(tier_shed_threshold, tier_shed_min_priority)
    if policy == "gaie-legacy":
        return gaie_legacy(queue_depth_threshold, kv_cache_util_threshold)
    raise ConfigError(
        f"--admission-policy {policy!r} is not supported; use one of {', '.join(ADMISSION_POLICIES)}"
    )


def admit(
    policy: AbstractAdmission, now_us: Int64[Array, ""], input_len: Int64[Array, ""], priority=None,
    rs: RouterState | None = None,
) -> tuple[AbstractAdmission, Bool[Array, ""]]:
    """Decide one request arriving at the admission stage at `now_us` with `input_len`
    prompt tokens (shared prefix included), cluster `priority` and the RouterState `rs` at
    `now_us` (both read only when `policy.reads_state`). Returns the new policy state and the
    decision."""
    return policy.admit(now_us, input_len, priority, rs)
