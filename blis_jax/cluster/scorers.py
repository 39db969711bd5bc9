"""Routing scorers of the `weighted` policy (blis-features §3.5) and their weighted combination.

Every scorer maps the per-decision `RouterState` (arrays [I] plus the routable mask) and the
request (`RouteRequest`) to float64 scores in [0, 1] per instance slot; inactive slots score
0 and are excluded from every min / max. Formulas (load = EffectiveLoad = QD + BatchSize +
InFlight):

| scorer | score |
|---|---|
| `queue-depth` | min-max inverse of QueueDepth: (max QD - QD) / (max QD - min QD) |
| `kv-utilization` | 1 - KVUtilization |
| `load-balance` | 1 / (1 + load) |
| `active-requests` | InFlight = 0 or max InFlight = 0 => 1; else (max - InFlight) / max |
| `running-requests` | min-max inverse of BatchSize |
| `load-aware` | QD = 0 => 0.5; else 0.5 * (1 - min(QD, 128) / 128) |
| `vllm-dp` | min-max inverse of 4 * QD + BatchSize |
| `precise-prefix-cache` | min-max (increasing) of `cached_prefix_blocks` |
| `no-hit-lru` | warm request (some instance holds >= 1 block) => 0.5 everywhere; cold => 1 - rank / (n - 1), rank over never-used instances (index order) then least- to most-recently used |
| `prefix-affinity` | leading prompt blocks found in the router's per-instance LRU index / full prompt blocks (0 without a full block) |
| `lora-affinity` | request without adapter => 1; else min-max of adapter residency |

Min-max normalisation: all-equal raw values (including all zero) give 1.0 everywhere, as in
llm-d; otherwise (max - x) / (max - min) for the inverse form and (x - min) / (max - min) for
the increasing form, with the difference taken in the raw dtype (int64 for counts) before the
float64 division. Scorers with an explicit formula (kv-utilization, load-balance,
active-requests, load-aware, no-hit-lru, prefix-affinity) use it as is.

Weighted combination: each score is clamped to [0, 1], multiplied by its normalised weight
w_k / sum(w) and summed over the scorers in profile order (the same float64 operation order
as BLIS). Profiles are `name:weight,...` strings; the default is
`precise-prefix-cache:2,queue-depth:1,kv-utilization:1`.

Stateful scorers keep fixed-size arrays:

* `PrefixAffinityIndex`: per instance an LRU set of block keys with `capacity` entries (BLIS:
  10,000 blocks). Rows are kept sorted by key for `searchsorted` lookups; a use stamp orders
  the LRU. Recording a request's blocks for the chosen instance refreshes the stamps of keys
  already present and writes the new keys over the least-recently-used entries (empty
  entries first), which is exactly the contents a sequential LRU reaches (keys of one request
  are distinct and at most `capacity`, checked at construction).
* `NoHitLRU`: one last-use stamp per instance slot (capacity = I, so nothing is ever
  evicted); the chosen instance becomes most-recently used only for cold requests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int64

from blis_jax.cluster._numerics import exact_div, rounded
from blis_jax.cluster.signals import RouterState, effective_load
from blis_jax.errors import ConfigError

SCORERS = (
    "queue-depth", "kv-utilization", "load-balance", "active-requests", "running-requests",
    "load-aware", "vllm-dp", "precise-prefix-cache", "no-hit-lru", "prefix-affinity",
    "lora-affinity",
)
DEFAULT_PROFILE = "precise-prefix-cache:2,queue-depth:1,kv-utilization:1"
PREFIX_SCORERS = ("precise-prefix-cache", "no-hit-lru")  # read the instances' prefix caches
LIVE_SCORERS = ("load-balance", "active-requests")  # read the always-current in-flight counts
PREFIX_AFFINITY_CAPACITY = 10_000  # blocks per instance in BLIS's router-side index
LOAD_AWARE_QUEUE_THRESHOLD = 128
EMPTY_KEY = (1 << 63) - 1  # sorts after every real key; real keys must be smaller


class RouteRequest(eqx.Module):
    """The request fields scorers read (one routing decision)."""

    input_len: Int64[Array, ""]  # prompt tokens, shared prefix included
    cached_prefix_blocks: Int64[Array, " I"]  # leading prompt blocks in each instance's prefix
    #   cache, as the (possibly stale) cache signal reports them; computed by the engine
    block_keys: Int64[Array, " MB"]  # content keys (hash stand-ins) of the full prompt blocks,
    #   in order, padded with any value; distinct and in [0, EMPTY_KEY)
    num_blocks: Int64[Array, ""]  # full prompt blocks = input_len // block_size (<= MB counted)
    has_adapter: Bool[Array, ""]  # the request names a LoRA adapter
    adapter_resident: Bool[Array, " I"]  # that adapter is resident on the instance


def route_request(
    input_len, num_instances: int, *, cached_prefix_blocks=None, block_keys=None, num_blocks=None,
    block_size: int = 16, has_adapter=False, adapter_resident=None,
) -> RouteRequest:
    """Build a RouteRequest; absent fields default to "nothing cached / no keys / no adapter".
    `num_blocks` defaults to `input_len // block_size`."""
    input_len = jnp.asarray(input_len, jnp.int64)
    keys = jnp.zeros(0, jnp.int64) if block_keys is None else jnp.asarray(block_keys, jnp.int64)
    return RouteRequest(
        input_len=input_len,
        cached_prefix_blocks=(
            jnp.zeros(num_instances, jnp.int64) if cached_prefix_blocks is None
            else jnp.asarray(cached_prefix_blocks, jnp.int64)
        ),
        block_keys=keys,
        num_blocks=input_len // block_size if num_blocks is None else jnp.asarray(num_blocks, jnp.int64),
        has_adapter=jnp.asarray(has_adapter, bool),
        adapter_resident=(
            jnp.zeros(num_instances, bool) if adapter_resident is None
            else jnp.asarray(adapter_resident, bool)
        ),
    )


# ----------------------------------------------------------------------------- normalisation


def minmax(raw: Array, active: Bool[Array, " I"], *, increasing: bool) -> Float64[Array, " I"]:
    """Min-max normalisation over the active slots; all equal (incl. all zero) => 1.0.

    `increasing=False` is the inverse form (max - x) / (max - min), lower raw is better."""
    if jnp.issubdtype(raw.dtype, jnp.integer):
        big, small = jnp.iinfo(raw.dtype).max, jnp.iinfo(raw.dtype).min
    else:
        big, small = jnp.inf, -jnp.inf
    lo = jnp.min(jnp.where(active, raw, big))
    hi = jnp.max(jnp.where(active, raw, small))
    span = hi - lo
    num = (raw - lo) if increasing else (hi - raw)
    equal = span == 0
    safe = jnp.where(equal, jnp.ones_like(span), span)
    score = jnp.where(equal, 1.0, exact_div(num.astype(jnp.float64), safe.astype(jnp.float64)))
    return jnp.where(active, score, 0.0)


def _masked(active, score):
    return jnp.where(active, score, 0.0)


# ----------------------------------------------------------------------------- stateless scorers


def queue_depth(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    return minmax(rs.signals.queue_depth, rs.active, increasing=False)


def kv_utilization(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    return _masked(rs.active, 1.0 - rs.signals.kv_utilization)


def load_balance(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    return _masked(rs.active, exact_div(1.0, 1.0 + effective_load(rs).astype(jnp.float64)))


def active_requests(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    n = rs.in_flight
    top = jnp.max(jnp.where(rs.active, n, 0))
    safe = jnp.maximum(top, 1).astype(jnp.float64)
    score = jnp.where((n == 0) | (top == 0), 1.0, exact_div((top - n).astype(jnp.float64), safe))
    return _masked(rs.active, score)


def running_requests(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    return minmax(rs.signals.batch_size, rs.active, increasing=False)


def load_aware(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    qd = rs.signals.queue_depth
    capped = jnp.minimum(qd, LOAD_AWARE_QUEUE_THRESHOLD).astype(jnp.float64)
    score = jnp.where(qd == 0, 0.5, 0.5 * (1.0 - exact_div(capped, float(LOAD_AWARE_QUEUE_THRESHOLD))))
    return _masked(rs.active, score)


def vllm_dp(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    raw = 4 * rs.signals.queue_depth + rs.signals.batch_size
    return minmax(raw, rs.active, increasing=False)


def precise_prefix_cache(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    return minmax(req.cached_prefix_blocks, rs.active, increasing=True)


def lora_affinity(rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    resident = minmax(req.adapter_resident.astype(jnp.int64), rs.active, increasing=True)
    return jnp.where(req.has_adapter, resident, _masked(rs.active, 1.0))


# ----------------------------------------------------------------------------- no-hit-lru


class NoHitLRU(eqx.Module):
    """Recency order of instances for cold requests (one stamp per instance slot)."""

    last_used: Int64[Array, " I"]  # stamp of the last cold request routed there; -1 = never
    clock: Int64[Array, ""]  # next stamp


def init_no_hit_lru(num_instances: int) -> NoHitLRU:
    return NoHitLRU(
        last_used=jnp.full(num_instances, -1, jnp.int64), clock=jnp.asarray(0, jnp.int64)
    )


def is_warm(rs: RouterState, req: RouteRequest) -> Bool[Array, ""]:
    """Some routable instance holds at least one leading block of the prompt."""
    return jnp.any(rs.active & (req.cached_prefix_blocks >= 1))


def no_hit_lru(lru: NoHitLRU, rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    active = rs.active
    used = lru.last_used >= 0
    idx = jnp.arange(active.shape[0])
    # Order: never-used first (by index), then used by ascending stamp (least recent first).
    before = jnp.where(
        used[None, :] == used[:, None],
        jnp.where(used[:, None], lru.last_used[None, :] < lru.last_used[:, None], idx[None, :] < idx[:, None]),
        ~used[None, :],  # j never used, i used => j first
    )
    rank = jnp.sum(before & active[None, :], axis=1)
    n = jnp.sum(active)
    denom = jnp.maximum(n - 1, 1).astype(jnp.float64)
    cold = jnp.where(n <= 1, 1.0, 1.0 - exact_div(rank.astype(jnp.float64), denom))
    return _masked(active, jnp.where(is_warm(rs, req), 0.5, cold))


def observe_no_hit_lru(
    lru: NoHitLRU, rs: RouterState, req: RouteRequest, chosen: Int64[Array, ""]
) -> NoHitLRU:
    """After routing to `chosen` (-1 = none): for a cold request it becomes most recent."""
    touch = (~is_warm(rs, req)) & (chosen >= 0)
    slot = jnp.where(touch, chosen, lru.last_used.shape[0])  # out of range => dropped
    return NoHitLRU(
        last_used=lru.last_used.at[slot].set(lru.clock, mode="drop"),
        clock=lru.clock + touch.astype(jnp.int64),
    )


# ----------------------------------------------------------------------------- prefix-affinity


class PrefixAffinityIndex(eqx.Module):
    """Router-side block index: per instance an LRU set of `capacity` block keys."""

    keys: Int64[Array, "I C"]  # sorted ascending per row; EMPTY_KEY = unused entry
    stamps: Int64[Array, "I C"]  # last-use stamp of each entry; -1 = unused
    clock: Int64[Array, ""]  # next stamp

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]


def init_prefix_affinity(num_instances: int, capacity: int = PREFIX_AFFINITY_CAPACITY) -> PrefixAffinityIndex:
    if capacity < 1:
        raise ConfigError(f"prefix-affinity index capacity must be >= 1 block, got {capacity}")
    return PrefixAffinityIndex(
        keys=jnp.full((num_instances, capacity), EMPTY_KEY, jnp.int64),
        stamps=jnp.full((num_instances, capacity), -1, jnp.int64),
        clock=jnp.asarray(0, jnp.int64),
    )


def _lookup(keys_row, query):
    pos = jnp.searchsorted(keys_row, query)
    safe = jnp.minimum(pos, keys_row.shape[0] - 1)
    return safe, keys_row[safe] == query


def _valid_blocks(req: RouteRequest) -> Bool[Array, " MB"]:
    return jnp.arange(req.block_keys.shape[0]) < req.num_blocks


def prefix_affinity(index: PrefixAffinityIndex, rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    _, found = jax.vmap(_lookup, in_axes=(0, None))(index.keys, req.block_keys)  # [I, MB]
    matched = found & _valid_blocks(req)[None, :]
    leading = jnp.sum(jnp.cumprod(matched.astype(jnp.int64), axis=1), axis=1)
    nb = jnp.maximum(req.num_blocks, 1).astype(jnp.float64)
    score = jnp.where(req.num_blocks > 0, exact_div(leading.astype(jnp.float64), nb), 0.0)
    return _masked(rs.active, score)


def record_prefix_affinity(
    index: PrefixAffinityIndex, req: RouteRequest, chosen: Int64[Array, ""]
) -> PrefixAffinityIndex:
    """Record all full prompt blocks of the request for `chosen` (-1 = none: no change).

    Block j gets stamp clock + j (a sequential LRU touches them in prompt order)."""
    c = index.capacity
    mb = req.block_keys.shape[0]
    if mb > c:
        raise ConfigError(
            f"prefix-affinity: a request has up to {mb} prompt blocks but the index holds {c} per "
            "instance; raise the index capacity to at least the blocks per request"
        )
    row = jnp.maximum(chosen, 0)
    keys, stamps = index.keys[row], index.stamps[row]
    valid = _valid_blocks(req)
    pos, found = _lookup(keys, req.block_keys)
    found = found & valid
    new_stamp = index.clock + jnp.arange(mb, dtype=jnp.int64)
    # Keys already present: refresh their stamps (they now outrank every older entry).
    stamps = stamps.at[jnp.where(found, pos, c)].set(new_stamp, mode="drop")
    # New keys replace the least recently used entries (unused entries have stamp -1).
    is_new = valid & ~found
    _, victims = jax.lax.top_k(-stamps, mb)  # the mb oldest entries (ties: lowest index)
    # The k-th new key (in prompt order) takes the k-th oldest entry; others write nowhere.
    slot = jnp.where(is_new, victims[jnp.maximum(jnp.cumsum(is_new) - 1, 0)], c)
    keys = keys.at[slot].set(req.block_keys, mode="drop")
    stamps = stamps.at[slot].set(new_stamp, mode="drop")
    order = jnp.argsort(keys, stable=True)
    keys, stamps = keys[order], stamps[order]
    ok = chosen >= 0
    return PrefixAffinityIndex(
        keys=index.keys.at[row].set(jnp.where(ok, keys, index.keys[row])),
        stamps=index.stamps.at[row].set(jnp.where(ok, stamps, index.stamps[row])),
        clock=index.clock + jnp.where(ok, req.num_blocks, 0),
    )


# ----------------------------------------------------------------------------- profiles


def parse_profile(text: str | None, flag: str = "--routing-scorers") -> tuple[tuple[str, float], ...]:
    """Parse `name:weight,...` (empty or None => the default profile). Names must be known
    and unique, weights finite and > 0; errors name `flag` and the fix."""
    if text is None or not text.strip():
        text = DEFAULT_PROFILE
    out: list[tuple[str, float]] = []
    for part in text.split(","):
        entry = part.strip()
        name, sep, weight_text = entry.partition(":")
        name, weight_text = name.strip(), weight_text.strip()
        if not sep or not name or not weight_text:
            raise ConfigError(
                f"{flag}: entry {entry!r} is not name:weight; write e.g. '{DEFAULT_PROFILE}'"
            )
        if name not in SCORERS:
            raise ConfigError(f"{flag}: unknown scorer {name!r}; valid scorers: {', '.join(SCORERS)}")
        if any(name == seen for seen, _ in out):
            raise ConfigError(f"{flag}: scorer {name!r} appears twice; list each scorer once")
        try:
            weight = float(weight_text)
        except ValueError:
            raise ConfigError(f"{flag}: weight {weight_text!r} of {name!r} is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{flag}: weight of {name!r} must be finite and > 0, got {weight_text!r}")
        out.append((name, weight))
    return tuple(out)


def normalized_weights(profile: Sequence[tuple[str, float]]) -> tuple[float, ...]:
    """w_k / sum(w), the sum accumulated in profile order (float64, as BLIS)."""
    total = 0.0
    for _, w in profile:
        total += w
    return tuple(w / total for _, w in profile)


class ScorerProfile(eqx.Module):
    """A weighted scorer set plus the state of its stateful scorers."""

    names: tuple[str, ...] = eqx.field(static=True)
    weights: Float64[Array, " K"]  # normalised, sum 1 (dynamic: changing them never retraces)
    prefix_affinity: PrefixAffinityIndex | None  # present iff "prefix-affinity" in names
    no_hit_lru: NoHitLRU | None  # present iff "no-hit-lru" in names


def make_profile(
    text: str | Sequence[tuple[str, float]] | None, num_instances: int, *,
    flag: str = "--routing-scorers", prefix_affinity_capacity: int = PREFIX_AFFINITY_CAPACITY,
) -> ScorerProfile:
    """Profile from a `name:weight,...` string (or parsed pairs); None/"" => default."""
    pairs = parse_profile(text, flag) if text is None or isinstance(text, str) else tuple(text)
    if not pairs:
        raise ConfigError(f"{flag}: at least one scorer is needed, e.g. '{DEFAULT_PROFILE}'")
    names = tuple(n for n, _ in pairs)
    return ScorerProfile(
        names=names,
        weights=jnp.asarray(normalized_weights(pairs), jnp.float64),
        prefix_affinity=(
            init_prefix_affinity(num_instances, prefix_affinity_capacity) if "prefix-affinity" in names else None
        ),
        no_hit_lru=init_no_hit_lru(num_instances) if "no-hit-lru" in names else None,
    )


_STATELESS: dict[str, Callable[[RouterState, RouteRequest], Array]] = {
    "queue-depth": queue_depth,
    "kv-utilization": kv_utilization,
    "load-balance": load_balance,
    "active-requests": active_requests,
    "running-requests": running_requests,
    "load-aware": load_aware,
    "vllm-dp": vllm_dp,
    "precise-prefix-cache": precise_prefix_cache,
    "lora-affinity": lora_affinity,
}


def score(profile: ScorerProfile, name: str, rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    """One scorer's per-instance scores (its state taken from `profile`)."""
    if name == "prefix-affinity":
        return prefix_affinity(profile.prefix_affinity, rs, req)
    if name == "no-hit-lru":
        return no_hit_lru(profile.no_hit_lru, rs, req)
    return _STATELESS[name](rs, req)


def all_scores(profile: ScorerProfile, rs: RouterState, req: RouteRequest) -> Float64[Array, "K I"]:
    """Raw per-scorer scores, one row per scorer of the profile."""
    return jnp.stack([score(profile, n, rs, req) for n in profile.names])


def combine(profile: ScorerProfile, scores: Float64[Array, "K I"], active: Bool[Array, " I"]) -> Float64[Array, " I"]:
    """sum_k clamp(score_k, 0, 1) * w_k, accumulated in profile order; inactive slots 0."""
    total = jnp.zeros(scores.shape[1], jnp.float64)
    for k in range(len(profile.names)):
        total = total + rounded(jnp.clip(scores[k], 0.0, 1.0) * profile.weights[k])
    return jnp.where(active, total, 0.0)


def weighted_scores(profile: ScorerProfile, rs: RouterState, req: RouteRequest) -> Float64[Array, " I"]:
    """The weighted policy's per-instance total score."""
    return combine(profile, all_scores(profile, rs, req), rs.active)


def observe(profile: ScorerProfile, rs: RouterState, req: RouteRequest, chosen: Int64[Array, ""]) -> ScorerProfile:
    """Notify the stateful scorers of the routing choice (-1 = none: no change)."""
    chosen = jnp.asarray(chosen, jnp.int64)
    pa, lru = profile.prefix_affinity, profile.no_hit_lru
    if pa is not None:
        pa = record_prefix_affinity(pa, req, chosen)
    if lru is not None:
        lru = observe_no_hit_lru(lru, rs, req, chosen)
    return dataclasses.replace(profile, prefix_affinity=pa, no_hit_lru=lru)
