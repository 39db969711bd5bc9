"""The scenario axis across devices: a 1-D mesh, and a batched function split along it.

Lanes are independent, so each device runs its own share of the batch with its own
`while_loop` (`shard_map`: no cross-device traffic, and a device stops as soon as its
slowest lane is done). With one device this is a plain `jit(vmap)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "scenarios"


def scenario_mesh(devices: Sequence | None = None) -> Mesh:
    """A 1-D mesh over `devices` (default: every local device)."""
    devices = list(jax.local_devices() if devices is None else devices)
    return Mesh(np.array(devices), (AXIS,))


def shard_batched(fn: Callable, mesh: Mesh) -> Callable:
    """jit of `fn(inputs)` (one pytree of stacked arrays, batch axis first) with the batch axis
    split over the mesh; the batch size must be a multiple of the mesh size."""
    if mesh.size == 1:
        return jax.jit(fn)
    spec = PartitionSpec(AXIS)
    # check_vma=False: the engine's loops start from constants (replicated) and carry per-lane
    # values (varying); lanes never communicate, so the per-device program needs no such typing.
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False))


def put(tree, mesh: Mesh):
    """Stacked host arrays → device arrays, batch axis split over the mesh."""
    if mesh.size == 1:
        return jax.device_put(tree, mesh.devices.flat[0])
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(AXIS)))


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def host_devices_per_core() -> bool:
    """Before JAX starts its backends: expose one CPU device per available core, so that a CPU
    sweep runs a lane on every core (XLA:CPU runs one engine loop on about one core). Only the
    CPU platform changes (accelerators are unaffected); an explicit setting in XLA_FLAGS wins.
    Returns whether it took effect."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG in flags or xla_bridge.backends_are_initialized():
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if cores <= 1:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={cores}".strip()
    return True
