"""When each instance entered each lifecycle state, and the instance counts over time it gives.

The cluster loop of an autoscaled cluster keeps, per instance slot, the µs at which it entered
each state (`[I, S]`, S = the lifecycle's state codes, -1 never). States only move forward and a
slot holds one instance for the whole run, so this fixed-size record is exact: the number of
routable, loading and draining instances at any time follows from it (`counts`), with no
sampling interval to choose and no capacity to overflow.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int32, Int64

from blis_jax.cluster import lifecycle as lc

NUM_STATES = len(lc.STATE_NAMES)
NEVER = -1


def initial(state: Int32[Array, " I"]) -> Int64[Array, "I S"]:
    """The record at t = 0: every existing slot entered its initial state then."""
    state = jnp.asarray(state, jnp.int32)
    hit = (jnp.arange(NUM_STATES)[None, :] == state[:, None]) & (state != lc.ABSENT)[:, None]
    return jnp.where(hit, 0, NEVER).astype(jnp.int64)


def record(entered: Int64[Array, "I S"], before: Int32[Array, " I"], after: Int32[Array, " I"], now
           ) -> Int64[Array, "I S"]:
    """`entered` with the slots whose state changed (before → after) entering `after` at `now`
    (a scalar or one time per slot)."""
    now = jnp.broadcast_to(jnp.asarray(now, jnp.int64), before.shape)
    hit = (after != before)[:, None] & (jnp.arange(NUM_STATES)[None, :] == after[:, None])
    return jnp.where(hit, now[:, None], entered)


def states_at(entered: np.ndarray, times: np.ndarray) -> np.ndarray:
    """[T, I] the state of each slot at each time (ABSENT before it existed): the latest state
    entered at or before t (states only move forward, so the highest such code)."""
    entered = np.asarray(entered, np.int64)
    times = np.asarray(times, np.int64)
    reached = (entered[None, :, :] >= 0) & (entered[None, :, :] <= times[:, None, None])  # [T, I, S]
    codes = np.arange(NUM_STATES)[None, None, :]
    return np.max(np.where(reached, codes, lc.ABSENT), axis=2)


def counts(entered: np.ndarray, end_us: int | None = None) -> dict[str, np.ndarray]:
    """The instance counts as step functions: {"time_us": change points (from 0, and `end_us`
    when given), "routable", "loading", "draining", "terminated"} (each count holds from its
    time to the next). Routable = WarmingUp or Active; loading = Scheduling or Loading."""
    entered = np.asarray(entered, np.int64).reshape(-1, NUM_STATES)
    times = np.unique(np.concatenate([[0], entered[entered >= 0]]))
    if end_us is not None:
        times = np.unique(np.concatenate([times[times <= end_us], [end_us]]))
    state = states_at(entered, times)
    return {
        "time_us": times,
        "routable": np.sum((state == lc.WARMING_UP) | (state == lc.ACTIVE), axis=1),
        "loading": np.sum((state == lc.SCHEDULING) | (state == lc.LOADING), axis=1),
        "draining": np.sum(state == lc.DRAINING, axis=1),
        "terminated": np.sum(state == lc.TERMINATED, axis=1),
    }
