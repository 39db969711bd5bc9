"""Closed-loop sessions inside the loop (blis-features §4.9): the loop schedules follow-ups.

A session's rounds are rows of the request arrays (lengths drawn up front: they do not depend on
timing); only the arrival of round r+1 is unknown until round r completes. Each session has a
slot: while a round is pending it holds the round's enqueue time (an enqueue event source
beside the static arrival order); while a follow-up is in flight it holds its timeout (a
timeout source beside the static deadline order). A session has at most one of the two, as a
round is generated only when the previous one completes.

* Completion (normal or length-capped) at step end t: round r+1 arrives at t + think time if
  that is within the horizon (else the session is horizon-interrupted and the round is never
  generated); its deadline is arrival + the follow-up timeout (`deadline_of`). Same-tick pending rounds enqueue
  in generation order, after static arrivals (BLIS pushes all static arrivals first).
* Timeout or drop ends the session: nothing is generated.

Concurrency users (unlimited rounds under a global follow-up budget) are sessions too, one slot
per user, each with its own chain of rounds (its own lengths, whatever order the users complete
in; workload/sessions.py): a completion generates the next round only while the follow-ups
generated so far (`follow_ups`, all sessions together) are fewer than `req.follow_budget`. The
loop records the generation order of every follow-up in `follow_seq` (write-only, for the host:
`settle_sessions`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from blis_jax import latency
from blis_jax.engine.params import INF_TIME, EngineParams
from blis_jax.engine.state import EngineState, RequestArrays


def next_pending_round(state: EngineState):
    """(slot, enqueue time) of the next pending round; time INF_TIME if none."""
    t = jnp.min(state.sess_enqueue)
    slot = jnp.argmin(jnp.where(state.sess_enqueue == t, state.sess_seq, INF_TIME))
    return slot, t


def next_follow_up_timeout(state: EngineState):
    """(slot, deadline) of the next in-flight follow-up timeout; ties in enqueue order."""
    t = jnp.min(state.sess_deadline)
    rank = state.enqueue_rank[jnp.maximum(state.sess_live, 0)]
    slot = jnp.argmin(jnp.where(state.sess_deadline == t, rank, jnp.iinfo(jnp.int32).max))
    return slot, t


def take_pending_round(state: EngineState, slot, active) -> EngineState:
    at = jnp.where(active, slot, state.sess_enqueue.shape[0])
    return dataclasses.replace(state, sess_enqueue=state.sess_enqueue.at[at].set(INF_TIME, mode="drop"))


def deadline_of(state: EngineState, req: RequestArrays, r):
    """Absolute deadline of request r (0 = none): a follow-up's is its arrival + its timeout.
    Computed, not stored: writing a per-request deadline array in the completion loop made XLA
    copy it there (O(requests) per step)."""
    timeout = req.follow_timeout[r]
    follow = jnp.where(timeout > 0, state.arrival[r] + timeout, 0)
    return jnp.where(req.follow_up[r], follow, req.deadline[r])


def arm_timeout(state: EngineState, params: EngineParams, req: RequestArrays, r, active) -> EngineState:
    """A follow-up joined the queue: its timeout fires at its deadline if 0 < deadline ≤ horizon."""
    deadline = deadline_of(state, req, r)
    arm = active & req.follow_up[r] & (deadline > 0) & (deadline <= params.horizon_us)
    at = jnp.where(arm, req.session_slot[r], state.sess_deadline.shape[0])
    return dataclasses.replace(
        state,
        sess_deadline=state.sess_deadline.at[at].set(deadline, mode="drop"),
        sess_live=state.sess_live.at[at].set(r, mode="drop"),
    )


def disarm_timeout(state: EngineState, slot, active) -> EngineState:
    at = jnp.where(active, slot, state.sess_deadline.shape[0])
    return dataclasses.replace(state, sess_deadline=state.sess_deadline.at[at].set(INF_TIME, mode="drop"))


def on_completion(state: EngineState, params: EngineParams, req: RequestArrays, model, r, done_at, active):
    """Request r completed at `done_at` (its step's end): generate its session's next round
    (a concurrency user's: while the global follow-up budget lasts)."""
    n = req.next_round.shape[0]
    slot = req.session_slot[r]
    in_session = active & (slot >= 0)
    nxt = req.next_round[r]
    within_budget = (req.follow_budget < 0) | (state.follow_ups < req.follow_budget)
    # the completed round's own timeout is lazily cancelled (it would be discarded anyway)
    state = disarm_timeout(state, jnp.maximum(slot, 0), in_session & req.follow_up[r])
    arrival = done_at + req.think_time[r]
    generate = in_session & (nxt >= 0) & within_budget & (arrival <= params.horizon_us)
    nxt_safe = jnp.maximum(nxt, 0)
    slot_at = jnp.where(generate, slot, state.sess_enqueue.shape[0])
    enqueue = arrival + latency.queueing_time_us(model, req.input_len[nxt_safe])
    return dataclasses.replace(
        state,
        # Only `arrival` is written per request here: the round's enqueue time lives in its
        # slot and its deadline is derived (deadline_of); writing either array in this loop
        # made XLA copy it on every step.
        arrival=state.arrival.at[jnp.where(generate, nxt_safe, state.arrival.shape[0])].set(arrival, mode="drop"),
        sess_enqueue=state.sess_enqueue.at[slot_at].set(enqueue, mode="drop"),
        sess_req=state.sess_req.at[slot_at].set(nxt.astype(jnp.int32), mode="drop"),
        sess_seq=state.sess_seq.at[slot_at].set(state.follow_ups, mode="drop"),
        follow_ups=state.follow_ups + generate,
        # the trace lists same-tick arrivals in generation order (blis-rng §12)
        follow_seq=state.follow_seq.at[jnp.where(generate, nxt_safe, n)].set(state.follow_ups, mode="drop"),
    )
