"""Static capacities of one compiled engine program.

Every buffer in the engine state has a fixed size chosen here, host-side, from the scenario.
Sizes are rounded up to buckets (powers of two) so that nearby scenarios share one compiled
program; the dynamic numbers themselves (rates, KV blocks, batch limits) live in
`EngineParams` and never trigger a recompile. A buffer that fills up inside the jitted loop
stops the run with a result code (see `results.py`) instead of dropping data.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from blis_jax.engine.growth import Growth, as_growth
from blis_jax.limits import check_engine

SCHEDULERS = ("fcfs", "priority-fcfs", "sjf")
MAX_PLAIN_SLOTS = 4096  # running-batch slots are capped at max(requests, this)
PREEMPTION_POLICIES = ("fcfs", "priority")


def bucket(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def fine_bucket(n: int, minimum: int = 8) -> int:
    """Smallest of 2^k, 1.25·2^k, 1.5·2^k, 1.75·2^k >= n: for big buffers, where a power-of-two
    bucket would waste up to half the memory."""
    p = bucket(n, minimum)
    for fraction in (5, 6, 7):
        if p // 8 * fraction >= n and p >= 64:
            return p // 8 * fraction
    return p


@dataclasses.dataclass(frozen=True)
class EngineDims:
    """Hashable static shape and structure of one engine program."""

    num_requests: int  # request arrays (padded)
    batch_slots: int  # running batch capacity (>= max_num_seqs)
    preempted_slots: int  # preempted requests waiting with their retained block tables
    kv_blocks: int  # KV block pool capacity (>= total_kv_blocks)
    blocks_per_request: int  # block-table row length
    alloc_blocks: int  # most blocks popped by one whole-batch allocation
    row_alloc_blocks: int  # most blocks popped for one request (one prefill chunk)
    free_ring: int  # released-block FIFO capacity (LRU free list)
    prefix_groups: int
    prefix_blocks: int  # shared full blocks per prefix group
    step_log: int  # per-step ITL sample values not yet read by the host (see itl_log.py)
    run_log: int  # decode runs closed by a gap, not yet read by the host
    block_size: int
    sessions: int = 1  # closed-loop session slots
    trace_steps: bool = False  # also log each step's start, duration and latency basis (fitting)
    scheduler: str = "fcfs"
    preemption_policy: str = "fcfs"
    wait_slots: int = 8  # wait-window capacity for priority-ordered schedulers
    window: int = 1024  # in-flight request window (consecutive enqueue positions)
    inbox: int = 64  # cluster instances: routed requests awaiting their enqueue (inbox.py)
    exit_log: int = 1  # completions the PD cluster has not read yet (1: not logged)
    transfers: bool = False  # requests may arrive with their prompt's KV already transferred (transfer.py)
    # clusters: each step's wait-queue length is summed (HOL blocking events), so a decode run
    # also stops at an enqueue into a full batch's queue (the steps after it see a longer queue)
    sample_wait: bool = False
    coast_steps: int = 64  # most plain decode steps run as one event after a step (coast.py; 1 = off)
    # LoRA (lora.py): resident-set slots per instance and registry size; 0 = no adapters
    # (their steps are not coasted: the adapter factor and load events are not in coast.py)
    lora_slots: int = 0
    lora_adapters: int = 0
    # legacy CPU KV tier (cpu_tier.py): store slots and the content-key space; 0 = no CPU tier
    cpu_blocks: int = 0
    cpu_keys: int = 0
    # multi-tier KV offload chain (offload.py; its CPU staging tier takes cpu_blocks / cpu_keys):
    # secondary tiers, servers per I/O station, pending jobs, precomputed jitter draws
    offload: bool = False
    offload_tiers: int = 0
    offload_servers: int = 0
    offload_jobs: int = 0
    offload_draws: int = 0

    @property
    def trace_log(self) -> int:
        """Entries of the step trace log (one dummy entry when tracing is off)."""
        return self.step_log if self.trace_steps else 1

    @property
    def cpu_rows(self) -> int:
        """Rows of the CPU tier's per-row arrays (cpu_tier.py): the rows with a CPU tier, else 0."""
        return self.rows if self.cpu_blocks else 0

    @property
    def rows(self) -> int:
        """Block-table rows: running requests plus preempted ones that keep their old table."""
        return self.batch_slots + self.preempted_slots


def choose_dims(
    *,
    input_len: np.ndarray,
    output_len: np.ndarray,
    prefix_group: np.ndarray,
    prefix_len: np.ndarray,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    total_kv_blocks: int,
    block_size: int,
    scheduler: str = "fcfs",
    preemption_policy: str = "fcfs",
    growth: int | Growth = 1,
    step_log: int | None = None,
    num_sessions: int = 0,
    trace_steps: bool = False,
    batch_start: int | None = None,
    max_model_len: int = 0,
) -> EngineDims:
    """Pick bucketed capacities for a request set and engine settings.

    `growth` (a `Growth`, or one multiplier for all) multiplies the capacities that can overflow
    at run time (preempted slots, free ring, wait window, logs); the driver reruns with the
    overflowed capacity grown (growth.py).
    `step_log` is the number of steps the ITL step log holds between two host reads: the chunked
    driver reads it after every chunk, so it passes its chunk size; the default bounds the steps
    of a whole run (one decode or one prefill chunk per request and token), for `run_to_end`.
    `batch_start`: running-batch slots at growth 1 (× growth after each overflow, up to
    max-num-seqs) instead of max-num-seqs: a lightly loaded run then runs narrow, and one that
    fills its slots reports BATCH_FULL and is rerun wider (the sweep's lanes; per-iteration cost
    grows with the slots).
    `max_model_len` (0 = unlimited) and `total_kv_blocks` decide which requests the enqueue
    guard drops as unservable (events.enqueue): those never take a block-table row, a prefix
    block or a step, so they do not size the buffers (one absurd request would otherwise make
    every step of the run slow, or its buffers not fit in memory).
    The result is checked against the memory budget (limits.check_engine).
    """
    g = as_growth(growth)
    n = len(input_len)
    served = servable(input_len, output_len, max_model_len, total_kv_blocks, block_size)
    inputs, outputs = np.asarray(input_len, np.int64)[served], np.asarray(output_len, np.int64)[served]
    max_tokens = int(np.max(inputs + outputs)) if len(inputs) else 1
    per_request = math.ceil((max_tokens + 2) / block_size) + 1
    # More slots than requests are never used (a bound only for absurd --max-num-seqs values:
    # ordinary ones keep their own bucket, so they share compiled programs as before).
    max_num_seqs = min(max_num_seqs, max(bucket(n), MAX_PLAIN_SLOTS))
    batch = bucket(max_num_seqs if batch_start is None else min(max_num_seqs, batch_start * g.batch_slots))
    kv = bucket(total_kv_blocks, 16)
    groups = int(prefix_group.max()) + 1 if n and prefix_group.max() >= 0 else 1
    prefixes = np.asarray(prefix_len, np.int64)[served]
    shared = int((prefixes // block_size).max()) if len(prefixes) else 0
    # One step allocates at most: every prefill chunk under the token budget, plus one block per
    # running request (a decode crossing a block boundary, or the partial end of a chunk).
    # (Never more than the pool: a huge --max-num-batched-tokens must not size this buffer.)
    chunk_blocks = min(max_num_batched_tokens // block_size, total_kv_blocks) + 2
    alloc = bucket(chunk_blocks + batch)
    dims = EngineDims(
        num_requests=bucket(n),
        batch_slots=batch,
        preempted_slots=bucket(min(batch, max(n, 1)) * g.preempted_slots),
        kv_blocks=kv,
        blocks_per_request=bucket(per_request),
        alloc_blocks=alloc,
        row_alloc_blocks=bucket(chunk_blocks),
        free_ring=bucket(2 * kv * g.free_ring),
        prefix_groups=bucket(groups, 1),
        prefix_blocks=bucket(shared + 1, 1),
        step_log=fine_bucket(_whole_run_steps(inputs, outputs, max_num_batched_tokens) * g.step_log
                             if step_log is None else step_log),
        run_log=bucket(max(64, n // 16) * g.run_log),
        block_size=int(block_size),
        sessions=bucket(num_sessions, 1),
        trace_steps=trace_steps,
        scheduler=scheduler,
        preemption_policy=preemption_policy,
        wait_slots=bucket(min(max(n, 1), 4096) * g.wait_slots) if scheduler != "fcfs" else 8,
        window=bucket(min(max(n, 1), 4096) * g.window),
        inbox=64 * g.inbox,
    )
    check_engine(dims)
    return dims


def servable(input_len: np.ndarray, output_len: np.ndarray, max_model_len: int, total_kv_blocks: int,
             block_size: int) -> np.ndarray:
    """Requests the enqueue guard keeps (BLIS EnqueueRequest guards 1-2; events.enqueue)."""
    inputs, outputs = np.asarray(input_len, np.int64), np.asarray(output_len, np.int64)
    ok = -(-inputs // block_size) <= total_kv_blocks
    if max_model_len > 0:
        ok &= (inputs < max_model_len) & ~((outputs > 0) & (inputs + outputs > max_model_len))
    return ok


def _whole_run_steps(input_len: np.ndarray, output_len: np.ndarray, max_num_batched_tokens: int) -> int:
    """Steps of a run in which no two requests ever share a step (an upper bound in practice:
    batching only merges steps); one more per request for the step that starts each."""
    chunk = max(int(max_num_batched_tokens), 1)
    prefill = -(-np.asarray(input_len, np.int64) // chunk)
    return int((prefill + np.maximum(output_len, 1)).sum()) + len(input_len) + 1


# Capacities that may be raised without changing what is simulated: every integer field but the
# block size (strings and flags are structure).
CAPACITY_FIELDS = tuple(f.name for f in dataclasses.fields(EngineDims)
                        if f.type in (int, "int") and f.name != "block_size")


def cover(dims: list[EngineDims] | tuple[EngineDims, ...]) -> EngineDims:
    """The smallest dims at least as large as each of `dims` (one structure), so runs of
    different sizes can share one compiled program."""
    return dataclasses.replace(dims[0], **{f: max(getattr(d, f) for d in dims) for f in CAPACITY_FIELDS})
