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

Admission does not read engine state for these three policies, so a request set's decisions
follow from its arrival times and prompt lengths alone.
"""

from __future__ import annotations

import abc
import dataclasses
import math

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int64

from blis_jax.cluster._numerics import exact_div
from blis_jax.errors import ConfigError

ADMISSION_POLICIES = ("always-admit", "token-bucket", "reject-all")


class AbstractAdmission(eqx.Module):
    """An admission policy: `admit(now_us, input_len) -> (policy, admitted)`, pure."""

    @abc.abstractmethod
    def admit(
        self, now_us: Int64[Array, ""], input_len: Int64[Array, ""]
    ) -> tuple[AbstractAdmission, Bool[Array, ""]]:
        """Decide one request at `now_us`; returns the updated policy state."""


class AlwaysAdmit(AbstractAdmission):
    def admit(self, now_us, input_len):
        del now_us, input_len
        return self, jnp.asarray(True)


class RejectAll(AbstractAdmission):
    def admit(self, now_us, input_len):
        del now_us, input_len
        return self, jnp.asarray(False)


class TokenBucket(AbstractAdmission):
    capacity: Float64[Array, ""]  # tokens
    refill_rate: Float64[Array, ""]  # tokens per second
    tokens: Float64[Array, ""]  # current level (float64, as BLIS)
    last_refill_us: Int64[Array, ""]  # µs of the last refill (0 at construction)

    def admit(self, now_us, input_len):
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


def make_admission(
    policy: str = "always-admit", *, token_bucket_capacity: float = 10_000,
    token_bucket_refill_rate: float = 1_000,
) -> AbstractAdmission:
    """Admission policy from BLIS's `--admission-policy` name and token-bucket flags."""
    if policy == "always-admit":
        return AlwaysAdmit()
    if policy == "reject-all":
        return RejectAll()
    if policy == "token-bucket":
        return token_bucket(token_bucket_capacity, token_bucket_refill_rate)
    raise ConfigError(
        f"--admission-policy {policy!r} is not supported; use one of {', '.join(ADMISSION_POLICIES)}"
        " (tier-shed and gaie-legacy are not implemented yet)"
    )


def admit(
    policy: AbstractAdmission, now_us: Int64[Array, ""], input_len: Int64[Array, ""]
) -> tuple[AbstractAdmission, Bool[Array, ""]]:
    """Decide one request arriving at the admission stage at `now_us` with `input_len`
    prompt tokens (shared prefix included). Returns the new policy state and the decision."""
    return policy.admit(now_us, input_len)
