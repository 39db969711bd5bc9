"""Starting JAX's CPU backend so that a simulation's programs run on one thread.

XLA:CPU sizes the thread pool that executes a program's operations from the cores the process
may use at the moment the backend starts. An engine loop iteration is hundreds of small
operations (a few microseconds each); with a pool of two or more threads, the executor hands
consecutive operations between threads on different cores, and those hand-offs cost more than
the operations. So a single-device simulation runs faster with a one-thread pool.

`start_single_thread_cpu_backend()` starts the backend while the calling thread may use one core,
then gives every thread of the process its full set of cores back. Only that pool keeps its
size: compilation still runs on every core, and nothing stays pinned. It is for processes that
run one device's programs (`run`, `replay`, `calibrate`, `fit`): a sweep that spreads lanes over
one CPU device per core (`sweep.sharding.host_devices_per_core`) gains nothing from it. Figures:
docs/ARCHITECTURE.md, "CPU execution threads".

The CLI calls it for those commands; library users may call it first thing in a fresh process.
`BLIS_JAX_CPU_THREADS=all` leaves the backend's default pool.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

ENV_VAR = "BLIS_JAX_CPU_THREADS"


def _accelerator_may_be_used() -> bool:
    """JAX may pick an accelerator platform: one is requested, or a plugin for one is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", os.environ.get("JAX_PLATFORM_NAME", "")).strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() != "cpu"
    if importlib.util.find_spec("jax_plugins") is not None:
        return True
    try:
        return bool(importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # noqa: BLE001 - broken metadata: assume a plugin, leave the backend alone
        return True


def _set_every_thread(cores: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def start_single_thread_cpu_backend() -> bool:
    """Start JAX's backends with a one-thread CPU execution pool (module docstring). Returns
    whether it did; it does nothing when the backends have started already, when JAX may use an
    accelerator, when the process may use one core anyway, where thread affinity cannot be set
    (not Linux), or when `BLIS_JAX_CPU_THREADS=all`."""
    from jax._src import xla_bridge

    if os.environ.get(ENV_VAR, "").strip().lower() == "all" or xla_bridge.backends_are_initialized():
        return False
    if not (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")) or _accelerator_may_be_used():
        return False
    cores = os.sched_getaffinity(0)
    if len(cores) <= 1:
        return False
    import jax

    os.sched_setaffinity(0, {min(cores)})
    try:
        jax.devices()
    finally:
        _set_every_thread(cores)
    return True
