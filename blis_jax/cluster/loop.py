"""The cluster's shared-clock loop: I instances (one engine each, stacked on a leading axis)
behind an admission policy and a router (blis-features §3.1-§3.6).

BLIS pops, at each iteration, the earliest cluster event or else the earliest instance event,
cluster events first at equal times and the lowest instance index first among instances.
Events of different instances never interact except through the router, which reads them
only at cluster events. So between two cluster events the instances run independently: one
iteration here runs every instance (the single-instance engine, `vmap`ped over the instance
axis) through all its events *before* the next cluster event's time, then processes that
cluster event: admission, then routing, then injection into the chosen instance's inbox.
This is the same order of effects as BLIS's loop, with one vectorised engine call per cluster
event instead of one heap pop per instance event.

Cluster events are the requests' arrivals in arrival order (admission at arrival +
admission latency, routing at that + routing latency; both latencies are constants, so the
routing order is the arrival order). Router-side state (`ClusterState`): the admission
policy, the in-flight counts (routed − left, always current), the stale signal snapshot and
cache signal, the routing policy state, and per request the serving instance.
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int32, Int64, PRNGKeyArray

from blis_jax import latency
from blis_jax.cluster import admission as adm
from blis_jax.cluster import routing, signals
from blis_jax.cluster import scorers as sc
from blis_jax.cluster._numerics import exact_div
from blis_jax.engine import inbox, kv, results
from blis_jax.engine import simulate as engine
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.params import INF_TIME, EngineParams
from blis_jax.engine.state import EngineState, RequestArrays, init_state

PREFIX_SCORERS = ("precise-prefix-cache", "no-hit-lru")  # read the instances' prefix caches


@dataclasses.dataclass(frozen=True)
class ClusterDims:
    """Static structure of one compiled cluster program."""

    engine: EngineDims
    num_instances: int  # instance slots (a smaller active count is a mask)
    routing_policy: str = "round-robin"
    scorers: tuple[str, ...] = ()  # weighted routing's scorer names, in profile order

    @property
    def reads_prefix_cache(self) -> bool:
        return self.routing_policy == "weighted" and any(s in PREFIX_SCORERS for s in self.scorers)

    @property
    def needs_block_keys(self) -> bool:
        return self.routing_policy == "weighted" and "prefix-affinity" in self.scorers


class ClusterParams(eqx.Module):
    """Dynamic cluster settings (changing them never recompiles)."""

    active: Bool[Array, " I"]  # instance slots that exist and are routable
    admission_latency_us: Int64[Array, ""]
    routing_latency_us: Int64[Array, ""]


class ClusterState(eqx.Module):
    instances: EngineState  # every leaf has a leading instance axis [I, ...]
    next_request: Int32[Array, ""]  # cluster events processed (requests in arrival order)
    admission: adm.AbstractAdmission
    routed: Int64[Array, " I"]  # requests routed to each instance so far
    snapshot: signals.Snapshot
    cache_signal: signals.CacheSignal
    round_robin: routing.RoundRobin
    profile: sc.ScorerProfile | None
    key: PRNGKeyArray  # routing tie-breaks: fold_in(key, decision index)
    handled_by: Int32[Array, " N"]  # instance serving each request; -1 none
    rejected: Bool[Array, " N"]  # refused by admission
    routing_rejected: Bool[Array, " N"]  # no routable instance
    result: Int32[Array, ""]


# ---------------------------------------------------------------------------- what the router reads


def live_signals(instances: EngineState, params: EngineParams, block_size: int) -> signals.InstanceSignals:
    """Instance-reported signals from the live (stacked) engine states."""
    total = params.total_kv_blocks
    used = total - instances.free_count
    lookups = instances.kv_hits + instances.kv_misses
    return signals.InstanceSignals(
        queue_depth=instances.wait_len.astype(jnp.int64),
        batch_size=instances.batch_len.astype(jnp.int64),
        kv_utilization=exact_div(used.astype(jnp.float64), total.astype(jnp.float64)),
        free_kv_blocks=instances.free_count,
        kv_tokens_in_use=used * block_size,
        kv_tokens_capacity=jnp.broadcast_to(total * block_size, used.shape),
        cache_hit_rate=jnp.where(lookups > 0, exact_div(instances.kv_hits.astype(jnp.float64),
                                                        jnp.maximum(lookups, 1).astype(jnp.float64)), 0.0),
        preemption_count=instances.preemptions,
    )


def group_blocks_cached(instances: EngineState, dims: EngineDims) -> Bool[Array, "I G PB"]:
    """Per instance, which blocks of each prefix group's shared prefix its KV hash map holds
    (a freed block keeps its content until reused). Requests share blocks only through their
    group prefix, so this is all a prefix-cache query of a not-yet-routed request can hit."""
    g = jnp.arange(dims.prefix_groups, dtype=jnp.int64)[:, None]
    j = jnp.arange(dims.prefix_blocks, dtype=jnp.int64)[None, :]
    key = g * dims.prefix_blocks + j  # kv.content_key of a shared block

    def one(gb, block_key):
        return (gb >= 0) & (block_key[jnp.maximum(gb, 0)] == key)

    return jax.vmap(one)(instances.group_block, instances.block_key)


def cached_prefix_blocks(frozen: Bool[Array, "I G PB"], req: RequestArrays, dims: EngineDims, r) -> Int64[Array, " I"]:
    """Leading full prompt blocks of request r found in each instance's (frozen) cache."""
    group = jnp.maximum(req.prefix_group[r], 0)
    n = jnp.where(req.prefix_group[r] >= 0,
                  jnp.minimum(req.shared_blocks[r], req.input_len[r] // dims.block_size), 0)
    j = jnp.arange(dims.prefix_blocks)
    hit = frozen[:, group, :] & (j < n)[None, :]
    return jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1).astype(jnp.int64)


def _route_request(cs: ClusterState, cd: ClusterDims, req: RequestArrays, r) -> sc.RouteRequest:
    dims = cd.engine
    cached = (cached_prefix_blocks(cs.cache_signal.frozen, req, dims, r) if cd.reads_prefix_cache
              else jnp.zeros(cd.num_instances, jnp.int64))
    if cd.needs_block_keys:
        j = jnp.arange(dims.blocks_per_request, dtype=jnp.int64)
        keys = kv.content_key(dims, req, r, j)
    else:
        keys = jnp.zeros(0, jnp.int64)
    return sc.RouteRequest(
        input_len=req.input_len[r], cached_prefix_blocks=cached, block_keys=keys,
        num_blocks=req.input_len[r] // dims.block_size, has_adapter=jnp.asarray(False),
        adapter_resident=jnp.zeros(cd.num_instances, bool),
    )


# ------------------------------------------------------------------------------------ the loop


def init_cluster(cd: ClusterDims, params: EngineParams, cparams: ClusterParams, req: RequestArrays, model,
                 admission: adm.AbstractAdmission, profile: sc.ScorerProfile | None, key: PRNGKeyArray,
                 snapshot_interval_us, cache_signal_delay_us) -> ClusterState:
    dims, i = cd.engine, cd.num_instances
    never = jnp.full(dims.num_requests, INF_TIME, jnp.int64)
    one = inbox.empty(init_state(dims, req, never, params.horizon_us, params.total_kv_blocks))
    instances = jax.tree.map(lambda x: jnp.broadcast_to(x, (i, *x.shape)), one)
    frozen = (group_blocks_cached(instances, dims) if cd.reads_prefix_cache else jnp.zeros((i, 1, 1), bool))
    n = dims.num_requests
    return ClusterState(
        instances=instances,
        next_request=jnp.asarray(0, jnp.int32),
        admission=admission,
        routed=jnp.zeros(i, jnp.int64),
        snapshot=dataclasses.replace(signals.init_snapshot(i), interval_us=jnp.asarray(snapshot_interval_us, jnp.int64)),
        cache_signal=signals.CacheSignal(frozen=frozen, last_us=jnp.asarray(0, jnp.int64),
                                         delay_us=jnp.asarray(cache_signal_delay_us, jnp.int64)),
        round_robin=routing.init_round_robin(),
        profile=profile,
        key=key,
        handled_by=jnp.full(n, -1, jnp.int32),
        rejected=jnp.zeros(n, bool),
        routing_rejected=jnp.zeros(n, bool),
        result=jnp.asarray(0, jnp.int32),
    )


def next_cluster_event(cs: ClusterState, cparams: ClusterParams, params: EngineParams, req: RequestArrays):
    """(request, routing time) of the next cluster event; INF_TIME when none is left before
    the horizon. Requests are in arrival order."""
    n = req.arrival.shape[0]
    r = jnp.minimum(cs.next_request, n - 1)
    t_admit = req.arrival[r] + cparams.admission_latency_us
    t_route = t_admit + cparams.routing_latency_us
    left = (cs.next_request < n) & req.valid[r] & (t_route <= params.horizon_us)
    return r, jnp.where(left, t_admit, INF_TIME), jnp.where(left, t_route, INF_TIME)


def _decide(cs: ClusterState, cd: ClusterDims, params: EngineParams, cparams: ClusterParams, req, r, t_admit,
            t_route, on):
    """Admission and routing of request r; returns the state and the target (-1: none)."""
    policy, admitted = adm.admit(cs.admission, t_admit, req.input_len[r])
    admitted = admitted & on
    live = live_signals(cs.instances, params, cd.engine.block_size)
    snapshot = signals.refresh(cs.snapshot, live, t_route, cparams.active)
    cache_signal = cs.cache_signal
    if cd.reads_prefix_cache:
        cache_signal = signals.refresh_cache_signal(cache_signal, group_blocks_cached(cs.instances, cd.engine), t_route)
    in_flight = jnp.maximum(cs.routed - cs.instances.finished, 0)
    rs = signals.router_state(snapshot, in_flight, cparams.active)
    key = jax.random.fold_in(cs.key, r)
    rr, profile = cs.round_robin, cs.profile
    if cd.routing_policy == "round-robin":
        rr, target = routing.round_robin(rr, cparams.active)
    elif cd.routing_policy == "least-loaded":
        target = routing.least_loaded(rs, key)
    elif cd.routing_policy == "always-busiest":
        target = routing.always_busiest(rs)
    else:
        cs_new = dataclasses.replace(cs, cache_signal=cache_signal)
        profile, target, _ = routing.weighted(profile, rs, _route_request(cs_new, cd, req, r), key)
    # Only a decision that happened changes router state (the body runs masked).
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(admitted, a, b), new, old)  # noqa: E731
    decided = dataclasses.replace(
        cs,
        admission=jax.tree.map(lambda a, b: jnp.where(on, a, b), policy, cs.admission),
        snapshot=keep(snapshot, cs.snapshot),
        cache_signal=keep(cache_signal, cs.cache_signal),
        round_robin=keep(rr, cs.round_robin),
        profile=keep(profile, cs.profile) if profile is not None else None,
    )
    target = jnp.where(admitted, target, -1)
    n = cs.handled_by.shape[0]
    decided = dataclasses.replace(
        decided,
        next_request=cs.next_request + on,
        rejected=decided.rejected.at[jnp.where(on & ~admitted, r, n)].set(True, mode="drop"),
        routing_rejected=decided.routing_rejected.at[jnp.where(admitted & (target < 0), r, n)].set(True, mode="drop"),
        handled_by=decided.handled_by.at[jnp.where(target >= 0, r, n)].set(target.astype(jnp.int32), mode="drop"),
        routed=decided.routed + (jnp.arange(cd.num_instances) == target),
    )
    return decided, target


def _cluster_event(cs: ClusterState, cd: ClusterDims, params: EngineParams, cparams: ClusterParams, req, model, on):
    r, t_admit, t_route = next_cluster_event(cs, cparams, params, req)
    cs, target = _decide(cs, cd, params, cparams, req, r, t_admit, t_route, on)
    enqueue_at = t_route + latency.queueing_time_us(model, req.input_len[r])
    mine = jnp.arange(cd.num_instances) == target
    instances = jax.vmap(inbox.inject, in_axes=(0, None, None, None, 0))(cs.instances, cd.engine, r, enqueue_at, mine)
    return dataclasses.replace(cs, instances=instances)


def _instances_until(cs: ClusterState, cd: ClusterDims, params, req, model, event_limit, until):
    run = jax.vmap(engine.run_until, in_axes=(None, 0, None, None, None, None, None))
    return dataclasses.replace(cs, instances=run(cd.engine, cs.instances, params, req, model, event_limit, until))


def _caught_up(cs: ClusterState, params, req, until):
    """Every instance has processed all its events before `until` (none stopped early)."""
    done = jax.vmap(engine.finished, in_axes=(0, None, None, None))(cs.instances, params, req, until)
    return jnp.all(done)


def overflowed(cs: ClusterState):
    return jnp.any((cs.instances.result & results.GROWABLE) != 0)


def finished(cs: ClusterState, cparams: ClusterParams, params: EngineParams, req: RequestArrays):
    _, _, t_route = next_cluster_event(cs, cparams, params, req)
    return ((t_route >= INF_TIME) & _caught_up(cs, params, req, INF_TIME)) | overflowed(cs)


def run_cluster(cd: ClusterDims, cs: ClusterState, params: EngineParams, cparams: ClusterParams, req, model,
                event_limit) -> ClusterState:
    """Run until the end or until some instance has counted `event_limit` events."""

    def cond(c, ops):
        params, cparams, req, _, limit = ops
        return ~finished(c, cparams, params, req) & jnp.all(c.instances.events < limit)

    def body(c, ops, on):
        params, cparams, req, model, limit = ops
        _, _, t_route = next_cluster_event(c, cparams, params, req)
        # Instance events strictly before the cluster event (cluster first at equal times).
        c = _instances_until(c, cd, params, req, model, jnp.where(on, limit, 0), t_route)
        route = on & (t_route < INF_TIME) & _caught_up(c, params, req, t_route) & ~overflowed(c)
        return _cluster_event(c, cd, params, cparams, req, model, route)

    return masked_while(cond, body, cs, (params, cparams, req, model, event_limit))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def advance(cd: ClusterDims, cs: ClusterState, params, cparams, req, model, event_limit) -> ClusterState:
    return run_cluster(cd, cs, params, cparams, req, model, event_limit)
