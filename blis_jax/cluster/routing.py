"""Routing policies (blis-features §3.5): pick one routable instance slot per request.

All policies see only the routable slots (`RouterState.active`: Active/WarmingUp instances,
model-matching, in the pool being routed); with none routable they return -1 (BLIS counts a
routing rejection) and leave their state unchanged. Targets are int64 slot indices; mask
before indexing with them (-1 would read the last slot).

* `round-robin` (BLIS default): a counter, incremented once per decision, picks the
  (counter mod n)-th routable slot in index order (BLIS: counter mod |snapshots| over the
  filtered snapshot list). One counter per policy object: with PD pools and round-robin, the
  decode and the prefill decisions of a request advance the same counter.
* `least-loaded`: minimum EffectiveLoad; ties broken uniformly at random (router RNG).
* `always-busiest`: maximum EffectiveLoad; the first (lowest index) wins.
* `weighted`: argmax of the weighted scorer sum (scorers.py); ties uniformly at random; the
  stateful scorers then observe the chosen slot.

Random tie-breaks: the cluster loop draws them as BLIS does, `Intn(|tied|)` from the router's
Go `math/rand` stream carried in its state, only when more than one slot ties (`pick_go`,
blis-rng.md §10.1). `pick` with a `jax.random` key draws uniformly among the tied; `key=None`
breaks ties by lowest index (deterministic; not BLIS behaviour, for tests and debugging).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int64, PRNGKeyArray

from blis_jax.cluster import scorers as sc
from blis_jax.cluster.signals import RouterState, effective_load
from blis_jax.errors import ConfigError
from blis_jax.rng.go_jax import GoStream, intn_if

ROUTING_POLICIES = ("round-robin", "least-loaded", "weighted", "always-busiest")


def check_policy(name: str, flag: str = "--routing-policy") -> str:
    if name not in ROUTING_POLICIES:
        raise ConfigError(f"{flag} {name!r} is not supported; use one of {', '.join(ROUTING_POLICIES)}")
    return name


def pick(eligible: Bool[Array, " I"], key: PRNGKeyArray | None = None) -> Int64[Array, ""]:
    """A slot among `eligible`: uniformly at random with `key`, else the lowest index; -1 if none."""
    n = jnp.sum(eligible)
    if key is None:
        k = jnp.asarray(0, jnp.int64)
    else:
        k = jax.random.randint(key, (), 0, jnp.maximum(n, 1), dtype=jnp.int64)
    # The k-th eligible slot in index order.
    hit = eligible & (jnp.cumsum(eligible) - 1 == k)
    return jnp.where(n > 0, jnp.argmax(hit), -1).astype(jnp.int64)


def pick_go(eligible: Bool[Array, " I"], stream: GoStream) -> tuple[GoStream, Int64[Array, ""]]:
    """BLIS's tie-break: the `Intn(n)`-th of the n eligible slots, drawn from the Go stream only
    when n > 1; -1 if none."""
    n = jnp.sum(eligible).astype(jnp.int64)
    stream, k = intn_if(stream, n, n > 1)
    hit = eligible & (jnp.cumsum(eligible) - 1 == k)
    return stream, jnp.where(n > 0, jnp.argmax(hit), -1).astype(jnp.int64)


def argmax_ties_go(values: Array, active: Bool[Array, " I"], stream: GoStream) -> tuple[GoStream, Int64[Array, ""]]:
    """`argmax_ties` with BLIS's Go-stream tie-break."""
    return pick_go(active & (values == _best(values, active)), stream)


def _best(values: Array, active: Bool[Array, " I"]) -> Array:
    return jnp.max(jnp.where(active, values, -jnp.inf if jnp.issubdtype(values.dtype, jnp.floating)
                             else jnp.iinfo(values.dtype).min))


def argmax_ties(values: Array, active: Bool[Array, " I"], key: PRNGKeyArray | None = None) -> Int64[Array, ""]:
    """Index of the maximum over active slots (exact ties resolved by `pick`)."""
    best = jnp.max(jnp.where(active, values, -jnp.inf if jnp.issubdtype(values.dtype, jnp.floating)
                             else jnp.iinfo(values.dtype).min))
    return pick(active & (values == best), key)


class RoundRobin(eqx.Module):
    counter: Int64[Array, ""]  # decisions made so far


def init_round_robin() -> RoundRobin:
    return RoundRobin(counter=jnp.asarray(0, jnp.int64))


def round_robin(rr: RoundRobin, active: Bool[Array, " I"]) -> tuple[RoundRobin, Int64[Array, ""]]:
    n = jnp.sum(active).astype(jnp.int64)
    k = rr.counter % jnp.maximum(n, 1)
    target = jnp.where(n > 0, jnp.argmax(active & (jnp.cumsum(active) - 1 == k)), -1).astype(jnp.int64)
    return RoundRobin(counter=rr.counter + (n > 0).astype(jnp.int64)), target


def least_loaded(rs: RouterState, key: PRNGKeyArray | None = None) -> Int64[Array, ""]:
    return argmax_ties(-effective_load(rs), rs.active, key)


def always_busiest(rs: RouterState) -> Int64[Array, ""]:
    return argmax_ties(effective_load(rs), rs.active, None)


def weighted(
    profile: sc.ScorerProfile, rs: RouterState, req: sc.RouteRequest, key: PRNGKeyArray | None = None,
) -> tuple[sc.ScorerProfile, Int64[Array, ""], Float64[Array, " I"]]:
    """Weighted routing: returns the profile with its stateful scorers updated, the target
    slot (-1 if none routable) and the per-slot total scores."""
    total = sc.weighted_scores(profile, rs, req)
    target = argmax_ties(total, rs.active, key)
    return sc.observe(profile, rs, req, target), target, total


def weighted_go(profile: sc.ScorerProfile, rs: RouterState, req: sc.RouteRequest, stream: GoStream):
    """`weighted` with BLIS's Go-stream tie-break: (profile, target, stream)."""
    stream, target = argmax_ties_go(sc.weighted_scores(profile, rs, req), rs.active, stream)
    return sc.observe(profile, rs, req, target), target, stream


def least_loaded_go(rs: RouterState, stream: GoStream) -> tuple[GoStream, Int64[Array, ""]]:
    return argmax_ties_go(-effective_load(rs), rs.active, stream)
