"""What the router sees of each instance, and how stale it is (blis-features §3.6, INV-7).

Three kinds of signal, with three freshness rules:

* **Router-owned, always current**: the in-flight count per instance (incremented at routing,
  decremented when a request leaves an instance), the prefix-affinity index (scorers.py) and
  the routable mask. The cluster keeps these itself; they are never cached.
* **Instance-reported** (`InstanceSignals`: queue depth, batch size, KV utilization, ...):
  the router holds a cached copy per instance (`Snapshot`). BLIS's rule is a *lazy* refresh,
  not a fixed grid: when a RouterState is built at time `now`, each queried instance whose
  cached copy is at least `interval_us` old (`now - last_refresh >= interval_us`) is re-read
  and `last_refresh := now`. The cache starts all-zero with `last_refresh = 0`, so during the
  first interval every instance looks empty. `interval_us = 0` (BLIS mode Immediate) makes
  the test always true: every query reads live values.
  BLIS keeps one `last_refresh` per field; all fields share one interval and are read
  together, so one `last_refresh` per instance is equivalent.
* **Prefix-cache contents** (`CacheSignal`; read by `precise-prefix-cache`, `no-hit-lru` and
  the `prefix-threshold` PD decider): every instance's cache is frozen at construction
  (empty) and re-frozen for *all* instances together when `now - last >= delay_us`, checked
  at each RouterState build. `delay_us = 0` means live queries (the test is always true).

Every function here is pure and branch-free (`jnp.where` on masks), so it runs inside a
`lax.while_loop` and `vmap`s over scenarios.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int64, PyTree

from blis_jax.errors import ConfigError


class InstanceSignals(eqx.Module):
    """Instance-reported load signals, one entry per instance slot (shape [I]).

    The engine fills these from each instance's live state; the router only ever reads them
    through a `Snapshot` (possibly stale).
    """

    queue_depth: Int64[Array, " I"]  # requests in the instance's wait queue (incl. preempted)
    batch_size: Int64[Array, " I"]  # requests in the running batch
    kv_utilization: Float64[Array, " I"]  # used KV blocks / total KV blocks, in [0, 1]
    free_kv_blocks: Int64[Array, " I"]  # total KV blocks - used KV blocks
    kv_tokens_in_use: Int64[Array, " I"]  # used KV blocks * block size (autoscaler demand)
    kv_tokens_capacity: Int64[Array, " I"]  # total KV blocks * block size (autoscaler supply)
    cache_hit_rate: Float64[Array, " I"]  # prefix-cache hit rate in blocks so far
    preemption_count: Int64[Array, " I"]  # preemptions so far
    adapter_resident: Bool[Array, "I A"] | None = None  # LoRA: adapters loaded on each instance (None: no LoRA)


def zero_signals(num_instances: int) -> InstanceSignals:
    """All-zero signals: BLIS's cached snapshot before its first refresh."""
    zi = jnp.zeros(num_instances, jnp.int64)
    zf = jnp.zeros(num_instances, jnp.float64)
    return InstanceSignals(
        queue_depth=zi, batch_size=zi, kv_utilization=zf, free_kv_blocks=zi,
        kv_tokens_in_use=zi, kv_tokens_capacity=zi, cache_hit_rate=zf, preemption_count=zi,
    )


class Snapshot(eqx.Module):
    """The router's cached copy of the instance-reported signals (lazy periodic refresh)."""

    signals: InstanceSignals  # values as last read; all zero before the first read
    last_refresh: Int64[Array, " I"]  # µs of the last read per instance (0 initially)
    interval_us: Int64[Array, ""]  # --snapshot-refresh-interval; 0 = read live on every query


def init_snapshot(num_instances: int, interval_us: int = 50_000) -> Snapshot:
    """Snapshot at construction: all zero, last read at t = 0 (BLIS default interval 50 ms)."""
    if isinstance(interval_us, bool) or not isinstance(interval_us, int) or interval_us < 0:
        raise ConfigError(
            f"--snapshot-refresh-interval must be an integer >= 0 microseconds (0 = live), got {interval_us!r}"
        )
    return Snapshot(
        signals=zero_signals(num_instances),
        last_refresh=jnp.zeros(num_instances, jnp.int64),
        interval_us=jnp.asarray(interval_us, jnp.int64),
    )


def refresh(
    snapshot: Snapshot, live: InstanceSignals, now_us: Int64[Array, ""],
    queried: Bool[Array, " I"] | None = None,
) -> Snapshot:
    """The snapshot after a RouterState build at `now_us` (call it at every build).

    Instance i is re-read iff it is queried (routable and model-matching; default all) and
    `now_us - last_refresh[i] >= interval_us`; then `last_refresh[i] = now_us`. Instances not
    due keep their old values and timestamp.
    """
    now_us = jnp.asarray(now_us, jnp.int64)
    due = now_us - snapshot.last_refresh >= snapshot.interval_us
    if queried is not None:
        due = due & queried
    signals = jax.tree.map(lambda old, new: jnp.where(due.reshape(due.shape + (1,) * (new.ndim - 1)), new, old),
                           snapshot.signals, live)
    return dataclasses.replace(
        snapshot, signals=signals, last_refresh=jnp.where(due, now_us, snapshot.last_refresh)
    )


class RouterState(eqx.Module):
    """Per-decision view handed to routing policies and scorers (BLIS's RouterState)."""

    signals: InstanceSignals  # instance-reported values from the Snapshot (possibly stale)
    in_flight: Int64[Array, " I"]  # router-owned in-flight requests (always current)
    active: Bool[Array, " I"]  # routable (Active/WarmingUp, model-matching, in the pool)


def router_state(
    snapshot: Snapshot, in_flight: Int64[Array, " I"], active: Bool[Array, " I"]
) -> RouterState:
    """Combine the cached signals with the live in-flight counts and the routable mask."""
    return RouterState(
        signals=snapshot.signals, in_flight=jnp.asarray(in_flight, jnp.int64),
        active=jnp.asarray(active, bool),
    )


def effective_load(rs: RouterState) -> Int64[Array, " I"]:
    """BLIS EffectiveLoad = QueueDepth + BatchSize + InFlightRequests (§3.5)."""
    return rs.signals.queue_depth + rs.signals.batch_size + rs.in_flight


class CacheSignal(eqx.Module):
    """Frozen copy of every instance's prefix-cache contents (any pytree with leading axis I).

    The pytree is whatever the engine needs to answer "how many leading blocks of this prompt
    does instance i hold" (e.g. its block content keys); the engine computes
    `cached_prefix_blocks[I]` from `frozen` (or from the live caches when `delay_us == 0`).
    """

    frozen: PyTree  # cache contents as of `last_us`
    last_us: Int64[Array, ""]  # µs of the last freeze (0 = construction)
    delay_us: Int64[Array, ""]  # --cache-signal-delay; 0 = live queries


def init_cache_signal(initial: PyTree, delay_us: int = 50_000) -> CacheSignal:
    """Freeze the caches at construction (normally empty) at t = 0 (BLIS default 50 ms)."""
    if isinstance(delay_us, bool) or not isinstance(delay_us, int) or delay_us < 0:
        raise ConfigError(
            f"--cache-signal-delay must be an integer >= 0 microseconds (0 = live), got {delay_us!r}"
        )
    return CacheSignal(
        frozen=initial, last_us=jnp.asarray(0, jnp.int64), delay_us=jnp.asarray(delay_us, jnp.int64)
    )


def refresh_cache_signal(cs: CacheSignal, live: PyTree, now_us: Int64[Array, ""]) -> CacheSignal:
    """The cache signal after a RouterState build at `now_us`: all instances are re-frozen
    together iff `now_us - last_us >= delay_us` (always when delay is 0, i.e. live)."""
    now_us = jnp.asarray(now_us, jnp.int64)
    due = now_us - cs.last_us >= cs.delay_us
    frozen = jax.tree.map(lambda old, new: jnp.where(due, new, old), cs.frozen, live)
    return dataclasses.replace(cs, frozen=frozen, last_us=jnp.where(due, now_us, cs.last_us))
