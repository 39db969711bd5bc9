"""The autoscaler's events inside the cluster loop (blis-infra §4.2, §4.7, §2.6): scaling ticks,
scale actuations, and the termination of drained instances.

A ScalingTick (priority 8: after every arrival, admission and routing of its timestamp) reads
the routable instances' stale snapshot (moving its watermark, as a routing build does), runs
the decision pipeline (autoscaler.py) and, when a decision survives stabilization, pushes one
ScaleActuation (priority 9) at the tick plus a sampled scrape delay. An actuation drains the
Active instances with the smallest IDs in byte order, or places new ones on node pools: each
takes the next free instance slot, starts Loading for a sampled delay and becomes routable
through an InstanceLoaded event (lifecycle.py). Without node pools every scale-up fails, as in
BLIS.

How a drained instance's work ends is the drain policy's (drain.py): BLIS's CLI drain
("bare") or its library-only WAIT / IMMEDIATE / REDIRECT policies.

With node provisioning (a blis-jax extension), BLIS's library node lifecycle (§3.5) runs too:
NodeReady events (priority −2) with their retry pass over the pending startup instances, and
node drains (Ready → Draining → Terminated once the node holds no allocated GPU).

Random draws (scrape delays from the `autoscaler` stream, the new instances' loading delays
from `instance-loading`) are made on the host in stream order; the loop takes the k-th of each.
What BLIS logs about scaling is kept in a bounded event log (`LOG_*` kinds) and rendered on the
host (`scaling_log_lines`). Every capacity (pending actuations, draws, log) overflows into
`results.SCALING_FULL`, which the driver grows; a scale-up without a free instance slot into
`results.INSTANCE_SLOTS_FULL`, for which the driver reruns with more slots.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float64, Int32, Int64

from blis_jax.cluster import autoscaler as asc
from blis_jax.cluster import lifecycle as lc
from blis_jax.engine import results
from blis_jax.engine.params import INF_TIME

# event-log kinds (what BLIS logs about scaling, blis-infra §4.9)
LOG_ZERO_CAPACITY = 1  # warning: a routable replica with no KV capacity in the snapshot (slot)
LOG_DRAINING = 2  # info: scale-down drains an instance (slot, model)
LOG_NO_ACTIVE = 3  # warning: scale-down found no Active instance (model, variant)
LOG_NO_PLACEMENT_MANAGER = 4  # error: scale-up without node pools (model)
LOG_PLACED = 5  # info: scale-up placed an instance (slot, model, value = node)
LOG_PLACE_FAILED = 6  # error: no Ready node has the GPUs (model, variant, value = seq)
LOG_APPLY_FAILED = 7  # error: summary of an actuation's failures (value = count, slot = first failure's entry)
LOG_PROVISIONING = 8  # info (extension): a node is provisioned after a failed placement (value = node, slot = ready µs)
LOG_NODE_DRAINING = 9  # info (library): a node drain starts, Ready → Draining (slot = node)
LOG_NODE_DRAINED = 10  # info (library): NodeDrained, Draining → Terminated (slot = node)
LOG_NODE_NOT_READY = 11  # warning (library): a node drain of a node that is not Ready is ignored (slot = node)


class ScalingParams(eqx.Module):
    """The autoscaler's settings and pre-drawn delays (dynamic: changing them never recompiles)."""

    interval_us: Int64[Array, ""]
    up_window_us: Int64[Array, ""]
    down_window_us: Int64[Array, ""]
    analyzer: asc.AnalyzerParams
    variants: asc.Variants
    variant_gpu_type: Int32[Array, " V"]  # GPU type id of each variant (placement filter)
    variant_tp: Int32[Array, " V"]
    scrape_delay_us: Int64[Array, " K"]  # the k-th actuating tick's HPA scrape delay
    loading_delay_us: Int64[Array, " J"]  # the j-th autoscaler-created instance's loading delay
    gpu_node: Int32[Array, " G"]  # node index of each inventory GPU (first-fit order)
    gpu_type: Int32[Array, " G"]
    startup_rank: Int64[Array, " I"]  # byte-order rank of each startup slot's ID among `instance_<k>`
    first_new_slot: Int32[Array, ""]  # autoscaler-created instances take slots from here on
    unbounded: Bool[Array, ""]  # no horizon: ticks stop once nothing is pending or in flight
    drain_policy: Int32[Array, ""] = None  # drain.CODES (with ClusterDims.scaling_drain)
    # node provisioning (a blis-jax extension, ClusterConfig.provision_nodes): per node of the
    # inventory, whether it exists at t = 0, its pool's provisioning delay, and standard normal
    # draws of the `node-provisioning` stream (taken in provisioning order, by pools with stddev > 0)
    node_initial: Bool[Array, " Nodes"] = None
    node_type: Int32[Array, " Nodes"] = None
    node_delay_mean_s: Float64[Array, " Nodes"] = None
    node_delay_std_s: Float64[Array, " Nodes"] = None
    provisioning_normals: Float64[Array, " K"] = None
    # the retry of pending startup instances at NodeReady (BLIS library behaviour, §3.5): their
    # TP (max(--tp, 1)) and the variant an instance of that TP has on each GPU type
    startup_tp: Int32[Array, ""] = None
    type_variant: Int32[Array, " T"] = None


class ScalingState(eqx.Module):
    next_tick: Int64[Array, ""]  # INF_TIME: no further tick
    ticks: Int32[Array, ""]  # ticks run so far
    stabilizer: asc.Stabilizer
    pending_at: Int64[Array, " P"]  # pending actuations (INF_TIME: a free entry)
    pending_order: Int32[Array, " P"]  # push order (same-time actuations run in it)
    pending_delta: Int32[Array, "P M"]
    pending_variant: Int32[Array, "P M"]
    pushes: Int32[Array, ""]
    scrape_draws: Int32[Array, ""]
    loading_draws: Int32[Array, ""]
    seq: Int32[Array, ""]  # autoscale-<model>-<seq> counter (incremented before every placement attempt)
    next_slot: Int32[Array, ""]
    # seq of an autoscaler-created slot, 0 for a startup slot (instance_<slot>), −(idx + 1) for
    # a pending startup instance instance_<idx> placed later (at a NodeReady event)
    slot_seq: Int32[Array, " I"]
    slot_variant: Int32[Array, " I"]
    drained_events: Int64[Array, " I"]  # the instance's event count when it was drained (-1 not drained)
    log_time: Int64[Array, " L"]
    log_kind: Int32[Array, " L"]
    log_slot: Int32[Array, " L"]
    log_model: Int32[Array, " L"]
    log_value: Int64[Array, " L"]
    log_len: Int32[Array, ""]
    full: Bool[Array, ""]  # a capacity above overflowed (results.SCALING_FULL)
    slots_full: Bool[Array, ""]  # a scale-up found no free instance slot (results.INSTANCE_SLOTS_FULL)
    node_ready_at: Int64[Array, " Nodes"] | None = None  # provisioning: when each node is Ready (INF_TIME: none)
    provisioning_draws: Int32[Array, ""] | None = None
    # provisioning: node state Ready (initial nodes at t = 0, provisioned ones at their NodeReady
    # event), and BLIS's pending list of startup instances that could not be placed (their
    # indices; its order changes as entries are removed)
    node_ready: Bool[Array, " Nodes"] | None = None
    retry_index: Int32[Array, " I"] | None = None
    retry_len: Int32[Array, ""] | None = None
    # node drain (ClusterConfig.node_drains): the requested drain time of each node (INF_TIME
    # none or done), whether it is Draining, and when it was Terminated (INF_TIME not)
    node_drain_at: Int64[Array, " Nodes"] | None = None
    node_draining: Bool[Array, " Nodes"] | None = None
    node_terminated_at: Int64[Array, " Nodes"] | None = None


def init_state(num_models: int, slots: int, pending: int, log: int, slot_variant, first_tick_at=0) -> ScalingState:
    none = jnp.full(pending, INF_TIME, jnp.int64)
    return ScalingState(
        next_tick=jnp.asarray(first_tick_at, jnp.int64), ticks=jnp.int32(0), stabilizer=asc.Stabilizer.empty(num_models),
        pending_at=none, pending_order=jnp.zeros(pending, jnp.int32),
        pending_delta=jnp.zeros((pending, num_models), jnp.int32),
        pending_variant=jnp.zeros((pending, num_models), jnp.int32), pushes=jnp.int32(0),
        scrape_draws=jnp.int32(0), loading_draws=jnp.int32(0), seq=jnp.int32(0), next_slot=jnp.int32(0),
        slot_seq=jnp.zeros(slots, jnp.int32), slot_variant=jnp.asarray(slot_variant, jnp.int32),
        drained_events=jnp.full(slots, -1, jnp.int64),
        log_time=jnp.zeros(log, jnp.int64), log_kind=jnp.zeros(log, jnp.int32), log_slot=jnp.zeros(log, jnp.int32),
        log_model=jnp.zeros(log, jnp.int32), log_value=jnp.zeros(log, jnp.int64), log_len=jnp.int32(0),
        full=jnp.asarray(False), slots_full=jnp.asarray(False))


def _log(ss: ScalingState, mask, now, kind, slot, model, value=0) -> ScalingState:
    """Append one entry per true element of `mask` (in order); `slot`, `model`, `value` are
    scalars or arrays shaped like `mask`."""
    mask = jnp.atleast_1d(mask)
    shape = mask.shape
    slot, model, value = (jnp.broadcast_to(jnp.asarray(x), shape) for x in (slot, model, value))
    cap = ss.log_time.shape[0]
    at = jnp.where(mask, ss.log_len + jnp.cumsum(mask) - 1, cap)
    count = jnp.sum(mask).astype(jnp.int32)
    put = lambda arr, vals: arr.at[at].set(vals.astype(arr.dtype), mode="drop")  # noqa: E731
    return dataclasses.replace(
        ss, log_time=put(ss.log_time, jnp.broadcast_to(jnp.asarray(now, jnp.int64), shape)),
        log_kind=put(ss.log_kind, jnp.full(shape, kind)), log_slot=put(ss.log_slot, slot),
        log_model=put(ss.log_model, model), log_value=put(ss.log_value, value),
        log_len=ss.log_len + count, full=ss.full | (ss.log_len + count > cap))


def _when(flag, new, old):
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)


# ------------------------------------------------------------------------------------ the tick


def tick(ss: ScalingState, sp: ScalingParams, replicas: asc.Replicas, num_models: int, now, more_to_come, on
         ) -> ScalingState:
    """ScalingTick at `now`: collect (`replicas`, from the refreshed snapshot) → analyze →
    optimize → stabilize → maybe push an actuation; then the next tick, unless the horizon is
    unbounded and nothing is pending (`more_to_come`: arrivals not yet injected or requests
    in flight)."""
    an = asc.analyze(replicas, sp.analyzer, sp.variants, num_models)
    new = _log(ss, an.zero_capacity, now, LOG_ZERO_CAPACITY, jnp.arange(replicas.routable.shape[0]), replicas.model)
    dec = asc.optimize(an, sp.variants)
    stabilizer, dec = asc.stabilize(ss.stabilizer, dec, now, sp.up_window_us, sp.down_window_us)
    actuate = jnp.any(dec.delta != 0)
    k = new.scrape_draws
    delay = sp.scrape_delay_us[jnp.minimum(k, sp.scrape_delay_us.shape[0] - 1)]
    free = new.pending_at >= INF_TIME
    entry = jnp.argmax(free)
    mine = actuate & (jnp.arange(free.shape[0]) == entry)
    new = dataclasses.replace(
        new, stabilizer=stabilizer,
        pending_at=jnp.where(mine, now + delay, new.pending_at),
        pending_order=jnp.where(mine, new.pushes, new.pending_order),
        pending_delta=jnp.where(mine[:, None], dec.delta[None, :], new.pending_delta),
        pending_variant=jnp.where(mine[:, None], dec.variant[None, :], new.pending_variant),
        pushes=new.pushes + actuate, scrape_draws=k + actuate, ticks=new.ticks + 1,
        full=new.full | (actuate & (~jnp.any(free) | (k >= sp.scrape_delay_us.shape[0]))),
        next_tick=jnp.where(sp.unbounded & ~more_to_come, INF_TIME, now + sp.interval_us))
    return _when(on, new, ss)


def next_actuation(ss: ScalingState):
    """(entry, time) of the next pending actuation (push order among equal times)."""
    key = jnp.where(ss.pending_at < INF_TIME, ss.pending_order, jnp.iinfo(jnp.int32).max)
    earliest = ss.pending_at == jnp.min(ss.pending_at)
    entry = jnp.argmin(jnp.where(earliest, key, jnp.iinfo(jnp.int32).max))
    return entry, ss.pending_at[entry]


# ------------------------------------------------------------------------------- the actuation


def actuate(ss: ScalingState, sp: ScalingParams, life: lc.Lifecycle, instance_model, instance_events,
            num_models: int, pools: bool, now, on, ready=lc.ACTIVE) -> tuple[ScalingState, lc.Lifecycle]:
    """ScaleActuation at `now`: the next pending entry's decisions, model by model, against the
    state at this time (blis-infra §4.7). `ready`: the state a new instance without loading
    delay enters (WarmingUp with warm-up, warm_up.py)."""
    entry, _ = next_actuation(ss)
    new, life_new = ss, life
    failures = jnp.int32(0)
    first_failure = jnp.int32(-1)
    slots = life.state.shape[0]
    for m in range(num_models):
        delta, v = ss.pending_delta[entry, m], ss.pending_variant[entry, m]
        new, life_new = _scale_down(new, sp, life_new, instance_model, instance_events, m, v, -delta, now)
        if pools:
            new, life_new, failed, first = _scale_up(new, sp, life_new, m, v, delta, now, ready)
        else:
            failed, first = delta > 0, new.log_len   # the whole decision fails: no PlacementManager (INV-A2)
            new = _log(new, failed, now, LOG_NO_PLACEMENT_MANAGER, -1, m)
            failed = failed.astype(jnp.int32)
        first_failure = jnp.where((first_failure < 0) & (failed > 0), first, first_failure)
        failures = failures + failed
    new = _log(new, failures > 0, now, LOG_APPLY_FAILED, first_failure, -1, failures)
    new = dataclasses.replace(new, pending_at=new.pending_at.at[entry].set(INF_TIME))
    return _when(on, new, ss), _when(on, life_new, life)


def byte_order_rank(ss: ScalingState, sp: ScalingParams):
    """Each slot's ID rank in byte order: `autoscale-…` IDs (by seq) before `instance_…` ones."""
    startup = sp.startup_rank
    if ss.retry_index is not None:  # a startup instance placed by a NodeReady retry: slot_seq = -(idx + 1)
        startup = startup[jnp.where(ss.slot_seq < 0, -ss.slot_seq - 1, jnp.arange(ss.slot_seq.shape[0]))]
    return jnp.where(ss.slot_seq > 0, ss.slot_seq.astype(jnp.int64), jnp.int64(1 << 40) + startup)


def _scale_down(ss, sp, life, instance_model, instance_events, m, v, count, now):
    """Drain `count` (≤ 0: none) Active instances of model m and variant v, smallest ID first."""
    count = jnp.maximum(count, 0)
    candidate = (life.state == lc.ACTIVE) & (instance_model == m) & (ss.slot_variant == v)
    rank = jnp.where(candidate, byte_order_rank(ss, sp), jnp.iinfo(jnp.int64).max)
    order = jnp.argsort(rank)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    chosen = candidate & (position < count)
    ss = _log(ss, chosen[order], now, LOG_DRAINING, order, m)
    missing = jnp.maximum(count - jnp.sum(candidate), 0)
    ss = _log(ss, jnp.arange(order.shape[0]) < missing, now, LOG_NO_ACTIVE, -1, m, v)
    life = dataclasses.replace(life, state=jnp.where(chosen, lc.DRAINING, life.state).astype(life.state.dtype))
    return dataclasses.replace(ss, drained_events=jnp.where(chosen, instance_events, ss.drained_events)), life


def _scale_up(ss, sp, life, m, v, count, now, ready):
    """Place `count` (≤ 0: none) new instances of variant v, one attempt after another."""
    slots = life.state.shape[0]
    tp, gpu_type = sp.variant_tp[v], sp.variant_gpu_type[v]

    def attempt(j, carry):
        ss, life, failed, first = carry
        on = j < count
        seq = ss.seq + 1
        free = (life.gpu_owner < 0) & (sp.gpu_type == gpu_type)
        if ss.node_ready is not None:  # provisioning: only Ready nodes take instances
            free = free & ss.node_ready[sp.gpu_node]
        slot = ss.next_slot
        new, life, placed, here, node, room = _place_first_fit(ss, sp, life, free, tp, on, now, ready)
        ss = dataclasses.replace(new, seq=jnp.where(on, seq, ss.seq), slot_seq=jnp.where(here, seq, ss.slot_seq),
                                 slot_variant=jnp.where(here, v, ss.slot_variant))
        ss = _log(ss, placed, now, LOG_PLACED, slot, m, node)
        no_room = on & ~room
        first = jnp.where(no_room & (first < 0), ss.log_len, first)
        ss = _log(ss, no_room, now, LOG_PLACE_FAILED, -1, m, seq.astype(jnp.int64) * 65536 + v)
        if ss.node_ready_at is not None:
            ss = _provision(ss, sp, gpu_type, no_room, now)
        return ss, life, failed + no_room.astype(jnp.int32), first

    ss, life, failed, first = jax.lax.fori_loop(0, slots, attempt, (ss, life, jnp.int32(0), jnp.int32(-1)))
    return ss, life, failed, first


def _place_first_fit(ss: ScalingState, sp: ScalingParams, life: lc.Lifecycle, free, tp, on, now, ready):
    """One placement attempt (if `on`): the first node with `tp` of the `free` GPUs takes an
    instance in the next free slot, Loading until its `instance-loading` delay (the next
    run-time draw) has passed, or `ready` at once without one. Returns (scaling state with the
    slot, draw and capacity flags advanced; lifecycle; placed; the mask of its slot; the node;
    whether any node had room)."""
    slots, nodes, cap = life.state.shape[0], sp.gpu_node.shape[0], sp.loading_delay_us.shape[0]
    per_node = jax.ops.segment_sum(free.astype(jnp.int32), sp.gpu_node, num_segments=nodes)
    fits = per_node >= tp
    node, room = jnp.argmax(fits), jnp.any(fits)
    placed = on & room & (ss.next_slot < slots)
    mine = free & (sp.gpu_node == node)
    take = mine & (jnp.cumsum(mine) <= tp) & placed
    slot = ss.next_slot
    delay = sp.loading_delay_us[jnp.minimum(ss.loading_draws, cap - 1)]
    here = placed & (jnp.arange(slots) == slot)
    life = dataclasses.replace(
        life, state=jnp.where(here, jnp.where(delay > 0, lc.LOADING, ready), life.state).astype(life.state.dtype),
        loaded_at=jnp.where(here & (delay > 0), now + delay, life.loaded_at),
        gpus=jnp.where(here, tp, life.gpus).astype(life.gpus.dtype),
        gpu_owner=jnp.where(take, slot, life.gpu_owner).astype(life.gpu_owner.dtype))
    ss = dataclasses.replace(
        ss, next_slot=ss.next_slot + placed, loading_draws=ss.loading_draws + placed,
        slots_full=ss.slots_full | (on & room & (ss.next_slot >= slots)),
        full=ss.full | (placed & (ss.loading_draws >= cap)))
    return ss, life, placed, here, node, room


def _provision(ss: ScalingState, sp: ScalingParams, gpu_type, failed, now) -> ScalingState:
    """Node provisioning, a blis-jax extension beyond BLIS (whose library can provision nodes
    but whose autoscaler never does): a placement that found no room provisions the first
    not-yet-provisioned node (pools in declaration order, up to `max_nodes`) of the variant's
    GPU type, unless one of that type is already provisioning. It is Ready after a delay drawn
    as BLIS draws provisioning delays (blis-infra §1.3, stream `node-provisioning`); the failed
    replica is dropped as in BLIS, and a later scale-up places on the new node once Ready."""
    ready = ss.node_ready_at
    mine = sp.node_type == gpu_type
    # still Provisioning until its NodeReady event has run (a zero delay is Ready at `now`, not before)
    busy = jnp.any(mine & (ready < INF_TIME) & ~_past_provisioning(ss))
    candidate = mine & ~sp.node_initial & (ready >= INF_TIME)
    go = failed & ~busy & jnp.any(candidate)
    node = jnp.argmax(candidate)
    k = ss.provisioning_draws
    cap = sp.provisioning_normals.shape[0]
    std, mean = sp.node_delay_std_s[node], sp.node_delay_mean_s[node]
    draws = std > 0
    secs = jnp.where(draws, jnp.maximum(sp.provisioning_normals[jnp.minimum(k, cap - 1)] * std + mean, 0.0), mean)
    delay = jnp.where(jnp.isfinite(secs), jnp.trunc(secs * 1e6), 0.0).astype(jnp.int64)
    at = jnp.where(go, node, ready.shape[0])
    ss = dataclasses.replace(ss, node_ready_at=ready.at[at].set(now + delay, mode="drop"),
                             provisioning_draws=k + (go & draws), full=ss.full | (go & draws & (k >= cap)))
    return _log(ss, go, now, LOG_PROVISIONING, node, -1, now + delay)


# ------------------------------------------------------------------------------- node readiness


def _past_provisioning(ss: ScalingState):
    """Per node: its NodeReady has run (Ready, or with node drains Draining or Terminated)."""
    done = ss.node_ready
    if ss.node_draining is not None:
        done = done | ss.node_draining | (ss.node_terminated_at < INF_TIME)
    return done


def next_node_ready(ss: ScalingState):
    """(node, time) of the next NodeReady event: a provisioned node not yet Ready (INF_TIME
    none). Nodes Ready at the same µs go in node order (BLIS: push order, i.e. provisioning
    order; they differ only for nodes of different types provisioned at different times
    that become Ready at the same µs)."""
    t = jnp.where(_past_provisioning(ss), INF_TIME, ss.node_ready_at)
    node = jnp.argmin(t)
    return node, t[node]


def node_ready_event(ss: ScalingState, sp: ScalingParams, life: lc.Lifecycle, now, on, ready=lc.ACTIVE
                     ) -> tuple[ScalingState, lc.Lifecycle]:
    """NodeReady (priority −2, blis-infra §3.5, a BLIS library behaviour): the node turns
    Ready, then one retry pass over the pending startup instances, bounded by the list's
    length at the start of the pass. Entry i is tried; if it now fits (first fit on any Ready
    node, the startup TP), the last entry moves into slot i and is tried next; else i moves
    on. A placed instance is built as a live instance (§2.3 D): the next free slot (after
    every existing instance), its `instance_<idx>` ID, a loading delay drawn from
    `instance-loading` in retry order (§1.3 rule 3), Loading → WarmingUp/Active as any other
    (`ready`: the state without loading delay)."""
    node, _ = next_node_ready(ss)
    new = dataclasses.replace(ss, node_ready=ss.node_ready.at[node].set(True))
    tp, cap = sp.startup_tp, ss.retry_index.shape[0]
    attempts = new.retry_len

    def attempt(j, carry):
        ss, life, i = carry
        on = j < attempts
        free = (life.gpu_owner < 0) & ss.node_ready[sp.gpu_node]
        idx = ss.retry_index[jnp.minimum(i, cap - 1)]
        placed_ss, life, placed, here, at, _ = _place_first_fit(ss, sp, life, free, tp, on, now, ready)
        last = ss.retry_len - 1
        index = ss.retry_index.at[jnp.where(placed, i, cap)].set(ss.retry_index[jnp.maximum(last, 0)], mode="drop")
        ss = dataclasses.replace(
            placed_ss, slot_seq=jnp.where(here, -(idx + 1), ss.slot_seq),
            slot_variant=jnp.where(here, sp.type_variant[sp.node_type[at]], ss.slot_variant),
            retry_index=index, retry_len=ss.retry_len - placed)
        return ss, life, i + (on & ~placed)

    # a loop of as many attempts as entries: none at the (masked) iterations without a NodeReady
    bound = jnp.where(on, jnp.minimum(attempts, cap), 0)
    new, life_new, _ = jax.lax.fori_loop(0, bound, attempt, (new, life, jnp.int32(0)))
    return _when(on, new, ss), _when(on, life_new, life)


def next_node_drain(ss: ScalingState):
    """(node, time) of the next requested node drain (INF_TIME none)."""
    node = jnp.argmin(ss.node_drain_at)
    return node, ss.node_drain_at[node]


def node_drain_event(ss: ScalingState, now, on) -> ScalingState:
    """A node drain (blis-infra §3.5, a BLIS library call; here a cluster event at its
    requested time, after NodeReady events of that time): only a Ready node moves to Draining
    (no instance is placed on it any more; its instances keep running); any other is ignored
    with a warning. A node with no GPU allocated is drained at once: the loop runs
    `nodes_drained` after every cluster event."""
    node, _ = next_node_drain(ss)
    ok = ss.node_ready[node]
    new = dataclasses.replace(ss, node_drain_at=ss.node_drain_at.at[node].set(INF_TIME),
                              node_ready=ss.node_ready.at[node].set(False),
                              node_draining=ss.node_draining.at[node].set(ss.node_draining[node] | ok))
    new = _log(new, ok, now, LOG_NODE_DRAINING, node, -1)
    new = _log(new, ~ok, now, LOG_NODE_NOT_READY, node, -1)
    return _when(on, new, ss)


def nodes_drained(ss: ScalingState, life: lc.Lifecycle, sp: ScalingParams, now, on) -> ScalingState:
    """NodeDrained (priority −2): a Draining node none of whose GPUs is allocated any more is
    Terminated (its GPUs, all free, are never used again). Checked after every release of GPUs."""
    nodes = sp.gpu_node.shape[0]
    allocated = jax.ops.segment_sum((life.gpu_owner >= 0).astype(jnp.int32), sp.gpu_node, num_segments=nodes)
    done = on & ss.node_draining & (allocated == 0)
    new = dataclasses.replace(ss, node_draining=ss.node_draining & ~done,
                              node_terminated_at=jnp.where(done, now, ss.node_terminated_at))
    return _log(new, done, now, LOG_NODE_DRAINED, jnp.arange(nodes), -1)


# ------------------------------------------------------------------------------ drain completion


def terminate_drained(ss: ScalingState, life: lc.Lifecycle, wait_len, batch_len, instance_events, on):
    """Draining → Terminated for every drained instance that has processed an event since its
    drain and has an empty wait queue and batch; its GPUs are released (blis-infra §2.6). Checked
    at every cluster event, so a termination lands at the first cluster event after it."""
    done = on & (life.state == lc.DRAINING) & (instance_events > ss.drained_events) & (wait_len == 0) & (batch_len == 0)
    return lc.terminate(life, done)


def overflowed(ss: ScalingState | None):
    return False if ss is None else ss.full | ss.slots_full


def result_bits(ss) -> int:
    """The result bits of a (host) scaling state."""
    if ss is None:
        return 0
    return (results.SCALING_FULL if bool(ss.full) else 0) | (results.INSTANCE_SLOTS_FULL if bool(ss.slots_full) else 0)


# ------------------------------------------------------------------------------ host side


def scaling_log_lines(ss, *, model_names: list[str], slot_names: list[str], variants: list,
                      node_names: list[str]) -> list[tuple[int, str, str]]:
    """(time µs, level, message) of every logged scaling event, in order, in BLIS's words."""
    host = jax.device_get(ss)
    out = []
    messages: list[str] = []
    for i in range(int(host.log_len)):
        kind, slot, model = int(host.log_kind[i]), int(host.log_slot[i]), int(host.log_model[i])
        value, when = int(host.log_value[i]), int(host.log_time[i])
        m = model_names[model] if 0 <= model < len(model_names) else ""
        if kind == LOG_ZERO_CAPACITY:
            level, text = "warning", (f'[analyzer] model "{m}": routable replica "{slot_names[slot]}" has zero '
                                      "TotalKvCapacityTokens — excluded from supply/demand; check KV cache initialization")
        elif kind == LOG_DRAINING:
            level, text = "info", f'[actuator] scale-down: draining instance {slot_names[slot]} for model "{m}"'
        elif kind == LOG_NO_ACTIVE:
            gpu, tp = variants[value][:2]
            level, text = "warning", (f'[actuator] scale-down for model "{m}" variant {{{gpu} {tp}}}: '
                                      "no active instance found")
        elif kind == LOG_NO_PLACEMENT_MANAGER:
            level, text = "error", f'[actuator] scale-up for model "{m}": PlacementManager not available (INV-A2)'
        elif kind == LOG_PLACED:
            gpu, tp = variants[int(host.slot_variant[slot])][:2]
            level, text = "info", (f'[actuator] scale-up: placed instance {slot_names[slot]} for model "{m}" on node '
                                   f"{node_names[value]} (gpu={gpu}, tp={tp})")
        elif kind == LOG_PLACE_FAILED:
            seq, v = divmod(value, 65536)
            gpu, tp = variants[v][:2]
            level, text = "error", (f'[actuator] scale-up for model "{m}" variant {{{gpu} {tp}}}: PlaceInstance '
                                    f"failed: PlaceInstance autoscale-{m}-{seq:06d}: no Ready node has {tp} free "
                                    f"{gpu} GPUs (INV-A2)")
        elif kind == LOG_PROVISIONING:
            level, text = "info", (f"[autoscaler] provisioning node {node_names[slot]} after a failed placement "
                                   f"(blis-jax extension): Ready at {value} µs")
        elif kind == LOG_NODE_DRAINING:
            level, text = "info", f"[node] draining node {node_names[slot]}: Ready → Draining"
        elif kind == LOG_NODE_DRAINED:
            level, text = "info", f"[node] node {node_names[slot]} drained: Draining → Terminated"
        elif kind == LOG_NODE_NOT_READY:
            level, text = "warning", f"[node] drain of node {node_names[slot]} ignored: the node is not Ready"
        elif kind == LOG_APPLY_FAILED:
            first = messages[slot] if 0 <= slot < len(messages) else ""
            first = first.split("] ", 1)[1] if "] " in first else first
            level, text = "error", (f"[autoscaler] actuate: Apply returned error: actuator: {value} operation(s) "
                                    f"failed; first: {first}")
        else:
            level, text = "warning", f"[autoscaler] unknown event {kind}"
        messages.append(text)
        out.append((when, level, text))
    return out


def slot_names(ss, model: str, count: int) -> list[str]:
    """The first `count` slots' instance IDs: `instance_<k>` for a startup slot,
    `autoscale-<model>-<seq>` for one the autoscaler filled."""
    seq = np.asarray(jax.device_get(ss.slot_seq))
    return [f"autoscale-{model}-{int(seq[k]):06d}" if seq[k] > 0 else f"instance_{-int(seq[k]) - 1}" if seq[k] < 0
            else f"instance_{k}" for k in range(count)]
