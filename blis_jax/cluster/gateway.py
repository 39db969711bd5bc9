"""Flow control: the gateway queue between admission and routing (blis-features §3.4).

With `--flow-control` the queue is the admission policy. A request arriving at the admission
time is enqueued, or refused:

* rejected when its priority band already holds `--per-band-capacity` requests (0 = no limit);
* when the queue holds `--max-gateway-queue-depth` requests (0 = no limit): rejected, or with
  `--queue-shedding` the least valuable queued sheddable request (lowest priority, then the
  newest) is shed to make room if the newcomer's priority is higher, else it is rejected.

Dispatch runs after every enqueue and at a dispatch tick every `--dispatch-tick-interval` µs
while the queue is non-empty; each run dispatches at most one request, which is routed
`--routing-latency` later. It reads a fresh RouterState (late binding) for the saturation s:
`never` 0; `utilization` the mean over routable instances of max(queue depth /
`--queue-depth-threshold`, KV utilization / `--kv-cache-util-threshold`); `concurrency` the
in-flight requests over (routable instances x `--max-concurrency`); 1 with no routable
instance. Bands are the priorities present in the workload, highest first; band i of n may
dispatch only while s < 1 - i (1 - `--usage-limit-threshold`) / (n - 1) (all 1 by default),
and the first band whose ceiling is reached stops the dispatch, so bands are strictly
prioritised. Inside the chosen band the fairness policy picks a tenant's flow:
`global-strict` the flow whose head is the oldest, `round-robin` the next tenant after the
one served last (tenant ids sorted; the empty tenant is "default"). Inside the flow,
`--dispatch-order fifo` and `priority` take the oldest, `slo-deadline` the earliest enqueue
time + SLO target (the request's slo_target_us, else `--slo-targets` of its class, else none).
`--request-ttl` µs after its enqueue a request still queued expires.

Outcomes are terminal buckets of their own (rejected, shed, expired, still queued at the
end); `gateway_queue_delay` = dispatch - enqueue. The queue holds request indices in a fixed
number of slots (a full one is an overflow result, regrown by the driver), so per-event work
grows with the queue's capacity, not with the number of requests.

Not modelled: in-flight eviction (`--in-flight-eviction`) and tenant budgets.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float64, Int8, Int32, Int64

from blis_jax.cluster import signals
from blis_jax.cluster._numerics import exact_div
from blis_jax.cluster.admission import saturation as utilization_saturation
from blis_jax.engine.params import INF_TIME
from blis_jax.errors import ConfigError

DISPATCH_ORDERS = ("fifo", "priority", "slo-deadline")
FAIRNESS_POLICIES = ("global-strict", "round-robin")
SATURATION_DETECTORS = ("never", "utilization", "concurrency")

# per-request gateway outcome
NOT_SEEN, QUEUED, DISPATCHED, REJECTED, SHED, EXPIRED = 0, 1, 2, 3, 4, 5


class GatewayParams(eqx.Module):
    """Flow-control settings and per-request keys, all arrays: changing any of them, the
    policies included, never recompiles."""

    order: Int32[Array, ""]  # index in DISPATCH_ORDERS
    fairness: Int32[Array, ""]  # index in FAIRNESS_POLICIES
    detector: Int32[Array, ""]  # index in SATURATION_DETECTORS
    max_depth: Int64[Array, ""]  # 0 = unlimited
    per_band_capacity: Int64[Array, ""]  # 0 = unlimited
    shedding: Bool[Array, ""]
    usage_limit: Float64[Array, ""]
    qd_threshold: Float64[Array, ""]
    kv_threshold: Float64[Array, ""]
    max_concurrency: Float64[Array, ""]
    ttl_us: Int64[Array, ""]  # 0 = none
    tick_us: Int64[Array, ""]
    num_bands: Int64[Array, ""]  # distinct priorities in the workload
    band_of: Int32[Array, " N"]  # 0 = the highest priority
    band_priority: Int64[Array, " B"]  # cluster priority of each band
    tenant_of: Int32[Array, " N"]  # rank of the tenant id (sorted)
    slo_target_us: Int64[Array, " N"]  # INF_TIME = none


class GatewayState(eqx.Module):
    queue: Int32[Array, " Q"]  # request index per slot, -1 = free
    outcome: Int8[Array, " N"]
    enqueued_us: Int64[Array, " N"]
    dispatched_us: Int64[Array, " N"]
    tick_at: Int64[Array, ""]  # next dispatch tick (INF_TIME: none scheduled)
    last_tenant: Int32[Array, " B"]  # round-robin: tenant served last per band (-1: none)
    # dispatched requests awaiting their routing decision, in dispatch order (a ring)
    to_route: Int32[Array, " Q"]
    route_head: Int64[Array, ""]
    route_tail: Int64[Array, ""]
    full: Bool[Array, ""]  # a queue or ring slot was needed and none was free


def empty(slots: int, num_requests: int, bands: int) -> GatewayState:
    n = num_requests
    return GatewayState(
        queue=jnp.full(slots, -1, jnp.int32), outcome=jnp.zeros(n, jnp.int8),
        enqueued_us=jnp.full(n, -1, jnp.int64), dispatched_us=jnp.full(n, -1, jnp.int64),
        tick_at=jnp.asarray(INF_TIME, jnp.int64), last_tenant=jnp.full(bands, -1, jnp.int32),
        to_route=jnp.full(slots, -1, jnp.int32), route_head=jnp.asarray(0, jnp.int64),
        route_tail=jnp.asarray(0, jnp.int64), full=jnp.asarray(False),
    )


def depth(gs: GatewayState) -> Int64[Array, ""]:
    return jnp.sum(gs.queue >= 0).astype(jnp.int64)


# ----------------------------------------------------------------------------------- enqueue


def enqueue(gs: GatewayState, gp: GatewayParams, r, now, on) -> GatewayState:
    """Request r reaches the gateway at `now`: queued, rejected, or queued after shedding."""
    valid = gs.queue >= 0
    entry = jnp.maximum(gs.queue, 0)
    band = gp.band_of[r]
    band_full = (gp.per_band_capacity > 0) & (jnp.sum(valid & (gp.band_of[entry] == band)) >= gp.per_band_capacity)
    queue_full = (gp.max_depth > 0) & (jnp.sum(valid) >= gp.max_depth)
    # shedding: the lowest-priority, newest sheddable entry, if r outranks it
    entry_priority = gp.band_priority[gp.band_of[entry]]
    sheddable = valid & (entry_priority < 0)
    value = -entry_priority * (1 << 40) + entry.astype(jnp.int64)  # larger = shed first
    worst = jnp.argmax(jnp.where(sheddable, value, jnp.int64(-1)))
    can_shed = gp.shedding & jnp.any(sheddable) & (gp.band_priority[band] > entry_priority[worst])
    shed = on & ~band_full & queue_full & can_shed
    admitted = on & ~band_full & (~queue_full | can_shed)
    n = gs.outcome.shape[0]
    queue = jnp.where(shed & (jnp.arange(gs.queue.shape[0]) == worst), -1, gs.queue)
    free = jnp.argmax(queue < 0)
    has_free = queue[free] < 0
    store = admitted & has_free
    queue = queue.at[jnp.where(store, free, queue.shape[0])].set(jnp.asarray(r, jnp.int32), mode="drop")
    outcome = gs.outcome.at[jnp.where(shed, gs.queue[worst], n)].set(SHED, mode="drop")
    outcome = outcome.at[jnp.where(on, r, n)].set(jnp.where(admitted, QUEUED, REJECTED).astype(jnp.int8), mode="drop")
    return dataclasses.replace(
        gs, queue=queue, outcome=outcome,
        enqueued_us=gs.enqueued_us.at[jnp.where(store, r, n)].set(now, mode="drop"),
        full=gs.full | (admitted & ~has_free),
    )


# ---------------------------------------------------------------------------------- dispatch


def saturation(gp: GatewayParams, rs: signals.RouterState) -> Float64[Array, ""]:
    utilization = utilization_saturation(rs, gp.qd_threshold, gp.kv_threshold)
    n = jnp.sum(rs.active)
    in_flight = jnp.sum(jnp.where(rs.active, rs.in_flight, 0)).astype(jnp.float64)
    concurrency = jnp.where(n > 0, exact_div(in_flight, n.astype(jnp.float64) * gp.max_concurrency), 1.0)
    return jnp.select([gp.detector == 1, gp.detector == 2], [utilization, concurrency], 0.0)


def band_ceilings(gp: GatewayParams, bands: int) -> Float64[Array, " B"]:
    """1 - i (1 - usage limit) / (n - 1) for band i of n (1 for a single band)."""
    i = jnp.arange(bands, dtype=jnp.float64)
    n = gp.num_bands.astype(jnp.float64)
    step = exact_div(1.0 - gp.usage_limit, jnp.maximum(n - 1.0, 1.0))
    return jnp.where(n > 1, 1.0 - i * step, 1.0)


def choose(gs: GatewayState, gp: GatewayParams, s, tenants: int):
    """The slot to dispatch at saturation `s` (-1: none) and its band."""
    bands = gs.last_tenant.shape[0]
    valid = gs.queue >= 0
    entry = jnp.maximum(gs.queue, 0)
    entry_band = gp.band_of[entry]
    nonempty = jnp.zeros(bands, jnp.int32).at[entry_band].max(valid.astype(jnp.int32)) > 0
    blocked = band_ceilings(gp, bands) <= s
    first = jnp.argmax(nonempty | blocked)
    go = nonempty[first] & ~blocked[first]
    in_band = valid & (entry_band == first)
    entry_tenant = gp.tenant_of[entry]
    oldest = jnp.iinfo(jnp.int32).max  # entries are request indices: arrival (= enqueue) order
    # round-robin: the next tenant present in the band after the one served last, cyclically
    present = jnp.zeros(tenants, jnp.int32).at[entry_tenant].max(in_band.astype(jnp.int32)) > 0
    after = present & (jnp.arange(tenants) > gs.last_tenant[first])
    next_tenant = jnp.where(jnp.any(after), jnp.argmax(after), jnp.argmax(present))
    # global-strict: the flow whose head (its oldest entry) is the oldest
    head_tenant = entry_tenant[jnp.argmin(jnp.where(in_band, entry, oldest))]
    tenant = jnp.where(gp.fairness == 1, next_tenant, head_tenant)
    in_flow = in_band & (entry_tenant == tenant)
    # slo-deadline: the earliest enqueue + SLO target, then the oldest; else the oldest
    target = gp.slo_target_us[entry]
    deadline = jnp.where(in_flow & (target < INF_TIME), gs.enqueued_us[entry] + target, INF_TIME)
    by_deadline = in_flow & (deadline == jnp.min(jnp.where(in_flow, deadline, INF_TIME)))
    candidates = jnp.where(gp.order == 2, by_deadline, in_flow)
    slot = jnp.argmin(jnp.where(candidates, entry, oldest))
    return jnp.where(go, slot, -1), first, tenant


def dispatch(gs: GatewayState, gp: GatewayParams, rs: signals.RouterState, now, on, tenants: int) -> GatewayState:
    """One dispatch attempt at `now`: at most one request leaves for routing."""
    slot, band, tenant = choose(gs, gp, saturation(gp, rs), tenants)
    go = on & (slot >= 0)
    r = gs.queue[jnp.maximum(slot, 0)]
    n, q = gs.outcome.shape[0], gs.queue.shape[0]
    ring_full = gs.route_tail - gs.route_head >= q
    go_ok = go & ~ring_full
    return dataclasses.replace(
        gs,
        queue=gs.queue.at[jnp.where(go_ok, slot, q)].set(-1, mode="drop"),
        outcome=gs.outcome.at[jnp.where(go_ok, r, n)].set(DISPATCHED, mode="drop"),
        dispatched_us=gs.dispatched_us.at[jnp.where(go_ok, r, n)].set(now, mode="drop"),
        last_tenant=gs.last_tenant.at[jnp.where(go_ok, band, gs.last_tenant.shape[0])].set(
            tenant.astype(jnp.int32), mode="drop"),
        to_route=gs.to_route.at[jnp.where(go_ok, gs.route_tail % q, q)].set(r, mode="drop"),
        route_tail=gs.route_tail + go_ok,
        full=gs.full | (go & ring_full),
    )


def schedule_tick(gs: GatewayState, gp: GatewayParams, now, on, after_tick=False) -> GatewayState:
    """While the queue is non-empty a tick is pending (rescheduled `tick_us` after each tick)."""
    pending = depth(gs) > 0
    if after_tick:
        tick_at = jnp.where(pending, now + gp.tick_us, INF_TIME)
    else:
        tick_at = jnp.where(pending & (gs.tick_at >= INF_TIME), now + gp.tick_us, gs.tick_at)
    return dataclasses.replace(gs, tick_at=jnp.where(on, tick_at, gs.tick_at))


# ------------------------------------------------------------------------------ TTL, routing


def next_expiry(gs: GatewayState, gp: GatewayParams):
    """(slot, time) of the next TTL expiry (INF_TIME: none)."""
    valid = (gs.queue >= 0) & (gp.ttl_us > 0)
    at = jnp.where(valid, gs.enqueued_us[jnp.maximum(gs.queue, 0)] + gp.ttl_us, INF_TIME)
    best = jnp.min(at)
    # same time: the older request first (pushed first)
    slot = jnp.argmin(jnp.where(valid & (at == best), gs.queue, jnp.iinfo(jnp.int32).max))
    return slot, best


def expire(gs: GatewayState, slot, on) -> GatewayState:
    n, q = gs.outcome.shape[0], gs.queue.shape[0]
    r = gs.queue[slot]
    return dataclasses.replace(
        gs, queue=gs.queue.at[jnp.where(on, slot, q)].set(-1, mode="drop"),
        outcome=gs.outcome.at[jnp.where(on, r, n)].set(EXPIRED, mode="drop"))


def next_to_route(gs: GatewayState, routing_latency_us):
    """(request, routing time) of the oldest dispatched request not yet routed (INF_TIME: none)."""
    q = gs.to_route.shape[0]
    r = gs.to_route[gs.route_head % q]
    waiting = gs.route_head < gs.route_tail
    return jnp.maximum(r, 0), jnp.where(waiting, gs.dispatched_us[jnp.maximum(r, 0)] + routing_latency_us, INF_TIME)


def routed(gs: GatewayState, on) -> GatewayState:
    return dataclasses.replace(gs, route_head=gs.route_head + on)


# -------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class FlowControlConfig:
    """BLIS's flow-control flags (defaults as BLIS's code)."""

    saturation_detector: str = "never"
    dispatch_order: str = "fifo"
    fairness_policy: str = "global-strict"
    slo_targets: str | None = None  # "class=µs,..."
    max_gateway_queue_depth: int = 0
    per_band_capacity: int = 0
    queue_shedding: bool = False
    usage_limit_threshold: float = 1.0
    max_concurrency: float = 100.0
    request_ttl_us: int = 0
    dispatch_tick_interval_us: int = 1000
    in_flight_eviction: bool = False

    def validate(self) -> FlowControlConfig:
        for flag, value, choices in (("--saturation-detector", self.saturation_detector, SATURATION_DETECTORS),
                                     ("--dispatch-order", self.dispatch_order, DISPATCH_ORDERS),
                                     ("--fairness-policy", self.fairness_policy, FAIRNESS_POLICIES)):
            if value not in choices:
                raise ConfigError(f"{flag} {value!r} is not supported; use one of {', '.join(choices)}")
        for flag, value, low in (("--max-gateway-queue-depth", self.max_gateway_queue_depth, 0),
                                 ("--per-band-capacity", self.per_band_capacity, 0),
                                 ("--request-ttl", self.request_ttl_us, 0),
                                 ("--dispatch-tick-interval", self.dispatch_tick_interval_us, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{flag} must be an integer >= {low}, got {value!r}")
        if not (math.isfinite(self.usage_limit_threshold) and 0.0 <= self.usage_limit_threshold <= 1.0):
            raise ConfigError(f"--usage-limit-threshold must be in [0, 1], got {self.usage_limit_threshold!r}")
        if not (math.isfinite(self.max_concurrency) and self.max_concurrency > 0):
            raise ConfigError(f"--max-concurrency must be a number > 0, got {self.max_concurrency!r}")
        if self.in_flight_eviction:
            raise ConfigError("--in-flight-eviction is not supported yet (evicting a request an instance already "
                              "serves); drop the flag")
        self.targets()
        return self

    def targets(self) -> dict[str, int]:
        """--slo-targets as {class: µs}."""
        out: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in (self.slo_targets or "").split(","))):
            name, sep, value = part.partition("=")
            try:
                us = int(value)
            except ValueError:
                us = -1
            if not sep or not name.strip() or us <= 0:
                raise ConfigError(f"--slo-targets: {part!r} must be class=microseconds with microseconds > 0, "
                                  "e.g. critical=200000,standard=1000000")
            out[name.strip()] = us
        return out


def make_params(config: FlowControlConfig, requests, qd_threshold: float, kv_threshold: float):
    """(GatewayParams, bands, tenants) for a request set: bands are the cluster priorities
    present, highest first; tenants ranked by sorted id ('' is 'default')."""
    from blis_jax.cluster.admission import cluster_priority

    config = config.validate()
    n = len(requests)
    priority = np.asarray(cluster_priority(np.asarray(requests.priority, np.int64)), np.int64)
    levels = np.unique(priority)[::-1] if n else np.array([3], np.int64)
    band_of = np.searchsorted(-levels, -priority).astype(np.int32)
    names = np.array([str(t) or "default" for t in requests.tenant_id], dtype=object)
    tenant_ids = sorted(set(names.tolist())) or ["default"]
    tenant_of = np.array([tenant_ids.index(t) for t in names.tolist()], np.int32) if n else np.zeros(0, np.int32)
    targets = config.targets()
    own = requests.trace_columns.get("slo_target_us")
    slo = np.full(n, INF_TIME, np.int64)
    for i in range(n):
        text = str(own[i]).strip() if own is not None else ""
        if text and int(float(text)) > 0:
            slo[i] = int(float(text))
        elif str(requests.slo_class[i]) in targets:
            slo[i] = targets[str(requests.slo_class[i])]
    i64, f64 = (lambda v: jnp.asarray(v, jnp.int64)), (lambda v: jnp.asarray(float(v), jnp.float64))  # noqa: E731
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    params = GatewayParams(
        order=i32(DISPATCH_ORDERS.index(config.dispatch_order)),
        fairness=i32(FAIRNESS_POLICIES.index(config.fairness_policy)),
        detector=i32(SATURATION_DETECTORS.index(config.saturation_detector)),
        max_depth=i64(config.max_gateway_queue_depth), per_band_capacity=i64(config.per_band_capacity),
        shedding=jnp.asarray(bool(config.queue_shedding)), usage_limit=f64(config.usage_limit_threshold),
        qd_threshold=f64(qd_threshold), kv_threshold=f64(kv_threshold), max_concurrency=f64(config.max_concurrency),
        ttl_us=i64(config.request_ttl_us), tick_us=i64(config.dispatch_tick_interval_us),
        num_bands=i64(len(levels)), band_of=band_of, band_priority=levels, tenant_of=tenant_of, slo_target_us=slo,
    )
    return params, len(levels), len(tenant_ids)


def padded(params: GatewayParams, num_requests: int) -> GatewayParams:
    """Per-request arrays padded to the engine's request capacity (padding rows never arrive)."""
    def pad(x, fill):
        x = np.asarray(x)
        out = np.full(num_requests, fill, x.dtype)
        out[:x.shape[0]] = x
        return jnp.asarray(out)

    return dataclasses.replace(params, band_of=pad(params.band_of, 0), tenant_of=pad(params.tenant_of, 0),
                               slo_target_us=pad(params.slo_target_us, INF_TIME),
                               band_priority=jnp.asarray(params.band_priority, jnp.int64))
