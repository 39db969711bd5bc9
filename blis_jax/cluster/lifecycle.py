"""Instance lifecycle states in the cluster state (blis-infra §2): which slots hold an instance,
which are routable, and the pending InstanceLoaded events.

States are int32 codes in BLIS's forward order (every allowed transition raises the code), so
"has moved past X" is a comparison and later transitions (drain, termination, the
autoscaler's instances) are further writes to the same arrays. `ABSENT` marks a slot that holds
no instance: padding slots of a compiled program (a pending, unplaceable startup instance has
no slot: placed later by a NodeReady retry, with node provisioning, it takes the next free one).

Routable ⇔ WarmingUp or Active. An instance in `Loading` with `loaded_at` = t becomes Active
at t through an InstanceLoaded cluster event (priority −1: before any arrival, admission or
routing at the same tick). GPU conservation (INV-A): `gpu_owner` names the slot holding each
GPU of the inventory; the GPUs in use equal those held by non-terminated instances.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int32, Int64

from blis_jax.engine.params import INF_TIME

ABSENT, SCHEDULING, LOADING, WARMING_UP, ACTIVE, DRAINING, TERMINATED = range(7)
STATE_NAMES = {ABSENT: "", SCHEDULING: "Scheduling", LOADING: "Loading", WARMING_UP: "WarmingUp", ACTIVE: "Active",
               DRAINING: "Draining", TERMINATED: "Terminated"}

# BLIS's transition table (blis-infra §2.2); anything else is an invariant violation.
ALLOWED = {SCHEDULING: (LOADING, TERMINATED), LOADING: (WARMING_UP, ACTIVE, TERMINATED),
           WARMING_UP: (ACTIVE, DRAINING, TERMINATED), ACTIVE: (DRAINING, TERMINATED),
           DRAINING: (TERMINATED,), TERMINATED: ()}


def allowed(source: int, target: int) -> bool:
    """Whether BLIS allows `source → target` (a first assignment from ABSENT is unchecked)."""
    return source == ABSENT or target in ALLOWED[source]


class Lifecycle(eqx.Module):
    state: Int32[Array, " I"]
    loaded_at: Int64[Array, " I"]  # time of the pending InstanceLoaded event; INF_TIME none
    gpus: Int32[Array, " I"]  # GPUs the instance holds (its TP with node pools, else 0)
    gpu_owner: Int32[Array, " G"]  # slot holding each inventory GPU, -1 free (G >= 1)


def make(state, loaded_at=None, gpus=None, gpu_owner=None) -> Lifecycle:
    """A lifecycle from host arrays (per slot: state code, loaded-at µs, GPUs held)."""
    state = np.asarray(state, np.int32)
    i = state.shape[0]
    loaded_at = np.full(i, INF_TIME, np.int64) if loaded_at is None else np.asarray(loaded_at, np.int64)
    gpus = np.zeros(i, np.int32) if gpus is None else np.asarray(gpus, np.int32)
    gpu_owner = np.full(1, -1, np.int32) if gpu_owner is None or len(gpu_owner) == 0 else np.asarray(gpu_owner, np.int32)
    return Lifecycle(state=jnp.asarray(state), loaded_at=jnp.asarray(loaded_at), gpus=jnp.asarray(gpus),
                     gpu_owner=jnp.asarray(gpu_owner))


def all_active(exists: Bool[Array, " I"], ready=ACTIVE) -> Lifecycle:
    """No node pools: every existing slot is Active (`ready`: WarmingUp with warm-up, warm_up.py)
    from the start (BLIS's construction path A). Jittable: the cluster's initial state is built
    inside its program."""
    exists = jnp.asarray(exists, bool)
    i = exists.shape[0]
    return Lifecycle(state=jnp.where(exists, ready, ABSENT).astype(jnp.int32), loaded_at=jnp.full(i, INF_TIME, jnp.int64),
                     gpus=jnp.zeros(i, jnp.int32), gpu_owner=jnp.full(1, -1, jnp.int32))


def routable(lc: Lifecycle) -> Bool[Array, " I"]:
    return (lc.state == WARMING_UP) | (lc.state == ACTIVE)


def next_loaded(lc: Lifecycle) -> Int64[Array, ""]:
    """Time of the earliest pending InstanceLoaded event (INF_TIME if none)."""
    return jnp.min(jnp.where(lc.state == LOADING, lc.loaded_at, INF_TIME))


def load(lc: Lifecycle, now, on, ready=ACTIVE) -> Lifecycle:
    """InstanceLoaded events at `now`: Loading → Active, or → WarmingUp with warm-up (`ready`,
    warm_up.py; a library-only feature of BLIS: W = 0 from its CLI)."""
    due = on & (lc.state == LOADING) & (lc.loaded_at <= now)
    return Lifecycle(state=jnp.where(due, ready, lc.state).astype(jnp.int32),
                     loaded_at=jnp.where(due, INF_TIME, lc.loaded_at), gpus=lc.gpus, gpu_owner=lc.gpu_owner)


def terminate(lc: Lifecycle, done) -> Lifecycle:
    """→ Terminated for the `done` instances, releasing their GPUs."""
    owner = lc.gpu_owner
    released = (owner >= 0) & done[jnp.maximum(owner, 0)]
    return Lifecycle(state=jnp.where(done, TERMINATED, lc.state).astype(lc.state.dtype), loaded_at=lc.loaded_at,
                     gpus=lc.gpus, gpu_owner=jnp.where(released, -1, owner).astype(owner.dtype))


def gpus_in_use(lc: Lifecycle):
    """(GPUs allocated in the inventory, GPUs held by non-terminated instances): equal (INV-A)."""
    live = (lc.state != ABSENT) & (lc.state != TERMINATED)
    return jnp.sum(lc.gpu_owner >= 0), jnp.sum(jnp.where(live, lc.gpus, 0))
