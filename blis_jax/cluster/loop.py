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
routing order is the arrival order). An admission policy that reads the cluster's load
(tier-shed, gaie-legacy) decides at its own event, at the admission time, before any routing
decision of the same tick. With flow control (gateway.py) the admission time is the enqueue
into the gateway queue, and requests are routed in dispatch order instead. Router-side state
(`ClusterState`): the admission policy, the in-flight counts (routed − left, always current),
the stale signal snapshot and cache signal, the routing policy state, the gateway queue, and
per request the serving instance.
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int32, Int64

from blis_jax import latency
from blis_jax.cluster import admission as adm
from blis_jax.cluster import autoscaler as asc
from blis_jax.cluster import deployments, lifecycle, routing, signals
from blis_jax.cluster import drain, scaling, timeline, warm_up
from blis_jax.cluster import gateway as gw
from blis_jax.cluster import pd as pd_rules
from blis_jax.cluster import scorers as sc
from blis_jax.cluster import transfers as xfer
from blis_jax.cluster._numerics import exact_div
from blis_jax.engine import events, inbox, kv, offload, results, transfer
from blis_jax.engine import simulate as engine
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.params import INF_TIME, EngineParams
from blis_jax.engine.state import EngineState, RequestArrays, init_state
from blis_jax.rng.go_jax import GoStream


@dataclasses.dataclass(frozen=True)
class ClusterDims:
    """Static structure of one compiled cluster program."""

    engine: EngineDims
    num_instances: int  # instance slots (a smaller active count is a mask)
    # what the routing policies read (`routing_dims`: their classes and scorer names)
    routing_reads_signals: bool = False  # the policy reads instance state (round-robin reads none)
    routing_reads_in_flight: bool = False  # ... the always-current in-flight counts
    scorers: tuple[str, ...] = ()  # weighted routing's scorer names, in profile order
    pd: bool = False  # prefill/decode pools (disaggregation); pool routing is decode-first
    prefill_scorers: tuple[str, ...] = ()  # pool scorer names (weighted pool routing); () = the policy
    decode_scorers: tuple[str, ...] = ()
    transfers: int = 1  # KV transfers in flight at once (pd)
    shared_pods: bool = False  # pd with pods in both pools: each lane's output lengths are state
    admission_reads_state: bool = False  # tier-shed / gaie-legacy: admissions are events of their own
    gateway_slots: int = 0  # flow control: gateway queue slots (0 = no flow control)
    gateway_bands: int = 1  # priority bands (distinct priorities of the workload)
    gateway_tenants: int = 1
    # the autoscaler (scaling.py): on, its models, pending actuations, log lines, node pools
    scaling: bool = False
    scaling_models: int = 1
    scaling_pending: int = 4
    scaling_log: int = 64
    scaling_pools: bool = False
    scaling_drain: bool = False  # a drain policy other than BLIS's CLI's bare drain (drain.py)
    warm_up: bool = False  # instance warm-up (warm_up.py, a BLIS library feature): W > 0
    encode: bool = False  # E/P/D encode pool or decider (encode.py): the encode step is compiled

    @property
    def flow_control(self) -> bool:
        return self.gateway_slots > 0

    @property
    def all_scorers(self) -> tuple[str, ...]:
        return self.scorers + self.prefill_scorers + self.decode_scorers

    @property
    def reads_prefix_cache(self) -> bool:
        return any(s in sc.PREFIX_SCORERS for s in self.all_scorers)

    @property
    def needs_block_keys(self) -> bool:
        return "prefix-affinity" in self.all_scorers

    @property
    def routes_ahead(self) -> bool:
        """Routing reads only router-owned state and the stale snapshots, so every arrival
        before the next snapshot or cache refresh can be routed before the instances have run
        up to it (the decisions are the same: nothing they read changes in between)."""
        # The autoscaler reads the snapshot too, and a routing build refreshes it at its own time:
        # routing ahead would stamp future refreshes with present values.
        return not (self.pd or self.admission_reads_state or self.flow_control or self.routing_reads_in_flight
                    or self.scaling)


def routing_dims(policy: routing.AbstractRouting, prefill: routing.AbstractRouting | None = None,
                 decode: routing.AbstractRouting | None = None) -> dict:
    """The `ClusterDims` fields that describe the routing policies: the cluster's, and the PD
    pools' own (None: the pool routes with the cluster's policy)."""
    return dict(routing_reads_signals=policy.reads_signals, routing_reads_in_flight=policy.reads_in_flight,
                scorers=policy.scorers, prefill_scorers=prefill.scorers if prefill is not None else (),
                decode_scorers=decode.scorers if decode is not None else ())


class ClusterParams(eqx.Module):
    """Dynamic cluster settings (changing them never recompiles)."""

    active: Bool[Array, " I"]  # instance slots that exist (the initial lifecycle without node pools)
    admission_latency_us: Int64[Array, ""]
    routing_latency_us: Int64[Array, ""]
    prefill_role: Bool[Array, " I"]  # pd: the prefill pool (its instances serve prompts only)
    decode_role: Bool[Array, " I"]  # pd: the decode pool
    pd: pd_rules.PDConfig | None  # decider and transfer settings (None without pools)
    kv_bytes_per_token: Float64[Array, ""]  # per GPU of the prefill pool's TP (transfer sizes)
    total_kv_blocks: Int64[Array, " I"]  # each slot's own (deployments.py); the engine params' is unused
    max_model_len: Int64[Array, " I"]
    gateway: gw.GatewayParams | None  # flow control (None without)
    # multi-model (blis-infra §5): model ids, -1 = a request without a model (any instance
    # serves it); a request whose model no instance serves has an id no instance has
    instance_model: Int32[Array, " I"]
    request_model: Int32[Array, " N"]
    scaling: scaling.ScalingParams | None = None  # the autoscaler (None without)
    # E/P/D (encode.py; None without an encode pool or decider): the encode pool's slots, and per
    # request whether its encode decider fires
    encode_role: Bool[Array, " I"] | None = None
    encode_fires: Bool[Array, " N"] | None = None


def eligible(cparams: ClusterParams, routable: Bool[Array, " I"], r) -> Bool[Array, " I"]:
    """The `routable` instances that may serve request r: its model is empty or theirs (a byte
    comparison: BLIS lower-cases --model, not the requests' model names)."""
    wanted = cparams.request_model[r]
    return routable & ((wanted < 0) | (cparams.instance_model == wanted))


class ClusterState(eqx.Module):
    instances: EngineState  # every leaf has a leading instance axis [I, ...]
    next_request: Int32[Array, ""]  # routing decisions made (requests in arrival order)
    next_admission: Int32[Array, ""]  # admission decisions made, when they are events of their own
    admission: adm.AbstractAdmission
    routed: Int64[Array, " I"]  # requests routed to each instance so far
    snapshot: signals.Snapshot
    cache_signal: signals.CacheSignal
    routing: routing.AbstractRouting  # the cluster's policy (with PD, of the pools without scorers of their own)
    prefill_routing: routing.AbstractRouting | None  # pd pools with their own scorers (`Weighted`); else None
    decode_routing: routing.AbstractRouting | None
    transfers: xfer.Transfers
    gateway: gw.GatewayState | None  # flow control: the gateway queue (None without)
    exits_read: Int64[Array, " I"]  # pd: completions of each instance turned into transfers
    # shared pods: the output length each lane serves each request with (0: its prefill
    # sub-request), and the prefill sub-requests routed to each lane whose transfer has not started
    out_len: Int64[Array, "I N"] | None
    prefill_pending: Int64[Array, " I"] | None
    # routing tie-breaks: BLIS's Go streams `router`, `prefill-router`, `decode-router` (blis-rng §10)
    router: GoStream
    prefill_router: GoStream
    decode_router: GoStream
    handled_by: Int32[Array, " N"]  # instance serving each request (pd: its decode instance); -1 none
    rejected: Bool[Array, " N"]  # refused by admission
    routing_rejected: Bool[Array, " N"]  # no routable instance
    lifecycle: lifecycle.Lifecycle  # per-slot instance states: the routable mask (lifecycle.py)
    scaling: scaling.ScalingState | None  # the autoscaler's ticks, actuations and log (None without)
    warm_up: warm_up.WarmUp | None  # warm-up recordings (None without)
    drain: drain.DrainState | None  # a drain policy's in-flight cuts and re-arrivals (None: bare drains)
    result: Int32[Array, ""]
    # with the autoscaler: when each slot entered each lifecycle state (timeline.py; None without)
    entered: Int64[Array, "I S"] | None = None
    # E/P/D (None without): requests whose encode decision found no routable encode instance, and
    # each request's encode decision (the chosen encode slot, the decision trace; -1 none)
    encode_rejected: Bool[Array, " N"] | None = None
    encode_by: Int32[Array, " N"] | None = None


# ---------------------------------------------------------------------------- what the router reads


def live_signals(instances: EngineState, total_kv_blocks: Int64[Array, " I"], block_size: int
                 ) -> signals.InstanceSignals:
    """Instance-reported signals from the live (stacked) engine states."""
    total = total_kv_blocks
    used = total - instances.free_count
    lookups = instances.kv_hits + instances.kv_misses
    return signals.InstanceSignals(
        queue_depth=instances.wait_len.astype(jnp.int64),
        batch_size=instances.batch_len.astype(jnp.int64),
        kv_utilization=exact_div(used.astype(jnp.float64), total.astype(jnp.float64)),
        free_kv_blocks=instances.free_count,
        kv_tokens_in_use=used * block_size,
        kv_tokens_capacity=total * block_size,
        cache_hit_rate=jnp.where(lookups > 0, exact_div(instances.kv_hits.astype(jnp.float64),
                                                        jnp.maximum(lookups, 1).astype(jnp.float64)), 0.0),
        preemption_count=instances.preemptions,
        adapter_resident=_adapter_resident(instances) if instances.lora_slot.shape[-1] else None,
    )


def _adapter_resident(instances: EngineState) -> Bool[Array, "I A"]:
    """Per instance, which LoRA adapters are loaded (engine/lora.py)."""
    a = jnp.arange(instances.lora_pins.shape[-1], dtype=jnp.int32)
    hit = (instances.lora_slot[:, :, None] == a[None, None, :]) & instances.lora_ready[:, :, None]
    return jnp.any(hit, axis=1)


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
        num_blocks=req.input_len[r] // dims.block_size, has_adapter=req.adapter[r] >= 0,
        # the router sees adapter residency through the (stale) snapshot, as BLIS's instance-reported signals
        adapter_resident=(cs.snapshot.signals.adapter_resident[:, jnp.maximum(req.adapter[r], 0)]
                          if dims.lora_slots else jnp.zeros(cd.num_instances, bool)),
    )


# ------------------------------------------------------------------------------------ the loop


def init_cluster(cd: ClusterDims, params: EngineParams, cparams: ClusterParams, req: RequestArrays, model,
                 admission: adm.AbstractAdmission, routings, streams: tuple[GoStream, GoStream, GoStream],
                 snapshot_interval_us, cache_signal_delay_us, lifecycle_state: lifecycle.Lifecycle | None = None,
                 scaling_state: scaling.ScalingState | None = None, warm_up_requests: int = 0) -> ClusterState:
    """`routings` = (the cluster's routing policy, the prefill pool's own, the decode pool's
    own); a pool's is None without scorers of its own. `lifecycle_state`: the instances'
    initial states (node pools, loading delays); None: every existing slot Active (WarmingUp
    with warm-up). `warm_up_requests`: W (used when `cd.warm_up`)."""
    dims, i = cd.engine, cd.num_instances
    never = jnp.full(dims.num_requests, INF_TIME, jnp.int64)
    def one(blocks):
        state = inbox.empty(init_state(dims, req, never, params.horizon_us, blocks))
        if dims.offload:  # each instance its own offload chain (engine/offload.py)
            state = dataclasses.replace(state, off=offload.init_state(dims, params.off))
        return state

    instances = jax.vmap(one)(cparams.total_kv_blocks)
    frozen = (group_blocks_cached(instances, dims) if cd.reads_prefix_cache else jnp.zeros((i, 1, 1), bool))
    n = dims.num_requests
    policy, prefill_routing, decode_routing = routings
    life = lifecycle_state if lifecycle_state is not None else lifecycle.all_active(
        cparams.active, warm_up.ready_state(warm_up_requests) if cd.warm_up else lifecycle.ACTIVE)
    return ClusterState(
        instances=instances,
        next_request=jnp.asarray(0, jnp.int32),
        next_admission=jnp.asarray(0, jnp.int32),
        admission=admission,
        routed=jnp.zeros(i, jnp.int64),
        snapshot=_init_snapshot(dims, i, snapshot_interval_us),
        cache_signal=signals.CacheSignal(frozen=frozen, last_us=jnp.asarray(0, jnp.int64),
                                         delay_us=jnp.asarray(cache_signal_delay_us, jnp.int64)),
        routing=policy,
        prefill_routing=prefill_routing,
        decode_routing=decode_routing,
        transfers=xfer.empty(cd.transfers, n),
        gateway=gw.empty(cd.gateway_slots, n, cd.gateway_bands) if cd.flow_control else None,
        exits_read=jnp.zeros(i, jnp.int64),
        out_len=_initial_out_len(cparams, req) if cd.shared_pods else None,
        prefill_pending=jnp.zeros(i, jnp.int64) if cd.shared_pods else None,
        router=streams[0], prefill_router=streams[1], decode_router=streams[2],
        handled_by=jnp.full(n, -1, jnp.int32),
        rejected=jnp.zeros(n, bool),
        routing_rejected=jnp.zeros(n, bool),
        lifecycle=life,
        scaling=scaling_state,
        warm_up=warm_up.empty(warm_up_requests, i, n) if cd.warm_up else None,
        drain=drain.empty(i, n) if cd.scaling and cd.scaling_drain else None,
        result=jnp.asarray(0, jnp.int32),
        entered=timeline.initial(life.state) if scaling_state is not None else None,
        encode_rejected=jnp.zeros(n, bool) if cd.encode else None,
        encode_by=jnp.full(n, -1, jnp.int32) if cd.encode else None,
    )


def _init_snapshot(dims: EngineDims, i: int, interval_us) -> signals.Snapshot:
    snapshot = dataclasses.replace(signals.init_snapshot(i), interval_us=jnp.asarray(interval_us, jnp.int64))
    if dims.lora_slots:  # nothing resident before the first read
        snapshot = dataclasses.replace(snapshot, signals=dataclasses.replace(
            snapshot.signals, adapter_resident=jnp.zeros((i, dims.lora_adapters), bool)))
    return snapshot


def _initial_out_len(cparams: ClusterParams, req: RequestArrays) -> Int64[Array, "I N"]:
    """A prefill-only instance serves prompts only; any other serves the whole request until
    routing makes it some request's prefill instance."""
    prefill_only = cparams.prefill_role & ~cparams.decode_role
    return jnp.where(prefill_only[:, None], 0, req.output_len[None, :])


def lane_output_len(cparams: ClusterParams, req: RequestArrays, cs: ClusterState | None = None
                    ) -> Int64[Array, "I N"]:
    """Output lengths as each instance sees them: a prefill sub-request has none. Without
    shared pods, a request's role on an instance follows from the instance's pool alone."""
    if cs is not None and cs.out_len is not None:
        return cs.out_len
    return jnp.where(cparams.prefill_role[:, None], 0, req.output_len[None, :])


def next_arrival(cs: ClusterState, cparams: ClusterParams, params: EngineParams, req: RequestArrays):
    """(request, admission time, routing time) of the next arrival; INF_TIME when none is left
    before the horizon. Requests are in arrival order; with flow control, the next request
    dispatched by the gateway (its admission time is then its routing time)."""
    if cs.gateway is not None:
        r, t_route = gw.next_to_route(cs.gateway, cparams.routing_latency_us)
        t_route = _by_horizon(t_route, params)
        return r, t_route, t_route
    r, t_admit, left = _arrival_cursor(cs.next_request, cparams, req)
    t_route = t_admit + cparams.routing_latency_us
    left = left & (t_route <= params.horizon_us)
    return r, jnp.where(left, t_admit, INF_TIME), jnp.where(left, t_route, INF_TIME)


def _arrival_cursor(count, cparams: ClusterParams, req: RequestArrays):
    """(request, admission time, whether it exists) of the request after the first `count`
    in arrival order."""
    n = req.arrival.shape[0]
    r = jnp.minimum(count, n - 1)
    return r, req.arrival[r] + cparams.admission_latency_us, (count < n) & req.valid[r]


def next_admission(cs: ClusterState, cparams: ClusterParams, params: EngineParams, req: RequestArrays):
    """(request, admission time) of the next admission decision of a state-reading policy;
    INF_TIME when none is left (as `next_arrival`, for requests routed before the horizon)."""
    r, t_admit, left = _arrival_cursor(cs.next_admission, cparams, req)
    left = left & (t_admit + cparams.routing_latency_us <= params.horizon_us)
    return r, jnp.where(left, t_admit, INF_TIME)


def _by_horizon(t, params: EngineParams):
    """An event time `t`, or INF_TIME when it falls after the horizon (the event never runs)."""
    return jnp.where(t <= params.horizon_us, t, INF_TIME)


def gateway_events(cs: ClusterState, cparams: ClusterParams, params: EngineParams, req: RequestArrays):
    """Flow control: (request and time of the next enqueue, slot and time of the next TTL
    expiry, time of the next dispatch tick); INF_TIME past the horizon or when none."""
    r, t_enqueue, left = _arrival_cursor(cs.next_admission, cparams, req)
    slot, t_expiry = gw.next_expiry(cs.gateway, cparams.gateway)
    return (r, jnp.where(left, _by_horizon(t_enqueue, params), INF_TIME), slot, _by_horizon(t_expiry, params),
            _by_horizon(cs.gateway.tick_at, params))


def _routing_or_transfer_time(cs: ClusterState, cparams, params, req):
    _, _, t_route = next_arrival(cs, cparams, params, req)
    _, t_done = xfer.next_done(cs.transfers)
    return jnp.minimum(t_route, _by_horizon(t_done, params))


def _gateway_time(gate):
    """The earliest of the `gateway_events` times."""
    _, t_enqueue, _, t_expiry, t_tick = gate
    return jnp.minimum(t_enqueue, jnp.minimum(t_expiry, t_tick))


def next_cluster_time(cs: ClusterState, cparams, params, req):
    t = _routing_or_transfer_time(cs, cparams, params, req)
    if cs.gateway is not None:
        t = jnp.minimum(t, _gateway_time(gateway_events(cs, cparams, params, req)))
    if cs.scaling is not None:
        t = jnp.minimum(t, jnp.minimum(*_scaling_times(cs, params)))
        if cs.scaling.node_ready is not None:
            t = jnp.minimum(t, _node_ready_time(cs, params))
        if cs.scaling.node_drain_at is not None:
            t = jnp.minimum(t, _node_drain_time(cs, params))
    if cs.drain is not None:
        t = jnp.minimum(t, _redirect_time(cs, cparams, params)[1])
    return t


def _redirect_time(cs: ClusterState, cparams: ClusterParams, params):
    """(request, routing time) of the next redirected request's re-arrival (drain.py); INF_TIME
    past the horizon or when none. Admission and routing latencies apply again."""
    r, t = drain.next_redirect(cs.drain)
    t_route = t + cparams.admission_latency_us + cparams.routing_latency_us
    return r, jnp.where((t < INF_TIME) & (t_route <= params.horizon_us), t_route, INF_TIME)


def _redirect_event(cs: ClusterState, cd: ClusterDims, params, cparams: ClusterParams, req, model, on):
    """A redirected request re-enters admission and routing (its source is Draining: not
    routable) and is injected into its new instance; its arrival time stays the original."""
    r, t_route = _redirect_time(cs, cparams, params)
    t_admit = t_route - cparams.routing_latency_us
    n = cs.handled_by.shape[0]
    cs = dataclasses.replace(cs, handled_by=cs.handled_by.at[jnp.where(on, r, n)].set(-1, mode="drop"),
                             drain=drain.pop_redirect(cs.drain, r, on))
    decided, inject_at = _decide(cs, cd, params, cparams, req, r, t_admit, t_route, on)
    decided = dataclasses.replace(decided, next_request=cs.next_request)   # not a new arrival
    enqueue_at = t_route + jax.vmap(latency.queueing_time_us, in_axes=(0, None))(model, req.input_len[r])
    mine = jnp.arange(cd.num_instances) == inject_at
    instances = jax.vmap(inbox.inject, in_axes=(0, None, None, 0, 0))(decided.instances, cd.engine, r, enqueue_at, mine)
    return dataclasses.replace(decided, instances=instances)


def _scaling_times(cs: ClusterState, params):
    """(next ScalingTick, next ScaleActuation); INF_TIME past the horizon or when none."""
    _, t_act = scaling.next_actuation(cs.scaling)
    return _by_horizon(cs.scaling.next_tick, params), _by_horizon(t_act, params)


def _node_ready_time(cs: ClusterState, params):
    """Next NodeReady event (node provisioning); INF_TIME past the horizon or when none."""
    return _by_horizon(scaling.next_node_ready(cs.scaling)[1], params)


def _node_drain_time(cs: ClusterState, params):
    """Next requested node drain; INF_TIME past the horizon or when none."""
    return _by_horizon(scaling.next_node_drain(cs.scaling)[1], params)


def collect_replicas(life: lifecycle.Lifecycle, slot_variant, seen: signals.InstanceSignals, cparams: ClusterParams,
                     block_size: int) -> asc.Replicas:
    """The tick's collect (blis-infra §4.3): the routable instances are replicas with the KV
    tokens and queue of the snapshot just refreshed (`seen`); a Loading one is pending supply
    with its configured capacity and no load."""
    return asc.Replicas(
        routable=lifecycle.routable(life), loading=life.state == lifecycle.LOADING, model=cparams.instance_model,
        variant=slot_variant, capacity_tokens=seen.kv_tokens_capacity, used_tokens=seen.kv_tokens_in_use,
        queue_depth=seen.queue_depth, pending_tokens=cparams.total_kv_blocks * block_size)


def _scaling_tick(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams, req, now, on):
    """ScalingTick: the collect reads (and refreshes) the routable instances' snapshot."""
    snapshot, _ = _cluster_router_state(cs, cd, cparams, now)
    replicas = collect_replicas(cs.lifecycle, cs.scaling.slot_variant, snapshot.signals, cparams, cd.engine.block_size)
    arrivals = cs.next_admission if (cd.admission_reads_state or cd.flow_control) else cs.next_request
    # requests are in arrival order, padding last: the cursor tells whether one is left (O(1))
    more_to_come = _arrival_cursor(arrivals, cparams, req)[2] | (jnp.sum(_in_flight(cs)) > 0)
    if cs.drain is not None:  # redirected requests are pending arrivals
        more_to_come = more_to_come | (drain.pending(cs.drain) > 0)
    ss = scaling.tick(cs.scaling, cparams.scaling, replicas, cd.scaling_models, now, more_to_come, on)
    return dataclasses.replace(cs, scaling=ss, snapshot=jax.tree.map(lambda a, b: jnp.where(on, a, b), snapshot,
                                                                      cs.snapshot))


def _scale_actuation(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams, req, now, on):
    ss, life = scaling.actuate(cs.scaling, cparams.scaling, cs.lifecycle, cparams.instance_model,
                               cs.instances.events, cd.scaling_models, cd.scaling_pools, now, on, _ready(cs))
    if cs.drain is not None:   # the drain policy acts on the instances drained now
        drained = on & (life.state == lifecycle.DRAINING) & (cs.lifecycle.state != lifecycle.DRAINING)
        ds, life, instances = drain.apply(cs.drain, cparams.scaling.drain_policy, life, cs.instances, cd.engine, req,
                                          drained, scaling.byte_order_rank(ss, cparams.scaling), now)
        cs = dataclasses.replace(cs, drain=ds, instances=instances)
    return dataclasses.replace(cs, scaling=ss, lifecycle=life)


def _ready(cs: ClusterState):
    """The state an instance enters instead of Active (WarmingUp with warm-up)."""
    return lifecycle.ACTIVE if cs.warm_up is None else warm_up.ready_state(cs.warm_up.requests)


def _decide(cs: ClusterState, cd: ClusterDims, params: EngineParams, cparams: ClusterParams, req, r, t_admit,
            t_route, on):
    """Admission and routing of request r. Returns (state, instance to inject it into now: its
    serving instance, or with disaggregation its prefill instance; -1 when rejected)."""
    if cd.admission_reads_state:  # decided at its own event (`_admission_event`)
        admission, admitted = cs.admission, ~cs.rejected[r]
    elif cd.flow_control:  # the gateway queue admitted and dispatched it
        admission, admitted = cs.admission, jnp.asarray(True)
    else:
        admission, admitted = adm.admit(cs.admission, t_admit, req.input_len[r])
    admitted = admitted & on
    live = live_signals(cs.instances, cparams.total_kv_blocks, cd.engine.block_size)
    # A RouterState build re-reads the stale signals of the instances it covers: all of them,
    # or with PD pools the decode pool (then the prefill pool, for a disaggregated request).
    # Without PD pools it covers only the routable instances that serve the request's model (§5.2).
    routable = lifecycle.routable(cs.lifecycle)
    covered = routable & cparams.decode_role if cd.pd else eligible(cparams, routable, r)
    if cd.encode:  # encode instances serve nothing: never in normal routing (PD pools exclude them already)
        covered = covered & ~cparams.encode_role
        encode_pool = routable & cparams.encode_role
        fire = admitted & cparams.encode_fires[r]  # an encode decision (and its RouterState build) happens
        before = signals.refresh(cs.snapshot, live, t_route, encode_pool & fire)
    else:
        before = cs.snapshot
    snapshot = signals.refresh(before, live, t_route, covered)
    cache_signal = cs.cache_signal
    if cd.reads_prefix_cache:
        cache_signal = signals.refresh_cache_signal(cache_signal, group_blocks_cached(cs.instances, cd.engine), t_route)
    in_flight = _in_flight(cs)
    route_req = _route_request(dataclasses.replace(cs, cache_signal=cache_signal, snapshot=snapshot), cd, req, r)
    when = lambda flag, new, old: jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)  # noqa: E731
    prefill_routing, decode_routing = cs.prefill_routing, cs.decode_routing
    prefill_router, decode_router = cs.prefill_router, cs.decode_router
    main_routing, main_router, routes_on = cs.routing, cs.router, admitted
    if cd.encode:
        # E/P/D: the encode decision comes first (a judgment, not read in BLIS's code: the
        # encoder's output is the prefill's input, so E precedes P/D; with an empty encode pool
        # the request goes no further), with the main policy and the `router` stream (blis-rng
        # §10.2): it advances the round-robin counter / draws a tie-break, shifting the later
        # decisions. It takes zero time and creates no sub-request (§3.10), so nothing is
        # injected and the in-flight counts do not move.
        new, encode_target, drawn = cs.routing.route(signals.router_state(snapshot, in_flight, encode_pool),
                                                     route_req, cs.router)
        chose = fire & (encode_target >= 0)
        main_routing, main_router = when(chose, new, cs.routing), when(chose, drawn, cs.router)
        encode_rejected = fire & (encode_target < 0)
        routes_on = admitted & ~encode_rejected
    if not cd.pd:
        rs = signals.router_state(snapshot, in_flight, covered)
        policy, target, router = main_routing.route(rs, route_req, main_router)
        disaggregated, prefill = jnp.asarray(False), jnp.asarray(-1, jnp.int64)
    else:
        # llm-d decode-first: the decode pod, the decider, then (maybe) the prefill pod. A pool
        # without scorers of its own routes with the cluster's policy and draws from `router`
        # (one policy state: with round-robin both choices advance one shared counter); a pool
        # with its own scorers routes with its own policy and draws from its own stream.
        rs = signals.router_state(snapshot, in_flight, routable & cparams.decode_role)
        if cs.decode_routing is not None:
            decode_routing, target, decode_router = cs.decode_routing.route(rs, route_req, cs.decode_router)
            policy, router = main_routing, main_router
        else:
            policy, target, router = main_routing.route(rs, route_req, main_router)
        cached = route_req.cached_prefix_blocks[jnp.maximum(target, 0)]
        disaggregated = (target >= 0) & pd_rules.disaggregate(cparams.pd, req.input_len[r], cached,
                                                               cd.engine.block_size)
        snapshot = when(disaggregated, signals.refresh(snapshot, live, t_route, routable & cparams.prefill_role),
                        snapshot)
        rs_p = signals.router_state(snapshot, in_flight, routable & cparams.prefill_role)
        # The prefill pick (and its draw) happens only for a disaggregated request.
        if cs.prefill_routing is not None:
            new, prefill, drawn = cs.prefill_routing.route(rs_p, route_req, cs.prefill_router)
            prefill_routing = when(disaggregated, new, prefill_routing)
            prefill_router = when(disaggregated, drawn, prefill_router)
        else:
            new, prefill, drawn = policy.route(rs_p, route_req, router)
            policy, router = when(disaggregated, new, policy), when(disaggregated, drawn, router)
        disaggregated = disaggregated & (prefill >= 0)
    # Only a decision that happened changes router state (the body runs masked); a request
    # that no routable instance serves is rejected before the policy runs (no draw, no count).
    keep = functools.partial(when, routes_on & jnp.any(covered))
    decided = dataclasses.replace(
        cs,
        admission=when(on, admission, cs.admission),
        snapshot=keep(snapshot, before),
        cache_signal=(keep(cache_signal, cs.cache_signal) if not cd.encode else
                      when((routes_on & jnp.any(covered)) | fire, cache_signal, cs.cache_signal)),
        routing=keep(policy, main_routing),
        prefill_routing=keep(prefill_routing, cs.prefill_routing),
        decode_routing=keep(decode_routing, cs.decode_routing),
        router=keep(router, main_router),
        prefill_router=keep(prefill_router, cs.prefill_router),
        decode_router=keep(decode_router, cs.decode_router),
    )
    target = jnp.where(routes_on, target, -1)
    disaggregated = routes_on & disaggregated
    n = cs.handled_by.shape[0]
    if cd.encode:
        decided = dataclasses.replace(
            decided,
            encode_rejected=decided.encode_rejected.at[jnp.where(encode_rejected, r, n)].set(True, mode="drop"),
            encode_by=decided.encode_by.at[jnp.where(chose, r, n)].set(encode_target.astype(jnp.int32), mode="drop"))
    slots = jnp.arange(cd.num_instances)
    tr = decided.transfers
    tr = dataclasses.replace(
        tr,
        decode_target=tr.decode_target.at[jnp.where(disaggregated, r, n)].set(target.astype(jnp.int32), mode="drop"),
        prefill_by=tr.prefill_by.at[jnp.where(disaggregated, r, n)].set(prefill.astype(jnp.int32), mode="drop"),
    )
    if cd.shared_pods:  # the prefill instance serves r's prompt only
        decided = dataclasses.replace(
            decided, out_len=decided.out_len.at[jnp.where(disaggregated, prefill, cd.num_instances), r].set(
                0, mode="drop"),
            prefill_pending=decided.prefill_pending + (disaggregated & (slots == prefill)))
    decided = dataclasses.replace(
        decided,
        transfers=tr,
        next_request=cs.next_request + on,
        rejected=decided.rejected.at[jnp.where(on & ~admitted, r, n)].set(True, mode="drop"),
        routing_rejected=decided.routing_rejected.at[jnp.where(routes_on & (target < 0), r, n)].set(True, mode="drop"),
        handled_by=decided.handled_by.at[jnp.where(target >= 0, r, n)].set(target.astype(jnp.int32), mode="drop"),
        routed=decided.routed + (slots == target) + (disaggregated & (slots == prefill)),
    )
    if cd.warm_up:  # a warm-up request of its instance (never a disaggregated one, §2.5)
        decided = dataclasses.replace(decided, warm_up=warm_up.record(decided.warm_up, target, r,
                                                                      (target >= 0) & ~disaggregated))
    return decided, jnp.where(disaggregated, prefill, target)


def _admission_event(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams, req, r, t_admit, on):
    """AdmissionDecision of request r (a state-reading policy): a RouterState build at the
    admission time over every routable instance (refreshing the stale snapshot, as a routing
    build does)."""
    snapshot, rs = _cluster_router_state(cs, cd, cparams, t_admit, eligible(cparams, lifecycle.routable(cs.lifecycle), r))
    policy, admitted = adm.admit(cs.admission, t_admit, req.input_len[r], adm.cluster_priority(req.priority[r]), rs)
    n = cs.rejected.shape[0]
    return dataclasses.replace(
        cs,
        admission=jax.tree.map(lambda a, b: jnp.where(on, a, b), policy, cs.admission),
        snapshot=jax.tree.map(lambda a, b: jnp.where(on, a, b), snapshot, cs.snapshot),
        rejected=cs.rejected.at[jnp.where(on & ~admitted, r, n)].set(True, mode="drop"),
        next_admission=cs.next_admission + on,
    )


def _cluster_router_state(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams, now, covered=None):
    """(refreshed snapshot, RouterState) of a RouterState build at `now` over `covered`
    (default: every routable instance), outside routing (admission sees the instances that
    serve the request's model, gateway dispatch all): it refreshes the stale snapshot as a
    routing build does."""
    live = live_signals(cs.instances, cparams.total_kv_blocks, cd.engine.block_size)
    covered = lifecycle.routable(cs.lifecycle) if covered is None else covered
    snapshot = signals.refresh(cs.snapshot, live, now, covered)
    return snapshot, signals.router_state(snapshot, _in_flight(cs), covered)


def _in_flight(cs: ClusterState) -> Int64[Array, " I"]:
    """Router-owned in-flight requests per instance: routed there and not yet gone (less what a
    drain policy took away, drain.py)."""
    cut = 0 if cs.drain is None else cs.drain.in_flight_cut
    return jnp.maximum(cs.routed - cs.instances.finished - cut, 0)


# ----------------------------------------------------------------------- flow control (gateway.py)


def _gateway_dispatch(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams, now, on):
    snapshot, rs = _cluster_router_state(cs, cd, cparams, now)
    return dataclasses.replace(
        cs, gateway=gw.dispatch(cs.gateway, cparams.gateway, rs, now, on, cd.gateway_tenants),
        snapshot=jax.tree.map(lambda a, b: jnp.where(on, a, b), snapshot, cs.snapshot))


def _gateway_enqueue_event(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams, r, now, on):
    """Request r reaches the gateway (its admission time): queued or refused, then one
    dispatch attempt, and a tick pending while the queue is non-empty."""
    cs = dataclasses.replace(cs, gateway=gw.enqueue(cs.gateway, cparams.gateway, r, now, on),
                             next_admission=cs.next_admission + on)
    cs = _gateway_dispatch(cs, cd, cparams, now, on)
    return dataclasses.replace(cs, gateway=gw.schedule_tick(cs.gateway, cparams.gateway, now, on))


def _gateway_tick_event(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams, now, on):
    cs = _gateway_dispatch(cs, cd, cparams, now, on)
    return dataclasses.replace(cs, gateway=gw.schedule_tick(cs.gateway, cparams.gateway, now, on, after_tick=True))


def _arrival_event(cs: ClusterState, cd: ClusterDims, params: EngineParams, cparams: ClusterParams, req, model, on):
    r, t_admit, t_route = next_arrival(cs, cparams, params, req)
    cs, inject_at = _decide(cs, cd, params, cparams, req, r, t_admit, t_route, on)
    if cs.gateway is not None:
        cs = dataclasses.replace(cs, gateway=gw.routed(cs.gateway, on))
    # the arrival → enqueue delay of the instance that receives the request (its own alpha)
    enqueue_at = t_route + jax.vmap(latency.queueing_time_us, in_axes=(0, None))(model, req.input_len[r])
    mine = jnp.arange(cd.num_instances) == inject_at
    instances = jax.vmap(inbox.inject, in_axes=(0, None, None, 0, 0))(cs.instances, cd.engine, r, enqueue_at, mine)
    return dataclasses.replace(cs, instances=instances)


def _transfer_done(cs: ClusterState, cd: ClusterDims, req, on):
    """KVTransferCompleted: the decode sub-request enqueues on its decode instance now."""
    entry, now = xfer.next_done(cs.transfers)
    r, decode = cs.transfers.request[entry], cs.transfers.decode[entry]
    mine = on & (jnp.arange(cd.num_instances) == decode)
    instances = jax.vmap(inbox.inject, in_axes=(0, None, None, None, 0))(cs.instances, cd.engine, r, now, mine)
    cs = dataclasses.replace(cs, instances=instances, transfers=xfer.finish(cs.transfers, entry, on))
    if cd.shared_pods:  # the decode sub-request (on a shared pod, maybe its prefill's)
        cs = dataclasses.replace(cs, out_len=cs.out_len.at[jnp.where(on, decode, cd.num_instances), r].set(
            req.output_len[r], mode="drop"))
    return cs


def _start_transfers(cs: ClusterState, cd: ClusterDims, params, cparams: ClusterParams, req, now, on):
    """KVTransferStarted for every prefill completed at `now`, in instance then batch order."""
    e = cd.engine.exit_log

    def pending(c):
        return cparams.prefill_role & (c.exits_read < c.instances.exit_count)

    def more(c, ops):
        return ops[-1] & jnp.any(pending(c))

    def body(c, ops, on):
        _, cparams, req, now, _ = ops
        i = jnp.argmax(pending(c))
        r = c.instances.exit_req[i, c.exits_read[i] % e]
        overrun = on & (c.instances.exit_count[i] - c.exits_read[i] > e)
        c = dataclasses.replace(c, exits_read=c.exits_read.at[jnp.where(on, i, cd.num_instances)].add(1, mode="drop"))
        if cd.shared_pods:  # a shared pod also completes whole requests (with no output: logged too)
            tr = c.transfers
            on = on & (tr.prefill_by[r] == i) & (tr.start_us[r] < 0) & ~tr.dropped[r]
        decode = c.transfers.decode_target[r]
        lane = on & (jnp.arange(cd.num_instances) == decode)
        instances, reserved = jax.vmap(transfer.reserve, in_axes=(0, None, None, None, 0, 0))(
            c.instances, cd.engine, req, r, lane, cparams.total_kv_blocks)
        reserved = jnp.any(reserved & lane)
        duration = pd_rules.transfer_time_us(cparams.pd, req.input_len[r], cd.engine.block_size,
                                             cparams.kv_bytes_per_token, xfer.in_flight(c.transfers) + 1)
        active = xfer.in_flight(c.transfers) + 1
        inst = c.instances
        tr, full = xfer.start(c.transfers, r, decode, now, duration, reserved, on, active,
                              (inst.out_sched_delay[i, r], inst.out_ttft[i, r], inst.out_e2e[i, r]))
        if cd.shared_pods:
            c = dataclasses.replace(c, prefill_pending=c.prefill_pending.at[
                jnp.where(on, i, cd.num_instances)].add(-1, mode="drop"))
        return dataclasses.replace(
            c, instances=instances, transfers=tr,
            result=c.result | jnp.where(full | overrun, results.TRANSFERS_FULL, 0).astype(jnp.int32),
        )

    return masked_while(more, body, cs, (params, cparams, req, now, on))


def _instances_until(cs: ClusterState, cd: ClusterDims, lparams, req, out_len, model, limits, until):
    """Every instance through its events before `until[i]`; `limits[i]` caps its event count.
    `lparams` and `model` are per slot (leading instance axis)."""

    def one(state, params, model, output_len, limit, until):
        lane_req = dataclasses.replace(req, output_len=output_len)
        return engine.run_until(cd.engine, state, params, lane_req, model, limit, until)

    return dataclasses.replace(cs, instances=jax.vmap(one)(cs.instances, lparams, model, out_len, limits, until))


def _caught_up(cs: ClusterState, params, req, out_len, until):
    """Every instance has processed all its events before `until[i]`."""

    def one(state, output_len, until):
        return engine.finished(state, params, dataclasses.replace(req, output_len=output_len), until)

    return jnp.all(jax.vmap(one)(cs.instances, out_len, jnp.broadcast_to(until, out_len.shape[:1])))


def _prefill_lanes(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams) -> Bool[Array, " I"]:
    """Instances whose next event may complete a prefill sub-request: the prefill-only ones,
    and shared pods holding prefill sub-requests whose transfer has not started (a shared pod
    without one runs freely between cluster events)."""
    if not cd.shared_pods:
        return cparams.prefill_role
    return (cparams.prefill_role & ~cparams.decode_role) | (cparams.prefill_role & (cs.prefill_pending > 0))


def _next_prefill_time(cs: ClusterState, cparams: ClusterParams, params, req, out_len, lanes):
    """Earliest event of a prefill lane (`_prefill_lanes`): the earliest moment a transfer can start."""

    def one(state, output_len):
        return events.next_event(state, dataclasses.replace(req, output_len=output_len))[1]

    t = jax.vmap(one)(cs.instances, out_len)
    return _by_horizon(jnp.min(jnp.where(lanes, t, INF_TIME)), params)


def _refresh_due(cs: ClusterState, cd: ClusterDims, cparams: ClusterParams):
    """Earliest routing time at which a decision could differ from one taken now: a signal
    re-read (INF_TIME for a policy that reads none: round-robin), or an instance becoming
    routable (an InstanceLoaded event)."""
    loaded = lifecycle.next_loaded(cs.lifecycle)
    if cs.scaling is not None:
        _, t_act = scaling.next_actuation(cs.scaling)
        loaded = jnp.minimum(loaded, t_act)
        if cd.routing_reads_signals:
            loaded = jnp.minimum(loaded, cs.scaling.next_tick)
    if not cd.routing_reads_signals:
        return loaded
    snap = cs.snapshot
    due = jnp.minimum(loaded, jnp.min(jnp.where(lifecycle.routable(cs.lifecycle), snap.last_refresh + snap.interval_us,
                                                 INF_TIME)))
    if cd.reads_prefix_cache:
        due = jnp.minimum(due, cs.cache_signal.last_us + cs.cache_signal.delay_us)
    return due


def _route_ahead(cs: ClusterState, cd: ClusterDims, params, cparams: ClusterParams, req, model, on):
    """Route every further arrival before the next refresh (see `ClusterDims.routes_ahead`)."""
    due = _refresh_due(cs, cd, cparams)

    def more(c, ops):
        params, cparams, req, _, due, on = ops
        _, _, t_route = next_arrival(c, cparams, params, req)
        return on & (t_route < due) & (t_route < INF_TIME)

    def body(c, ops, active):
        params, cparams, req, model, _, _ = ops
        return _arrival_event(c, cd, params, cparams, req, model, active)

    return masked_while(more, body, cs, (params, cparams, req, model, due, on))


def overflowed(cs: ClusterState):
    full = cs.gateway.full if cs.gateway is not None else False
    return (jnp.any((cs.instances.result & results.growable(cs.instances)) != 0) | (cs.result != 0) | full
            | scaling.overflowed(cs.scaling))


def finished(cs: ClusterState, cparams: ClusterParams, params: EngineParams, req: RequestArrays, out_len=None):
    """Nothing left before the horizon (or a buffer overflowed). `out_len`: the loop's
    `lane_output_len`, passed in so the loop does not rebuild an [I, N] array per iteration."""
    out_len = lane_output_len(cparams, req, cs) if out_len is None else out_len
    return (((next_cluster_time(cs, cparams, params, req) >= INF_TIME)
             & _caught_up(cs, params, req, out_len, jnp.int64(INF_TIME))) | overflowed(cs))


def run_cluster(cd: ClusterDims, cs: ClusterState, params: EngineParams, cparams: ClusterParams, req, model,
                event_limit) -> ClusterState:
    """Run until the end or until some instance has counted `event_limit` events (a scalar, or one
    limit per instance slot).

    Each iteration: the instances run up to the next cluster event (cluster events go first at
    equal times), then that event runs. With PD pools, a prefill instance's step can start a
    transfer (a cluster event at that step's tick), so the instances first run only up to the
    earliest prefill-lane event (`_prefill_lanes`); if that comes first, those lanes run that
    tick alone and the transfers it starts are processed before anything later.

    `model` holds every slot's latency model (leaves with a leading instance axis, see
    deployments.py); `params` the cluster-wide engine settings, whose KV blocks and
    max-model-len each slot takes from `cparams` instead.
    """
    static_out_len = None if cs.out_len is not None else lane_output_len(cparams, req)
    lparams = deployments.lane_params(params, cparams.total_kv_blocks, cparams.max_model_len)

    def cond(c, ops):
        params, _, cparams, req, out_len, _, limit = ops
        out_len = lane_output_len(cparams, req, c) if out_len is None else out_len
        return ~finished(c, cparams, params, req, out_len) & jnp.all(c.instances.events < limit)

    def body(c, ops, on):
        params, lparams, cparams, req, out_len, model, limit = ops
        out_len = lane_output_len(cparams, req, c) if out_len is None else out_len
        before = c.lifecycle.state
        t_cluster = _routing_or_transfer_time(c, cparams, params, req)
        # InstanceLoaded events (past the horizon: never executed)
        t_loaded = lifecycle.next_loaded(c.lifecycle)
        t_loaded = _by_horizon(t_loaded, params)
        t_cluster = jnp.minimum(t_cluster, t_loaded)
        if cd.scaling:
            t_scaling_tick, t_act = _scaling_times(c, params)
            t_cluster = jnp.minimum(t_cluster, jnp.minimum(t_scaling_tick, t_act))
        node_events = cd.scaling and c.scaling.node_ready is not None   # node provisioning
        if node_events:
            t_node_ready = _node_ready_time(c, params)
            t_cluster = jnp.minimum(t_cluster, t_node_ready)
        node_drains = cd.scaling and c.scaling.node_drain_at is not None   # ClusterConfig.node_drains
        if node_drains:
            t_node_drain = _node_drain_time(c, params)
            t_cluster = jnp.minimum(t_cluster, t_node_drain)
        redirects = cd.scaling and cd.scaling_drain
        if redirects:
            t_redirect = _redirect_time(c, cparams, params)[1]
            t_cluster = jnp.minimum(t_cluster, t_redirect)
        if cd.admission_reads_state:
            r_admission, t_admission = next_admission(c, cparams, params, req)
            t_cluster = jnp.minimum(t_cluster, t_admission)
        if cd.flow_control:
            # the gateway changes only at cluster events, and at most one of its own events runs
            # per iteration (routing pops only the dispatched ring): read it once
            r_enqueue, t_enqueue, expiry_slot, t_expiry, t_tick = gate = gateway_events(c, cparams, params, req)
            t_cluster = jnp.minimum(t_cluster, _gateway_time(gate))
        lanes = _prefill_lanes(c, cd, cparams) if cd.pd else None
        t_prefill = _next_prefill_time(c, cparams, params, req, out_len, lanes) if cd.pd else INF_TIME
        # A prefill tick first: the prefill lanes run that tick (their earlier events are none),
        # the others only up to it; else everyone runs up to the cluster event.
        prefill_tick = t_prefill < t_cluster
        until = jnp.minimum(t_cluster, t_prefill) + (prefill_tick & (lanes if cd.pd else cparams.prefill_role))
        c = _instances_until(c, cd, lparams, req, out_len, model, jnp.broadcast_to(jnp.where(on, limit, 0), (cd.num_instances,)),
                             until)
        caught = on & _caught_up(c, params, req, out_len, until) & ~overflowed(c)
        if cd.pd:
            c = _start_transfers(c, cd, params, cparams, req, t_prefill, caught & prefill_tick)
        go = caught & ~prefill_tick & (t_cluster < INF_TIME)
        if cd.warm_up:  # the completions so far end warm-ups (before this cluster event reads states)
            c = dataclasses.replace(c, lifecycle=warm_up.promote(
                c.lifecycle, c.warm_up, warm_up.completed(c.instances), caught))
        if cd.scaling:  # a drained instance whose queue and batch emptied is terminated
            c = dataclasses.replace(c, lifecycle=scaling.terminate_drained(
                c.scaling, c.lifecycle, c.instances.wait_len, c.instances.batch_len, c.instances.events, caught))
        # same-tick order (BLIS's event priorities): node ready -2, instance loaded -1, admission 1,
        # routing 2, TTL expiry and transfer completion 6, dispatch tick 7, scaling tick 8, actuation 9
        if node_events:
            is_node_ready = t_node_ready <= t_cluster
            ss, life = scaling.node_ready_event(c.scaling, cparams.scaling, c.lifecycle, t_node_ready,
                                                go & is_node_ready, _ready(c))
            c = dataclasses.replace(c, scaling=ss, lifecycle=life)
            go = go & ~is_node_ready
        if node_drains:
            is_node_drain = t_node_drain <= t_cluster
            c = dataclasses.replace(c, scaling=scaling.node_drain_event(c.scaling, t_node_drain, go & is_node_drain))
            go = go & ~is_node_drain
        is_loaded = t_loaded <= t_cluster
        c = dataclasses.replace(c, lifecycle=lifecycle.load(c.lifecycle, t_loaded, go & is_loaded, _ready(c)))
        go = go & ~is_loaded
        if cd.admission_reads_state:
            is_admission = t_admission <= t_cluster
            c = _admission_event(c, cd, cparams, req, r_admission, t_admission, go & is_admission)
            go = go & ~is_admission
        if cd.flow_control:
            is_enqueue = t_enqueue <= t_cluster
            c = _gateway_enqueue_event(c, cd, cparams, r_enqueue, t_enqueue, go & is_enqueue)
            go = go & ~is_enqueue
        _, _, t_route = next_arrival(c, cparams, params, req)
        is_arrival = t_route <= t_cluster
        c = _arrival_event(c, cd, params, cparams, req, model, go & is_arrival)
        if cd.routes_ahead:
            c = _route_ahead(c, cd, params, cparams, req, model, go & is_arrival)
        go = go & ~is_arrival
        if redirects:  # after the original arrivals routed at the same time (pushed earlier)
            is_redirect = t_redirect <= t_cluster
            c = _redirect_event(c, cd, params, cparams, req, model, go & is_redirect)
            go = go & ~is_redirect
        if cd.flow_control:
            is_expiry = t_expiry <= t_cluster
            c = dataclasses.replace(c, gateway=gw.expire(c.gateway, expiry_slot, go & is_expiry))
            go = go & ~is_expiry
        if cd.pd:
            _, t_done = xfer.next_done(c.transfers)
            is_done = t_done <= t_cluster
            c = _transfer_done(c, cd, req, go & is_done)
            go = go & ~is_done
        if cd.flow_control:
            is_dispatch = t_tick <= t_cluster
            c = _gateway_tick_event(c, cd, cparams, t_tick, go & is_dispatch)
            go = go & ~is_dispatch
        if cd.scaling:
            is_scaling_tick = t_scaling_tick <= t_cluster
            c = _scaling_tick(c, cd, cparams, req, t_scaling_tick, go & is_scaling_tick)
            go = go & ~is_scaling_tick
            c = _scale_actuation(c, cd, cparams, req, t_act, go & (t_act <= t_cluster))
            # the iteration's transitions happened at its cluster event (a drained instance that
            # empties after the last one: at its own clock, which an idle one has left behind)
            now = jnp.where(t_cluster < INF_TIME, t_cluster, jnp.maximum(c.instances.now, jnp.max(c.entered, axis=1)))
            c = dataclasses.replace(c, entered=timeline.record(c.entered, before, c.lifecycle.state, now))
            if node_drains:   # NodeDrained once a Draining node's GPUs are all released (here or by a drain)
                # after the last cluster event: when the last instance terminated here did
                ended = (c.lifecycle.state == lifecycle.TERMINATED) & (before != lifecycle.TERMINATED)
                at = jnp.where(t_cluster < INF_TIME, t_cluster, jnp.max(jnp.where(ended, now, 0)))
                c = dataclasses.replace(c, scaling=scaling.nodes_drained(c.scaling, c.lifecycle, cparams.scaling, at,
                                                                         caught))
        return c

    return masked_while(cond, body, cs, (params, lparams, cparams, req, static_out_len, model, event_limit))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def advance(cd: ClusterDims, cs: ClusterState, params, cparams, req, model, event_limit) -> ClusterState:
    return run_cluster(cd, cs, params, cparams, req, model, event_limit)
