"""KV transfers of prefill/decode disaggregation, as cluster state (blis-features §3.10).

A disaggregated request is routed decode-first: the decode instance is chosen (and kept in
`decode_target`), then a prefill instance serves its prompt as a sub-request with no output.
When that prefill completes — detected at the start tick of the step that finishes it, as
BLIS detects it — the transfer starts: KV for the whole prompt is reserved on the decode
instance (engine/transfer.py; no room ⇒ the request is dropped at the decode instance), and
the transfer completes `pd.transfer_time_us` later, when the decode sub-request is enqueued
there. Pending transfers live in a small set (completion time, request, decode instance,
start order for same-tick ties); a full set is an overflow result, never a lost request.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int32, Int64

from blis_jax.engine.params import INF_TIME

class Transfers(eqx.Module):
    done_at: Int64[Array, " T"]  # completion time; INF_TIME = free entry
    request: Int32[Array, " T"]
    decode: Int32[Array, " T"]
    seq: Int64[Array, " T"]  # start order (BLIS's event push order breaks same-tick ties)
    started: Int64[Array, ""]  # transfers started so far
    # per request (write-only outputs): decode instance chosen at routing (-1: not disaggregated),
    # prefill instance, transfer start and duration, dropped for lack of KV at the decode instance
    decode_target: Int32[Array, " N"]
    prefill_by: Int32[Array, " N"]
    start_us: Int64[Array, " N"]
    duration_us: Int64[Array, " N"]
    dropped: Bool[Array, " N"]
    active_at_start: Int64[Array, " N"]  # transfers in flight when it started, itself included
    # the prefill sub-request's scheduling delay, TTFT and E2E, read at the start: on a shared
    # pod the decode sub-request may later reuse the request's output record
    prefill_delay_us: Int64[Array, " N"]
    prefill_ttft_us: Int64[Array, " N"]
    prefill_e2e_us: Int64[Array, " N"]


def empty(capacity: int, num_requests: int) -> Transfers:
    t, n = capacity, num_requests
    return Transfers(
        done_at=jnp.full(t, INF_TIME, jnp.int64), request=jnp.full(t, -1, jnp.int32),
        decode=jnp.full(t, -1, jnp.int32), seq=jnp.zeros(t, jnp.int64), started=jnp.asarray(0, jnp.int64),
        decode_target=jnp.full(n, -1, jnp.int32), prefill_by=jnp.full(n, -1, jnp.int32),
        start_us=jnp.full(n, -1, jnp.int64), duration_us=jnp.full(n, -1, jnp.int64), dropped=jnp.zeros(n, bool),
        active_at_start=jnp.zeros(n, jnp.int64), prefill_delay_us=jnp.full(n, -1, jnp.int64),
        prefill_ttft_us=jnp.full(n, -1, jnp.int64), prefill_e2e_us=jnp.full(n, -1, jnp.int64),
    )


def next_done(tr: Transfers):
    """(entry, completion time) of the next transfer to complete (INF_TIME: none)."""
    key_time = tr.done_at
    first = jnp.min(key_time)
    entry = jnp.argmin(jnp.where(key_time == first, tr.seq, jnp.iinfo(jnp.int64).max))
    return entry, first


def in_flight(tr: Transfers):
    return jnp.sum(tr.done_at < INF_TIME)


def start(tr: Transfers, r, decode, now, duration, reserved, active, in_flight, prefill_record):
    """Record a transfer that starts at `now` (or the drop, when no KV could be reserved);
    `in_flight`: transfers active with this one; `prefill_record`: the prefill sub-request's
    (scheduling delay, TTFT, E2E)."""
    n, t = tr.decode_target.shape[0], tr.done_at.shape[0]
    go = active & reserved
    free = jnp.argmax(tr.done_at >= INF_TIME)
    full = go & (tr.done_at[free] < INF_TIME)
    at = jnp.where(go & ~full, free, t)
    tr = dataclasses.replace(
        tr,
        done_at=tr.done_at.at[at].set(now + duration, mode="drop"),
        request=tr.request.at[at].set(r, mode="drop"),
        decode=tr.decode.at[at].set(decode, mode="drop"),
        seq=tr.seq.at[at].set(tr.started, mode="drop"),
        started=tr.started + go,
        start_us=tr.start_us.at[jnp.where(go, r, n)].set(now, mode="drop"),
        duration_us=tr.duration_us.at[jnp.where(go, r, n)].set(duration, mode="drop"),
        dropped=tr.dropped.at[jnp.where(active & ~reserved, r, n)].set(True, mode="drop"),
        active_at_start=tr.active_at_start.at[jnp.where(go, r, n)].set(in_flight, mode="drop"),
        prefill_delay_us=tr.prefill_delay_us.at[jnp.where(active, r, n)].set(prefill_record[0], mode="drop"),
        prefill_ttft_us=tr.prefill_ttft_us.at[jnp.where(active, r, n)].set(prefill_record[1], mode="drop"),
        prefill_e2e_us=tr.prefill_e2e_us.at[jnp.where(active, r, n)].set(prefill_record[2], mode="drop"),
    )
    return tr, full


def finish(tr: Transfers, entry, active) -> Transfers:
    t = tr.done_at.shape[0]
    return dataclasses.replace(tr, done_at=tr.done_at.at[jnp.where(active, entry, t)].set(INF_TIME, mode="drop"))
