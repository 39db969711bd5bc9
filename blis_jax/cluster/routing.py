"""Routing policies (blis-features §3.5): pick one routable instance slot per request.

Each policy is an `eqx.Module` whose numbers are arrays (a counter, scorer weights, the
stateful scorers' indices: changing one never recompiles) and whose `route` is pure:

    policy, target, stream = policy.route(rs, req, stream)

It sees only the routable slots (`RouterState.active`: Active/WarmingUp instances,
model-matching, in the pool being routed); with none routable it returns -1 (BLIS counts a
routing rejection) and leaves its own state and the stream unchanged. Targets are int64 slot
indices; mask before indexing with them (-1 would read the last slot).

* `RoundRobin` (`round-robin`, BLIS's default): a counter, incremented once per decision,
  picks the (counter mod n)-th routable slot in index order (BLIS: counter mod |snapshots|
  over the filtered snapshot list). One counter per policy object: with PD pools without
  scorers of their own, the decode and the prefill decisions of a request advance the same
  counter (the cluster loop routes both pools with the one cluster policy).
* `LeastLoaded` (`least-loaded`): minimum EffectiveLoad; ties broken at random.
* `AlwaysBusiest` (`always-busiest`): maximum EffectiveLoad; the first (lowest index) wins,
  no draw.
* `Weighted` (`weighted`): argmax of the weighted scorer sum of its `ScorerProfile`
  (scorers.py); ties at random; the stateful scorers then observe the chosen slot. PD pools
  with their own scorers (`--prefill-routing-scorers`, `--decode-routing-scorers`) route with
  a `Weighted` policy of their own.

Random tie-breaks are BLIS's: `Intn(|tied|)` from the Go `math/rand` stream passed in (the
router's, or a pool's), drawn only when more than one slot ties (`pick_go`, blis-rng.md
§10.1); a policy that never ties at random returns the stream unchanged. The class flags say
what a policy reads, for the loop's static scheduling: `reads_signals` (any instance state;
round-robin reads none) and `reads_in_flight` (the always-current in-flight counts, so
decisions cannot be taken ahead of the instances).

Building blocks, also usable alone: `pick` / `argmax_ties` with a `jax.random` key draw
uniformly among the tied (`key=None` breaks ties by lowest index: deterministic, not BLIS
behaviour, for tests and analysis), and so do the functional forms `least_loaded` and
`weighted`; `round_robin(counter, active)` is the counter step on a bare mask.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

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
    return pick(active & (values == _best(values, active)), key)


def round_robin(rr: RoundRobin, active: Bool[Array, " I"]) -> tuple[RoundRobin, Int64[Array, ""]]:
    """The counter step on a bare mask: the (counter mod n)-th of the n `active` slots; the
    counter advances only when a slot is picked (-1 if none)."""
    n = jnp.sum(active).astype(jnp.int64)
    k = rr.counter % jnp.maximum(n, 1)
    target = jnp.where(n > 0, jnp.argmax(active & (jnp.cumsum(active) - 1 == k)), -1).astype(jnp.int64)
    return dataclasses.replace(rr, counter=rr.counter + (n > 0).astype(jnp.int64)), target


def least_loaded(rs: RouterState, key: PRNGKeyArray | None = None) -> Int64[Array, ""]:
    """Minimum EffectiveLoad, ties by `pick` (with a `jax.random` key; BLIS's draw: `LeastLoaded`)."""
    return argmax_ties(-effective_load(rs), rs.active, key)


def always_busiest(rs: RouterState) -> Int64[Array, ""]:
    return argmax_ties(effective_load(rs), rs.active, None)


def weighted(
    profile: sc.ScorerProfile, rs: RouterState, req: sc.RouteRequest, key: PRNGKeyArray | None = None,
) -> tuple[sc.ScorerProfile, Int64[Array, ""], Float64[Array, " I"]]:
    """Weighted routing with a `jax.random` tie-break (BLIS's draw: `Weighted`): returns the
    profile with its stateful scorers updated, the target slot (-1 if none routable) and the
    per-slot total scores."""
    total = sc.weighted_scores(profile, rs, req)
    target = argmax_ties(total, rs.active, key)
    return sc.observe(profile, rs, req, target), target, total


# ------------------------------------------------------------------------------------ policies


class AbstractRouting(eqx.Module):
    """A routing policy: `route(rs, req, stream) -> (policy, target, stream)`, pure. `req` is
    read only by policies with scorers that read the request (None is fine for the others);
    `stream` is the Go source of the random tie-breaks."""

    reads_signals: ClassVar[bool] = True  # reads instance state (the snapshot, in-flight counts)

    @property
    def reads_in_flight(self) -> bool:
        """Reads the always-current in-flight counts (not only the stale snapshot)."""
        return self.reads_signals

    @property
    def scorers(self) -> tuple[str, ...]:
        """Scorer names (weighted routing), in profile order."""
        return ()

    @abc.abstractmethod
    def route(
        self, rs: RouterState, req: sc.RouteRequest | None, stream: GoStream
    ) -> tuple[AbstractRouting, Int64[Array, ""], GoStream]:
        """One decision over `rs.active`: the updated policy, the target (-1: none routable)
        and the stream after any tie-break draw."""


class RoundRobin(AbstractRouting):
    counter: Int64[Array, ""]  # decisions made so far
    reads_signals: ClassVar[bool] = False

    def route(self, rs, req, stream):
        del req
        policy, target = round_robin(self, rs.active)
        return policy, target, stream


class LeastLoaded(AbstractRouting):
    def route(self, rs, req, stream):
        del req
        stream, target = argmax_ties_go(-effective_load(rs), rs.active, stream)
        return self, target, stream


class AlwaysBusiest(AbstractRouting):
    def route(self, rs, req, stream):
        del req
        return self, always_busiest(rs), stream


class Weighted(AbstractRouting):
    profile: sc.ScorerProfile  # weights and the stateful scorers' state

    @property
    def reads_in_flight(self) -> bool:
        return any(name in sc.LIVE_SCORERS for name in self.profile.names)

    @property
    def scorers(self) -> tuple[str, ...]:
        return self.profile.names

    def route(self, rs, req, stream):
        stream, target = argmax_ties_go(sc.weighted_scores(self.profile, rs, req), rs.active, stream)
        return Weighted(profile=sc.observe(self.profile, rs, req, target)), target, stream


def init_round_robin() -> RoundRobin:
    return RoundRobin(counter=jnp.asarray(0, jnp.int64))


def make_routing(
    policy: str = "round-robin", num_instances: int | None = None, *, scorers: str | None = None,
    flag: str = "--routing-policy", scorers_flag: str = "--routing-scorers",
) -> AbstractRouting:
    """Routing policy from BLIS's `--routing-policy` name; `weighted` takes its profile from
    `scorers` (`name:weight,...`, None = the default profile) sized for `num_instances` slots."""
    check_policy(policy, flag)
    if scorers is not None and policy != "weighted":
        raise ConfigError(f"{scorers_flag} is used by {flag} weighted only, but the policy is {policy}; "
                          f"add {flag} weighted or drop {scorers_flag}")
    if policy == "weighted":
        if num_instances is None:
            raise ConfigError("weighted routing needs the number of instance slots (its scorers keep per-slot state)")
        return Weighted(profile=sc.make_profile(scorers, num_instances, flag=scorers_flag))
    if policy == "least-loaded":
        return LeastLoaded()
    if policy == "always-busiest":
        return AlwaysBusiest()
    return init_round_robin()
