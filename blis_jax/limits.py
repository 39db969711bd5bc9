"""What one process can simulate: value limits of the int64 µs arithmetic and a memory budget.

Numbers are checked where they enter (flags, traces, specs, grids) against limits that keep
every sum the engine forms inside int64: a time is at most MAX_TIME_US (2^53 µs, 285 years;
a replay's default horizon of 2 × the latest time, plus a timeout, still fits), a token count
at most MAX_TOKENS (2^40; input + output of one request and any counter over 10^6 requests
fit), KV blocks at most MAX_KV_BLOCKS (block ids and the free ring are int32).

Sizes are estimated before anything is allocated, against a memory budget (default
DEFAULT_BUDGET_GIB, `--max-memory-gib` raises it): requests × REQUEST_BYTES, the engine's
buffers from their static dims (`engine_bytes`), sweep scenarios and plan candidates. A size
over the budget is refused with the estimate and the limit, instead of running out of memory
or the clock.
"""

from __future__ import annotations

import math

from blis_jax.errors import ConfigError

INT64_MAX = 2**63 - 1
MAX_TIME_US = 2**53
MAX_TOKENS = 2**40
MAX_KV_BLOCKS = 2**26
MAX_BLOCK_SIZE = 2**16  # tokens per KV block (vLLM: 16 to 256; 2^31 exhausted memory in the engine)
MAX_SEED = 2**64 - 1  # a seed is any signed or unsigned 64-bit integer

DEFAULT_BUDGET_GIB = 16.0
# Host + device bytes per request over a run: the request arrays, the engine's per-request
# state (status, timing, counters, window slots) and the per-request outputs and metrics.
REQUEST_BYTES = 1024
SCENARIO_BYTES = 256 * 1024  # a sweep scenario: its resolved settings, requests and table row
MAX_SCENARIOS = 100_000  # beyond this a sweep's host-side bookkeeping alone takes minutes

_budget_gib = DEFAULT_BUDGET_GIB


def configure(max_memory_gib: float | None) -> None:
    """Set the process's budget from --max-memory-gib (None: the default)."""
    global _budget_gib
    if max_memory_gib is None:
        _budget_gib = DEFAULT_BUDGET_GIB
        return
    if not (math.isfinite(max_memory_gib) and max_memory_gib > 0):
        raise ConfigError(f"--max-memory-gib {max_memory_gib:g}: must be a number > 0")
    _budget_gib = float(max_memory_gib)


def budget_bytes() -> int:
    return int(_budget_gib * 2**30)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.3g} GiB" if n < 1000 * 2**30 else f"{n / 2**30:,.0f} GiB"


def check_size(what: str, count: int, per_item: int, fix: str) -> None:
    """Refuse `count` items of `per_item` bytes above the budget: the estimate, the limit and
    the fix in one line."""
    total = int(count) * int(per_item)
    if total > budget_bytes():
        raise ConfigError(f"{what}: {count:,} need about {_gib(total)}, over the {_gib(budget_bytes())} memory "
                          f"budget; {fix}, or raise --max-memory-gib")


def check_requests(count: int, fix: str) -> None:
    check_size("requests", count, REQUEST_BYTES, fix)


def check_scenarios(count: int, fix: str) -> None:
    if count > MAX_SCENARIOS:
        raise ConfigError(f"{count:,} scenarios exceed the limit of {MAX_SCENARIOS:,} per command; {fix}")
    check_size("scenarios", count, SCENARIO_BYTES, fix)


def check_int(flag: str, value: int, low: int, high: int, what: str = "") -> None:
    if not low <= value <= high:
        label = f"{value:,}" if abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
        raise ConfigError(f"{flag} {label}: must be between {low:,} and {high:,}{what}")


def engine_bytes(dims) -> int:
    """Rough bytes of one engine program's buffers (state + request arrays + logs), from its
    static dims; dominated by block tables, the KV pool and the per-request arrays."""
    rows = dims.batch_slots + dims.preempted_slots
    return (dims.num_requests * 256                      # request arrays and per-request state
            + rows * dims.blocks_per_request * 4         # block tables (int32 ids)
            + rows * 128                                 # per-slot state
            + dims.kv_blocks * 24 + dims.free_ring * 4   # pool: owner, refcount, hash, LRU ring
            + dims.prefix_groups * dims.prefix_blocks * 8
            + dims.step_log * 24 + dims.run_log * 24 + dims.window * 32 + dims.wait_slots * 16)


def check_engine(dims) -> None:
    """Refuse an engine program whose buffers exceed the budget, naming the largest term."""
    total = engine_bytes(dims)
    if total <= budget_bytes():
        return
    terms = {
        "--max-num-seqs (running-batch slots x block-table row)":
            (dims.batch_slots + dims.preempted_slots) * dims.blocks_per_request * 4,
        "--total-kv-blocks": dims.kv_blocks * 24 + dims.free_ring * 4,
        "the shared prefix lengths": dims.prefix_groups * dims.prefix_blocks * 8,
        "the number of requests": dims.num_requests * 256,
        "the output lengths (steps to log)": dims.step_log * 24,
    }
    cause = max(terms, key=terms.get)
    raise ConfigError(f"the simulation would need about {_gib(total)} of buffers, over the {_gib(budget_bytes())} "
                      f"memory budget (mostly from {cause}); lower it, or raise --max-memory-gib")
