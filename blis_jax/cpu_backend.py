"""Starting JAX's CPU backend so that a simulation's programs run on one thread.

XLA:CPU sizes the thread pool that executes a program's operations from the cores the process
may use at the moment the backend starts. An engine loop iteration is hundreds of small
operations (about half a microsecond each on CPU); with a pool of two or more threads, the executor hands
consecutive operations between threads on different cores, and those hand-offs cost more than
the operations. So a single-device simulation runs faster with a one-thread pool.

`start_single_thread_cpu_backend()` starts the backend while the calling thread may use one core,
then gives every thread of the process its own cores back (nothing stays pinned). Only that pool
keeps its size; compilation still spreads over the cores. It is for processes that run one
device's programs (`run`, `replay`, `fit`, `sensitivity`): a sweep that spreads lanes over one
CPU device per core (`sweep.sharding.host_devices_per_core`) gains nothing from it. Measured on
2 cores only: docs/ARCHITECTURE.md, "CPU execution threads".

The CLI calls it for those commands; library users may call it first thing in a fresh process.
`BLIS_JAX_CPU_THREADS=all` leaves the backend's default pool.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

ENV_VAR = "BLIS_JAX_CPU_THREADS"


def _accelerator_may_be_used() -> bool:
    """JAX may start a backend other than the CPU: the platforms set (config or environment) are
    anything but exactly "cpu", or none is set and a plugin or TPU runtime is installed."""
    import jax

    platforms = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")
                 or "").strip().lower()
    if platforms:
        return platforms != "cpu"
    if os.environ.get("TPU_LIBRARY_PATH") or os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS"):
        return True
    if any(importlib.util.find_spec(name) is not None for name in ("jax_plugins", "libtpu")):
        return True
    try:
        return bool(importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # noqa: BLE001 - broken metadata: assume a plugin, leave the backend alone
        return True


def _thread_masks() -> dict[int, set[int]]:
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            masks[int(tid)] = os.sched_getaffinity(int(tid))
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    return masks


def _restore(saved: dict[int, set[int]], cores: set[int]) -> None:
    """Every thread back to its own mask; threads started meanwhile get `cores`. Repeated until a
    pass finds no new thread (one started by a thread that was still narrowed)."""
    done: set[int] = set()
    while True:
        fresh = [tid for tid in _thread_masks() if tid not in done]
        if not fresh:
            return
        for tid in fresh:
            try:
                os.sched_setaffinity(tid, saved.get(tid, cores))
            except OSError:  # ended meanwhile
                pass
            done.add(tid)


def start_single_thread_cpu_backend() -> bool:
    """Start JAX's backends with a one-thread CPU execution pool (module docstring). Returns
    whether it did; it does nothing when the backends have started already, when JAX may use an
    accelerator, when the process may use one core anyway, where thread affinity cannot be set
    (not Linux, or a sandbox refuses it), or when `BLIS_JAX_CPU_THREADS=all`."""
    from jax._src import xla_bridge

    if os.environ.get(ENV_VAR, "").strip().lower() == "all" or xla_bridge.backends_are_initialized():
        return False
    if not (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")) or _accelerator_may_be_used():
        return False
    cores = os.sched_getaffinity(0)
    if len(cores) <= 1:
        return False
    saved = _thread_masks()
    import jax

    try:
        os.sched_setaffinity(0, {min(cores)})
    except OSError:
        return False
    try:
        jax.devices()
    finally:
        _restore(saved, cores)
    return True
