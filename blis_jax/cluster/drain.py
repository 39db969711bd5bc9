"""Drain policies of the autoscaler's scale-down (blis-infra §2.6): BLIS's CLI drain ("bare":
Active → Draining and nothing else, terminated later by the drain-completion check) and its
library-only WAIT / IMMEDIATE / REDIRECT policies (blis-jax: `ClusterConfig.drain_policy`,
`--drain-policy`).

* WAIT: Draining; an idle instance (empty wait queue and batch) is terminated at once.
* IMMEDIATE: its wait queue is discarded and it is terminated at once; the running batch keeps
  executing (the event loop does not look at states) and its requests complete. The discarded
  requests fall out of every counter; their deadlines still fire on that instance and count
  them as timed out (`discarded_timeouts`, applied after the run).
* REDIRECT: Draining; its wait-queue requests re-enter routing at the current clock in queue
  order (their original arrival time kept), excluded from the source (it is no longer
  routable); the source is terminated by the completion check once its batch empties.

In-flight accounting: the source's in-flight count drops by the requests taken away (queue,
and for IMMEDIATE the batch as well), clamped at 0 (`in_flight_cut`; BLIS decrements only after
that, so one clamp at read time equals its sequential clamps). Request conservation: a
redirected request has one outcome, on the instance that finally served it (or a rejection);
its source keeps no record of it. A discarded request is counted nowhere, unless its deadline
comes (then timed out on the discarding instance), as in BLIS.

Where this differs from BLIS (cluster totals agree; these are library-only policies):
* a redirected request that times out is counted on the instance it was redirected to; BLIS's
  deadline event stays armed on the source and counts it there;
* a discarded request whose deadline never fires has no per-request record; BLIS keeps its
  record with zero metrics.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int32, Int64

from blis_jax.engine.dims import EngineDims
from blis_jax.engine.params import INF_TIME
from blis_jax.cluster import lifecycle as lc
from blis_jax.engine.state import NOT_ARRIVED, QUEUED, ROW_FREE, EngineState, RequestArrays
from blis_jax.engine.status import TIMED_OUT
from blis_jax.errors import ConfigError
from blis_jax.naming import name

BARE, WAIT, IMMEDIATE, REDIRECT = range(4)
CODES = {"bare": BARE, "wait": WAIT, "immediate": IMMEDIATE, "redirect": REDIRECT}
DRAIN_POLICIES = tuple(CODES)


def check_drain_policy(policy) -> None:
    if policy not in DRAIN_POLICIES:
        raise ConfigError(f"{name('cluster.drain_policy')} {policy!r}: use one of {', '.join(DRAIN_POLICIES)} "
                          "(bare: BLIS's CLI scale-down)")


class DrainState(eqx.Module):
    in_flight_cut: Int64[Array, " I"]  # subtracted from each instance's routed − left (clamped at 0)
    redirect_at: Int64[Array, " N"]  # pending re-arrival of a redirected request (INF_TIME none)
    redirect_seq: Int32[Array, " N"]  # push order among pending re-arrivals
    pushes: Int32[Array, ""]
    discarded_by: Int32[Array, " N"]  # IMMEDIATE: instance whose queue discarded the request, -1 none
    redirects: Int32[Array, " N"]  # times each request was redirected


def empty(instances: int, requests: int) -> DrainState:
    return DrainState(in_flight_cut=jnp.zeros(instances, jnp.int64), redirect_at=jnp.full(requests, INF_TIME, jnp.int64),
                      redirect_seq=jnp.zeros(requests, jnp.int32), pushes=jnp.int32(0),
                      discarded_by=jnp.full(requests, -1, jnp.int32), redirects=jnp.zeros(requests, jnp.int32))


def take_waiting(state: EngineState, dims: EngineDims, req: RequestArrays, on):
    """Empty one instance's wait queue: (state, request at each window position, taken mask,
    queue-order key). The taken requests are forgotten by the instance (status NOT_ARRIVED: a
    later timeout of theirs there is a no-op); a preempted one frees its retained row."""
    w = state.win_status.shape[0]
    pos = state.enq_pos - w + jnp.arange(w, dtype=state.enq_pos.dtype)
    slot = pos & (w - 1)
    n = state.enqueue_order.shape[0]
    r = state.enqueue_order[jnp.clip(pos, 0, n - 1)]
    taken = on & (pos >= 0) & (state.win_status[slot] == QUEUED)
    # queue order: fcfs: the preempted stack (top first), then the FIFO part by position;
    # priority schedulers: their static key
    if dims.scheduler == "fcfs":
        k = jnp.arange(state.front.shape[0])
        in_front = (state.front[None, :] == r[:, None]) & (k < state.front_len)[None, :]
        front_key = -(jnp.argmax(in_front, axis=1).astype(jnp.int64) + 1)
        key = jnp.where(jnp.any(in_front, axis=1), front_key, pos.astype(jnp.int64))
    else:
        key = req.wait_rank[jnp.maximum(r, 0)]
    row = state.win_row[slot]
    has_row = taken & (row >= 0)
    at_row = jnp.where(has_row, row, dims.rows)
    if dims.lora_slots:  # a preempted request holds its adapter (as at a timeout): unpin
        adapter = req.adapter[jnp.maximum(r, 0)]
        na = state.lora_pins.shape[0]
        at = jnp.where(has_row & (adapter >= 0), jnp.maximum(adapter, 0), na)
        state = dataclasses.replace(state, lora_pins=state.lora_pins.at[at].add(-1, mode="drop"))
    state = dataclasses.replace(
        state,
        win_status=state.win_status.at[jnp.where(taken, slot, w)].set(NOT_ARRIVED, mode="drop"),
        win_row=state.win_row.at[jnp.where(taken, slot, w)].set(-1, mode="drop"),
        row_state=state.row_state.at[at_row].set(ROW_FREE, mode="drop"),
        row_req=state.row_req.at[at_row].set(-1, mode="drop"),
        wait_len=jnp.where(on, 0, state.wait_len).astype(state.wait_len.dtype),
        front_len=jnp.where(on, 0, state.front_len).astype(state.front_len.dtype),
        fifo_head=jnp.where(on, state.enq_pos, state.fifo_head).astype(state.fifo_head.dtype),
        window_key=jnp.where(on, INF_TIME, state.window_key).astype(state.window_key.dtype),
        window_req=jnp.where(on, -1, state.window_req).astype(state.window_req.dtype),
    )
    return state, r, taken, key


def apply(ds: DrainState, policy, life: lc.Lifecycle, instances: EngineState, dims: EngineDims,
          req: RequestArrays, drained, rank, now):
    """The policy's (a `CODES` value, dynamic: one program serves every policy) effect on the
    instances the autoscaler just moved to Draining (`drained`; `rank`: their IDs' byte-order
    rank, the order BLIS drains them in). Returns (drain state, lifecycle, instances)."""
    idle = drained & (instances.wait_len == 0) & (instances.batch_len == 0)
    immediate, redirect = policy == IMMEDIATE, policy == REDIRECT
    on = drained & (immediate | redirect)
    new, r, taken, key = jax.vmap(take_waiting, in_axes=(0, None, None, 0))(instances, dims, req, on)
    count = jnp.sum(taken, axis=1).astype(jnp.int64)
    cut = jnp.where(on, count + jnp.where(immediate, instances.batch_len.astype(jnp.int64), 0), 0)
    i, w = taken.shape
    n = ds.redirect_at.shape[0]
    discard = jnp.where(taken & immediate, r, n).reshape(-1)
    again = jnp.where(taken & redirect, r, n).reshape(-1)
    # re-arrivals pushed in drain order, then queue order
    order = jnp.argsort(jnp.where(drained, rank, jnp.iinfo(jnp.int64).max))
    position = jnp.zeros(i, jnp.int64).at[order].set(jnp.arange(i, dtype=jnp.int64))
    rank_key = jnp.where(taken, position[:, None] * (1 << 40) + (key + (1 << 20)), jnp.iinfo(jnp.int64).max).reshape(-1)
    seq = jnp.zeros(i * w, jnp.int32).at[jnp.argsort(rank_key)].set(jnp.arange(i * w, dtype=jnp.int32))
    ds = DrainState(
        in_flight_cut=ds.in_flight_cut + cut,
        redirect_at=ds.redirect_at.at[again].set(jnp.asarray(now, jnp.int64), mode="drop"),
        redirect_seq=ds.redirect_seq.at[again].set(ds.pushes + seq, mode="drop"),
        pushes=ds.pushes + jnp.where(redirect, jnp.sum(taken), 0).astype(jnp.int32),
        discarded_by=ds.discarded_by.at[discard].set(
            jnp.broadcast_to(jnp.arange(i, dtype=jnp.int32)[:, None], (i, w)).reshape(-1), mode="drop"),
        redirects=ds.redirects.at[again].add(1, mode="drop"))
    # WAIT: an idle instance terminates at once; IMMEDIATE: every drained one
    life = lc.terminate(life, (idle & (policy == WAIT)) | (drained & immediate))
    return ds, life, new


def next_redirect(ds: DrainState):
    """(request, arrival time) of the next pending re-arrival (INF_TIME none)."""
    t = jnp.min(ds.redirect_at)
    key = jnp.where(ds.redirect_at == t, ds.redirect_seq, jnp.iinfo(jnp.int32).max)
    r = jnp.argmin(key)
    return r, t


def pop_redirect(ds: DrainState, r, on) -> DrainState:
    n = ds.redirect_at.shape[0]
    return dataclasses.replace(ds, redirect_at=ds.redirect_at.at[jnp.where(on, r, n)].set(INF_TIME, mode="drop"))


def pending(ds: DrainState):
    return jnp.sum(ds.redirect_at < INF_TIME)


def extra_arrivals(ds, status: np.ndarray, n: int) -> np.ndarray:
    """Per request, the cluster arrivals its final status does not show: one per redirection,
    and one for a discarded request that kept no outcome (BLIS counted its arrival)."""
    discarded = (np.asarray(ds.discarded_by[:n]) >= 0) & (status == NOT_ARRIVED)
    return np.asarray(ds.redirects[:n], np.int64) + discarded


def discarded_timeouts(fields: dict, discarded_by: np.ndarray, deadline_us: np.ndarray, horizon_us: int) -> dict:
    """IMMEDIATE's discarded requests whose deadline (> 0, within the horizon) comes: timed out
    on the discarding instance at that time (its clock moves there); the others stay outside
    every count (status NOT_ARRIVED, no instance)."""
    fires = (discarded_by >= 0) & (deadline_us > 0) & (deadline_us <= horizon_us)
    if not fires.any():
        return fields
    fields = dict(fields)
    fields["status"] = np.where(fires, TIMED_OUT, fields["status"]).astype(np.int8)
    fields["handled_by"] = np.where(fires, discarded_by, fields["handled_by"]).astype(np.int32)
    timed_out, sim_end = fields["timed_out"].copy(), fields["sim_end_us"].copy()
    np.add.at(timed_out, discarded_by[fires], 1)
    np.maximum.at(sim_end, discarded_by[fires], deadline_us[fires])
    fields["timed_out"], fields["sim_end_us"] = timed_out, sim_end
    return fields
