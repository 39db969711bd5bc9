"""Growing the capacities a run overflowed, for its rerun: one policy for the engine driver,
the cluster driver and the sweep's batch runner.

A capacity that overflows inside jit stops the loop with its result bit set (results.py). The
driver then reruns with that capacity, and only that one, `FACTOR` times larger, up to `LIMIT`
times its planned size; past that the result code is reported (`results.fix` says what to
change). Capacities do not change results, only whether a run fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

from blis_jax.engine import results

FACTOR = 4
LIMIT = 64

# result bit → the capacity (a `Growth` field) it grows
CAPACITY_OF = {
    results.ROWS_FULL: "preempted_slots",
    results.FREE_RING_FULL: "free_ring",
    results.WAIT_WINDOW_FULL: "wait_slots",
    results.WINDOW_FULL: "window",
    results.STEP_LOG_FULL: "step_log",
    results.RUN_LOG_FULL: "run_log",
    results.INBOX_FULL: "inbox",
    results.BATCH_FULL: "batch_slots",
    results.TRANSFERS_FULL: "transfers",
    results.GATEWAY_FULL: "gateway_slots",
    results.SCALING_FULL: "scaling",
    results.OFFLOAD_FULL: "offload",
}


@dataclasses.dataclass(frozen=True)
class Growth:
    """Multipliers of the planned capacities that can overflow at run time (1: as planned)."""

    preempted_slots: int = 1
    free_ring: int = 1
    wait_slots: int = 1
    window: int = 1
    step_log: int = 1
    run_log: int = 1
    inbox: int = 1
    batch_slots: int = 1
    transfers: int = 1
    gateway_slots: int = 1
    scaling: int = 1  # autoscaler: instance slots, pending actuations, delay draws, log lines
    offload: int = 1  # KV offload chain: pending I/O jobs and jitter draws

    @classmethod
    def uniform(cls, factor: int) -> Growth:
        """Every capacity `factor` times its planned size."""
        return cls(**{f.name: factor for f in dataclasses.fields(cls)})

    def after(self, code: int) -> Growth | None:
        """The growth for a rerun after result `code`: each overflowed capacity `FACTOR` times
        larger. None: nothing to grow (success, or only failures that growing cannot fix), or
        an overflowed capacity is already at `LIMIT`."""
        grown = {CAPACITY_OF[bit] for bit in CAPACITY_OF if code & bit}
        if not grown or any(getattr(self, name) >= LIMIT for name in grown):
            return None
        return dataclasses.replace(self, **{name: getattr(self, name) * FACTOR for name in grown})

    def join(self, other: Growth) -> Growth:
        """The larger multiplier of each capacity (lanes that share one program)."""
        return Growth(**{f.name: max(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)})


def as_growth(growth: int | Growth) -> Growth:
    return growth if isinstance(growth, Growth) else Growth.uniform(growth)


T = TypeVar("T")


def run_growing(attempt: Callable[[Growth], tuple[T, int]]) -> T:
    """`attempt(growth) -> (outcome, result code)` from the planned capacities on, growing what
    overflowed until the run fits or cannot grow further; returns the last outcome."""
    growth = Growth()
    while True:
        outcome, code = attempt(growth)
        grown = growth.after(code)
        if grown is None:
            return outcome
        growth = grown
