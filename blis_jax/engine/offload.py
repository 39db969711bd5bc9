"""BLIS's multi-tier KV offload chain (`--kv-offload-config`, a trace header's `kv_offload` block;
`sim/kv/offload_*.go`, blis-features §2.10) in the jitted engine: a CPU staging tier keyed by
block content, `fs` secondary tiers, and one FIFO I/O station per tier and direction.

The semantics are those of the eager reference tests/reference_offload.py (found against BLIS's
G03/G04 cases; its docstring says what each point is needed for and where BLIS differs):

* CPU staging: `capacity` = ⌊cpu_bytes_to_use / per_block_bytes⌋ slots (cpu_tier.py's slot key /
  LRU stamp / key → slot map, reused) with vLLM's ref count per slot: -1 while a promotion read
  brings the block in, 0 evictable, > 0 pinned by writes to the secondary tiers.
* After each step's execution (clock at the step's start): `poll` the stations (finished writes:
  key on the tier, CPU slot unpinned; finished reads: slots evictable, their keys into the
  promoted keys' LRU, the request ready); then each running request, in batch order, stores its prompt blocks past its last
  stored index, all or nothing (vLLM prepare_store), evicting least recently used evictable
  slots; every fresh CPU block is written to every tier; then, if anything was stored, all its
  blocks are touched.
* The promoted keys' LRU (capacity: the staging tier's; `pro_*`): what BLIS keeps of the blocks
  promotion reads brought in. A later lookup finds them as staging-tier continuations even after
  the staging tier evicted them (G03: every repeat promotion of a group is a load one step
  shorter than a first promotion).
* Batch formation, phase 2 (batch.py): a skip-scan over the wait queue; a request whose prefix
  continues (past its GPU prefix and its CPU or legacy-mirror continuation) on a secondary tier has a read of that run
  submitted once, if the CPU tier has room for it (else refused: KV Thrashing Rate =
  refused / attempted), and is deferred until a poll sees the read done; when every block of the
  run is already coming in by another request's read, no read is submitted (no draw, no attempt):
  the request joins it (a station-less job, JOINED_READ, finishing with those reads). Admission then
  sizes the chunk from the GPU-cached prefix and reloads the CPU continuation as the legacy tier
  does (cpu_tier.reload), free of step time; after a warm load it does not reload: the chunk gets
  fresh blocks at their own positions under their real keys (taking the map entries of blocks
  still holding them), and the blocks the staging tier continued count as hits. Reusing a block
  then drops its key's map entry even when the key maps to another block (kv.pop_blocks: Go's
  delete by the block's own key), so popping such a stale copy unmaps the live block.
* The legacy mirror (BLIS's `--kv-cpu-blocks` store, kept beside the chain with the staging tier's
  capacity, own slots `mir_*`): after each step the running requests' full prompt blocks, by their
  GPU blocks' keys, are stored or touched (LRU, cpu_tier.lru_pass). Synchronous reloads come from
  it alone (after an async load: from it or the staging tier; cpu_tier.on_cpu). A request whose
  prefix the staging tier (or the promoted keys) continues further than the mirror is a warm load
  of its n blocks off the GPU: deferred, a station-less job (WARM_LOAD) ready at the first poll
  past its duration (a fixed PROMOTED_LOAD_US with any promoted key, else CPU_LOAD_US_PER_BLOCK per
  block the mirror lacks), admitted the step after; a load whose run the GPU or the mirror
  continues (FORMATION_LOAD) is done at the first batch formation past FORMATION_LOAD_US_PER_BLOCK
  per block the mirror lacks, and admitted in it. Until then it holds (ref 1, no key) n free-list
  head blocks, which then go back, empty, to the free list's tail; none when only promoted keys
  come or when the GPU holds none of the prompt's blocks.
* A job's service time: base + bytes / (bandwidth · ramp(depth)), times max(0.05, 1 + N·σ) (one
  draw of the instance's `kv-offload` stream per job when σ > 0, at submission; the draws are
  computed on the host, `norm_draws`), rounded half away from zero, at least 1 µs. Its finish is
  fixed at submission: the earliest free server of the station takes it.

Static sizes (dims.offload_*): tiers, servers per station, pending jobs and jitter draws. Pending
jobs or draws running out stop the run with OFFLOAD_FULL, and the driver reruns with more
(growth.py). Without an offload chain `state.off` and `params.off` are None: nothing here is traced.
For now: the fcfs scheduler, no LoRA, no closed-loop sessions, and in clusters no PD pools,
autoscaler or node pools (simulate.py refuses the rest); decode steps are not coasted (coast.py
does not poll the stations).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float64, Int32, Int64

from blis_jax.engine import kv, results
from blis_jax.engine.cpu_tier import BIG
from blis_jax.engine.dims import EngineDims, bucket
from blis_jax.engine.loops import masked_while
from blis_jax.engine.params import INF_TIME
from blis_jax.engine.state import QUEUED
from blis_jax.errors import ConfigError

READ, WRITE = 0, 1
# promotion state of a request
# WARM_LOADED: a warm (async CPU) load done; its admission takes fresh blocks instead of reloading
NO_PROMOTION, PROMOTING, PROMOTED, WARM_LOADED = 0, 1, 2, 3
# the tier of a station-less job: a warm load, a joined read, a warm load timed at batch formations
WARM_LOAD, JOINED_READ, FORMATION_LOAD = -1, -2, -3


class OffloadParams(eqx.Module):
    """Dynamic figures of the chain (changing them does not recompile). T tiers, D draws."""

    capacity: Int64[Array, ""]  # CPU staging blocks
    block_bytes: Float64[Array, ""]  # per_block_bytes
    threads: Int64[Array, "T 2"]  # servers per (tier, read / write)
    bandwidth: Float64[Array, "T 2"]  # bytes / µs
    base_latency: Float64[Array, " T"]  # µs
    saturation_depth: Int64[Array, " T"]
    single_fraction: Float64[Array, " T"]
    jitter: Float64[Array, " T"]  # σ
    norms: Float64[Array, " D"]  # the kv-offload stream's N(0, 1) draws, in order


class OffloadState(eqx.Module):
    """CB CPU slots, KS content keys, T tiers, NS servers, J pending jobs, N requests, W window."""

    slot_ref: Int32[Array, " CB"]  # vLLM ref count (-1 promoting, 0 evictable, > 0 pinned by writes)
    slot_job: Int32[Array, " CB"]  # the promotion read bringing the slot in, -1 none
    on_tier: Bool[Array, "T KS"]  # content keys each secondary tier holds
    server_free: Int64[Array, "T 2 NS"]  # when each server is free (INF_TIME: no such server)
    job_finish: Int64[Array, " J"]  # INF_TIME: empty
    job_tier: Int32[Array, " J"]
    job_write: Bool[Array, " J"]
    job_item: Int64[Array, " J"]  # a write's content key, a read's request
    promo: Int32[Array, " N"]  # NO_PROMOTION / PROMOTING / PROMOTED / WARM_LOADED
    stored: Int64[Array, " N"]  # vLLM's next block index to store, per request
    taken: Bool[Array, " W"]  # FIFO wait-queue entries admitted out of order (the skip-scan)
    draw_pos: Int64[Array, ""]
    # counters
    attempted: Int64[Array, ""]
    refused: Int64[Array, ""]
    promotions_done: Int64[Array, ""]
    promotion_blocks: Int64[Array, ""]
    writes: Int64[Array, ""]
    writes_done: Int64[Array, ""]
    store_skips: Int64[Array, ""]
    cpu_reloads: Int64[Array, ""]
    warm_loads: Int64[Array, ""]
    # the legacy mirror (BLIS's --kv-cpu-blocks store kept beside the chain, same capacity): GPU
    # block keys, LRU (cpu_tier.lru_pass); the only source of synchronous reloads (cpu_tier.on_cpu)
    mir_slot_key: Int64[Array, " CB"]
    mir_slot_stamp: Int64[Array, " CB"]
    mir_key_slot: Int32[Array, " KS"]
    mir_tick: Int64[Array, ""]
    mir_count: Int64[Array, ""]
    # GPU blocks a warm load holds (B pool blocks): its job (-1 none) and the order they were taken
    block_job: Int32[Array, " B"]
    block_seq: Int64[Array, " B"]
    hold_tick: Int64[Array, ""]
    # each GPU block's key before its last reuse (kv.pop_blocks / kv.register_full_blocks)
    popped_key: Int64[Array, " B"]
    # the keys promotion reads brought in: an LRU of the staging tier's capacity of their own
    # (cpu_tier.lru_pass; stores never evict them), found as staging-tier continuations
    pro_slot_key: Int64[Array, " CB"]
    pro_slot_stamp: Int64[Array, " CB"]
    pro_key_slot: Int32[Array, " KS"]
    pro_tick: Int64[Array, ""]
    pro_count: Int64[Array, ""]
    slot_seq: Int64[Array, " CB"]  # when each staging slot was filled (its position in that insertion)
    job_seq: Int64[Array, " J"]  # submission order of the jobs
    job_tick: Int64[Array, ""]


# ----------------------------------------------------------------------------- host side


def validate(cfg) -> None:
    """Clear errors for figures the chain cannot run with (a ConfigError naming the field)."""
    if int(cfg.per_block_bytes) <= 0:
        raise ConfigError(f"kv_offload.per_block_bytes must be > 0, got {cfg.per_block_bytes!r}")
    if int(cfg.cpu_bytes_to_use) < 0:
        raise ConfigError(f"kv_offload.cpu_bytes_to_use must be >= 0, got {cfg.cpu_bytes_to_use!r}")
    if not cfg.offload_prompt_only:
        # BLIS then also stores decode blocks; the engine stores prompt blocks only
        raise ConfigError("kv_offload.offload_prompt_only: false (storing decode blocks too) is not simulated by "
                          "blis-jax yet (issue #24); use true (BLIS's default)")
    for i, t in enumerate(cfg.tiers):
        for name in ("n_read_threads", "n_write_threads", "saturation_queue_depth"):
            if int(getattr(t, name)) < 1:
                raise ConfigError(f"kv_offload.secondary_tiers[{i}].{name} must be >= 1, got {getattr(t, name)!r}")
        for name in ("read_bandwidth", "write_bandwidth"):
            v = getattr(t, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"kv_offload.secondary_tiers[{i}].{name} must be a finite number > 0, got {v!r}")
        for name in ("base_latency", "latency_jitter_stddev"):
            v = getattr(t, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"kv_offload.secondary_tiers[{i}].{name} must be a finite number >= 0, got {v!r}")
        if not (0 < t.single_transfer_fraction <= 1):
            raise ConfigError(f"kv_offload.secondary_tiers[{i}].single_transfer_fraction must be in (0, 1], "
                              f"got {t.single_transfer_fraction!r}")


def has_jitter(cfg) -> bool:
    return any(t.latency_jitter_stddev > 0 for t in cfg.tiers)


def engine_sizes(dims: EngineDims, cfg, growth: int = 1) -> dict:
    """Dims of a run with the chain `cfg`: the CPU slots and key space as the legacy tier's
    (cpu_tier.engine_sizes), and the chain's own."""
    from blis_jax.engine import cpu_tier

    jobs = bucket(1024 * growth)
    # one draw per job: a store's blocks times the tiers, plus the promotions (a first guess; rerun when short)
    draws = bucket(dims.num_requests * dims.blocks_per_request // 2 * max(len(cfg.tiers), 1) * growth, 1024) \
        if has_jitter(cfg) else 0
    servers = max([max(t.n_read_threads, t.n_write_threads) for t in cfg.tiers] or [1])
    return dict(cpu_tier.engine_sizes(dims, cfg.cpu_blocks), offload=True, offload_tiers=len(cfg.tiers),
                offload_servers=bucket(servers, 1), offload_jobs=jobs, offload_draws=draws)


@functools.lru_cache(maxsize=16)
def norm_draws(seed: int, n: int) -> np.ndarray:
    """The first `n` N(0, 1) draws of the instance's `kv-offload` stream (blis-rng §10.3; exact Go)."""
    from blis_jax.rng.streams import KV_OFFLOAD, PartitionedRNG

    rng = PartitionedRNG(seed).for_subsystem(KV_OFFLOAD)
    out = np.array([rng.norm_float64() for _ in range(n)], np.float64)
    out.setflags(write=False)
    return out


def make_params(cfg, dims: EngineDims, seed: int) -> OffloadParams:
    validate(cfg)
    tiers = cfg.tiers
    f64 = lambda v: jnp.asarray(np.asarray(v, np.float64).reshape(-1))  # noqa: E731
    return OffloadParams(
        capacity=jnp.asarray(int(cfg.cpu_blocks), jnp.int64),
        block_bytes=jnp.asarray(float(cfg.per_block_bytes), jnp.float64),
        threads=jnp.asarray(np.array([[t.n_read_threads, t.n_write_threads] for t in tiers], np.int64).reshape(-1, 2)),
        bandwidth=jnp.asarray(np.array([[t.read_bandwidth, t.write_bandwidth] for t in tiers],
                                       np.float64).reshape(-1, 2)),
        base_latency=f64([t.base_latency for t in tiers]),
        saturation_depth=jnp.asarray(np.array([t.saturation_queue_depth for t in tiers], np.int64)),
        single_fraction=f64([t.single_transfer_fraction for t in tiers]),
        jitter=f64([t.latency_jitter_stddev for t in tiers]),
        norms=jnp.asarray(norm_draws(int(seed), dims.offload_draws)),
    )


def init_state(dims: EngineDims, params: OffloadParams) -> OffloadState:
    t, ns, j = dims.offload_tiers, dims.offload_servers, dims.offload_jobs
    i64 = lambda v: jnp.asarray(v, jnp.int64)  # noqa: E731
    server = jnp.arange(ns)
    return OffloadState(
        slot_ref=jnp.zeros(dims.cpu_blocks, jnp.int32),
        slot_job=jnp.full(dims.cpu_blocks, -1, jnp.int32),
        on_tier=jnp.zeros((t, dims.cpu_keys), bool),
        server_free=jnp.where(server[None, None, :] < params.threads[:, :, None], 0, INF_TIME).astype(jnp.int64),
        job_finish=jnp.full(j, INF_TIME, jnp.int64),
        job_tier=jnp.zeros(j, jnp.int32),
        job_write=jnp.zeros(j, bool),
        job_item=jnp.zeros(j, jnp.int64),
        promo=jnp.zeros(dims.num_requests, jnp.int32),
        stored=jnp.zeros(dims.num_requests, jnp.int64),
        taken=jnp.zeros(dims.window, bool),
        draw_pos=i64(0), attempted=i64(0), refused=i64(0), promotions_done=i64(0), promotion_blocks=i64(0),
        writes=i64(0), writes_done=i64(0), store_skips=i64(0), cpu_reloads=i64(0), warm_loads=i64(0),
        mir_slot_key=jnp.full(dims.cpu_blocks, -1, jnp.int64),
        mir_slot_stamp=jnp.full(dims.cpu_blocks, BIG, jnp.int64),
        mir_key_slot=jnp.full(dims.cpu_keys, -1, jnp.int32),
        mir_tick=i64(0), mir_count=i64(0),
        block_job=jnp.full(dims.kv_blocks, -1, jnp.int32),
        block_seq=jnp.zeros(dims.kv_blocks, jnp.int64),
        hold_tick=i64(0),
        popped_key=jnp.full(dims.kv_blocks, -1, jnp.int64),
        pro_slot_key=jnp.full(dims.cpu_blocks, -1, jnp.int64),
        pro_slot_stamp=jnp.full(dims.cpu_blocks, BIG, jnp.int64),
        pro_key_slot=jnp.full(dims.cpu_keys, -1, jnp.int32),
        pro_tick=i64(0), pro_count=i64(0),
        slot_seq=jnp.zeros(dims.cpu_blocks, jnp.int64),
        job_seq=jnp.zeros(j, jnp.int64), job_tick=i64(0),
    )


# ----------------------------------------------------------------------------- I/O stations


def service_us(params: OffloadParams, tier, kind, nbytes, depth, draw):
    """base + bytes / (bandwidth · ramp(depth)), times max(0.05, 1 + draw · σ) when σ > 0, rounded
    half away from zero, >= 1 µs (reference_offload.service_us, operation for operation)."""
    q, f1 = params.saturation_depth[tier], params.single_fraction[tier]
    ramped = f1 + (1 - f1) * (jnp.minimum(depth, q) - 1).astype(jnp.float64) / jnp.maximum(q - 1, 1).astype(jnp.float64)
    ramp = jnp.where((q < 2) | (f1 >= 1), 1.0, ramped)
    base = params.base_latency[tier] + nbytes / (params.bandwidth[tier, kind] * ramp)
    sigma = params.jitter[tier]
    base = jnp.where(sigma > 0, base * jnp.maximum(0.05, 1 + draw * sigma), base)
    return jnp.maximum(1, jnp.floor(base + 0.5)).astype(jnp.int64)


def submit(off: OffloadState, dims: EngineDims, params: OffloadParams, now, tier, kind, nbytes, item, active):
    """Submit one job to station (tier, kind): timed now, taken by the earliest free server.
    Returns (off, job slot, overflow: no pending-job slot or jitter draw left)."""
    pending = (off.job_finish > now) & (off.job_finish < INF_TIME) & (off.job_tier == tier) \
        & (off.job_write == (kind == WRITE))
    depth = jnp.minimum(jnp.sum(pending) + 1, params.threads[tier, kind])
    jitter = params.jitter[tier] > 0
    d = dims.offload_draws
    draw = params.norms[jnp.clip(off.draw_pos, 0, max(d - 1, 0))] if d else jnp.float64(0)
    service = service_us(params, tier, kind, nbytes, depth, draw)
    servers = off.server_free[tier, kind]
    server = jnp.argmin(servers)
    finish = jnp.maximum(now, servers[server]) + service
    job = jnp.argmax(off.job_finish == INF_TIME)
    overflow = active & ((off.job_finish[job] != INF_TIME) | (jitter & (off.draw_pos >= d)))
    go = active & ~overflow
    at = jnp.where(go, job, dims.offload_jobs)
    return dataclasses.replace(
        off,
        server_free=off.server_free.at[jnp.where(go, tier, dims.offload_tiers), kind, server].set(finish, mode="drop"),
        job_finish=off.job_finish.at[at].set(finish, mode="drop"),
        job_tier=off.job_tier.at[at].set(tier, mode="drop"),
        job_write=off.job_write.at[at].set(kind == WRITE, mode="drop"),
        job_item=off.job_item.at[at].set(item, mode="drop"),
        job_seq=off.job_seq.at[at].set(off.job_tick, mode="drop"),
        job_tick=off.job_tick + go,
        draw_pos=off.draw_pos + (go & jitter),
    ), job, overflow


def poll(state, dims: EngineDims, params: OffloadParams, active):
    """Completions of the jobs finished by the clock: a written key is on its tier and its CPU slot
    unpinned; a promotion's slots become evictable, their keys join the promoted keys' LRU, and its
    request is ready; a warm load's request is ready too (but one timed at batch formations)."""
    off = state.off
    return _complete(state, dims, params, active & (off.job_finish <= state.now) & (off.job_tier != FORMATION_LOAD))


def at_formation(state, dims: EngineDims, params: OffloadParams, active):
    """Before phase 2's skip-scan: the warm loads timed at batch formations that are done by now."""
    off = state.off
    return _complete(state, dims, params, active & (off.job_finish <= state.now) & (off.job_tier == FORMATION_LOAD))


def _complete(state, dims: EngineDims, params: OffloadParams, done):
    off = state.off
    state = _remember_promoted(state, dims, params, done & ~off.job_write & (off.job_tier >= 0))
    off = state.off
    writes = done & off.job_write
    reads = done & ~off.job_write
    key = jnp.clip(off.job_item, 0, dims.cpu_keys - 1)
    on_tier = off.on_tier.at[jnp.where(writes, off.job_tier, dims.offload_tiers), key].set(True, mode="drop")
    slot = state.cpu_key_slot[key]
    slot_ref = off.slot_ref.at[jnp.where(writes & (slot >= 0), slot, dims.cpu_blocks)].add(-1, mode="drop")
    arrived = (off.slot_job >= 0) & reads[jnp.maximum(off.slot_job, 0)]
    slot_ref = jnp.where(arrived & (slot_ref == -1), 0, slot_ref)
    promo = off.promo.at[jnp.where(reads, off.job_item, dims.num_requests)].set(
        jnp.where((off.job_tier == WARM_LOAD) | (off.job_tier == FORMATION_LOAD), WARM_LOADED, PROMOTED).astype(jnp.int32),
        mode="drop")
    # a warm load's held GPU blocks go back to the free list's tail, empty, in the order taken
    released = (off.block_job >= 0) & done[jnp.maximum(off.block_job, 0)]
    state = _release_held(state, dims, released)
    return dataclasses.replace(state, off=dataclasses.replace(
        off, on_tier=on_tier, slot_ref=slot_ref, slot_job=jnp.where(arrived, -1, off.slot_job), promo=promo,
        job_finish=jnp.where(done, INF_TIME, off.job_finish), block_job=jnp.where(released, -1, off.block_job),
        writes_done=off.writes_done + jnp.sum(writes),
        promotions_done=off.promotions_done + jnp.sum(reads & (off.job_tier >= 0))))


def _remember_promoted(state, dims: EngineDims, params: OffloadParams, reads):
    """The keys the finished promotion `reads` brought in, stored (or touched) in the promoted
    keys' LRU in submission order, block order (a loop of at most one iteration: it runs only when
    a read finished)."""
    from blis_jax.engine import cpu_tier

    def body(carry, ops, on):
        state, _ = carry
        reads, params = ops
        off = state.off
        arrived = on & (off.slot_job >= 0) & reads[jnp.maximum(off.slot_job, 0)] & (state.cpu_slot_key >= 0)
        order = jnp.lexsort((off.slot_seq, jnp.where(arrived, off.job_seq[jnp.maximum(off.slot_job, 0)], BIG)))
        keys = state.cpu_slot_key[order]
        store = cpu_tier.LruStore(off.pro_slot_key, off.pro_slot_stamp, off.pro_key_slot, off.pro_tick)
        store, _, _ = cpu_tier.lru_pass(store, dims, params.capacity, off.pro_count, keys, arrived[order], on)
        return dataclasses.replace(state, off=dataclasses.replace(
            off, pro_slot_key=store.slot_key, pro_slot_stamp=store.slot_stamp, pro_key_slot=store.key_slot,
            pro_tick=store.tick, pro_count=jnp.sum(store.slot_key >= 0).astype(jnp.int64))), True

    return masked_while(lambda carry, ops: ~carry[1] & jnp.any(ops[0]), body, (state, jnp.asarray(False)),
                        (reads, params))[0]


def _release_held(state, dims: EngineDims, released):
    """Push the `released` held blocks to the free-list tail in the order they were taken (a loop
    of at most one iteration: the sort runs only when some are released)."""
    b = dims.kv_blocks

    def body(carry, ops, on):
        state, _ = carry
        released, seq = ops
        order = jnp.argsort(jnp.where(released, seq, BIG)).astype(jnp.int32)
        live = on & (jnp.arange(b) < jnp.sum(released))
        return kv.push_free(state, dims, order, live), True

    return masked_while(lambda c, ops: ~c[1] & jnp.any(ops[0]), body, (state, jnp.asarray(False)),
                        (released, state.off.block_seq))[0]


# ----------------------------------------------------------------------------- CPU staging slots


def _evict_lru(state, dims: EngineDims, count):
    """Drop the `count` least recently used evictable (ref 0) CPU slots (a loop of at most one
    iteration: under vmap the sort runs only on lanes that evict)."""
    c, nk = dims.cpu_blocks, dims.cpu_keys

    def body(carry, ops, on):
        state, _ = carry
        count, = ops
        off = state.off
        evictable = (state.cpu_slot_key >= 0) & (off.slot_ref == 0)
        order = jnp.argsort(jnp.where(evictable, state.cpu_slot_stamp, BIG))
        rank = jnp.zeros(c, jnp.int64).at[order].set(jnp.arange(c, dtype=jnp.int64))
        gone = on & evictable & (rank < count)
        n = jnp.sum(gone).astype(jnp.int64)
        state = dataclasses.replace(
            state,
            cpu_key_slot=state.cpu_key_slot.at[jnp.where(gone, state.cpu_slot_key, nk)].set(-1, mode="drop"),
            cpu_slot_key=jnp.where(gone, -1, state.cpu_slot_key),
            cpu_slot_stamp=jnp.where(gone, BIG, state.cpu_slot_stamp),
            cpu_count=state.cpu_count - n,
            cpu_evictions=state.cpu_evictions + n,
        )
        return state, True

    return masked_while(lambda carry, ops: ~carry[1] & (ops[0] > 0), body, (state, jnp.asarray(False)), (count,))[0]


def _insert(state, dims: EngineDims, params: OffloadParams, keys, mask, ref, job):
    """Put the `mask`ed keys into free slots below the capacity, in order, most recently used
    (stamped by position), with ref count `ref` and read job `job`."""
    c = dims.cpu_blocks
    off = state.off
    empty = (state.cpu_slot_key < 0) & (jnp.arange(c) < params.capacity)
    free_slots = jnp.nonzero(empty, size=c, fill_value=c)[0]
    dest = jnp.where(mask, free_slots[jnp.clip(jnp.cumsum(mask) - 1, 0, c - 1)], c)
    m = keys.shape[0]
    safe = jnp.where(dest < c, keys, dims.cpu_keys)
    return dataclasses.replace(
        state,
        cpu_slot_key=state.cpu_slot_key.at[dest].set(keys, mode="drop"),
        cpu_slot_stamp=state.cpu_slot_stamp.at[dest].set(state.cpu_tick + jnp.arange(m), mode="drop"),
        cpu_key_slot=state.cpu_key_slot.at[safe].set(dest.astype(jnp.int32), mode="drop"),
        cpu_count=state.cpu_count + jnp.sum(dest < c),
        cpu_tick=state.cpu_tick + m,
        off=dataclasses.replace(off, slot_ref=off.slot_ref.at[dest].set(ref, mode="drop"),
                                slot_job=off.slot_job.at[dest].set(job, mode="drop"),
                                slot_seq=off.slot_seq.at[dest].set(state.cpu_tick + jnp.arange(m), mode="drop")),
    )


def _touch(state, keys, mask):
    """LRU touch of the `mask`ed keys on CPU, in order (the last ends most recently used)."""
    m = keys.shape[0]
    slot = state.cpu_key_slot[jnp.clip(keys, 0, state.cpu_key_slot.shape[0] - 1)]
    hit = mask & (slot >= 0)
    c = state.cpu_slot_key.shape[0]
    return dataclasses.replace(
        state,
        cpu_slot_stamp=state.cpu_slot_stamp.at[jnp.where(hit, slot, c)].set(state.cpu_tick + jnp.arange(m),
                                                                            mode="drop"),
        cpu_tick=state.cpu_tick + jnp.where(jnp.any(hit), m, 0))


def _evictable(state):
    return jnp.sum((state.cpu_slot_key >= 0) & (state.off.slot_ref == 0)).astype(jnp.int64)


def _prompt_keys(dims: EngineDims, req, r):
    j = jnp.arange(dims.blocks_per_request, dtype=jnp.int64)
    return j, kv.content_key(dims, req, r, j), req.input_len[r] // dims.block_size


def _run_from(start, present, j):
    """Length of the run of `present` blocks from block `start` on."""
    return jnp.sum(jnp.cumprod(jnp.where(j >= start, present, True).astype(jnp.int32)) * (j >= start)).astype(jnp.int64)


# ----------------------------------------------------------------------------- after execution


def _store_request(state, dims: EngineDims, params: OffloadParams, req, r, upto, active):
    """vLLM prepare_store of request r's blocks [stored, upto) (all or nothing: skipped when too
    few CPU slots are evictable), a write of every fresh block to every tier, then (if any was
    fresh) a touch of its blocks [0, upto)."""
    off = state.off
    j, keys, _ = _prompt_keys(dims, req, r)
    slot = state.cpu_key_slot[keys]
    fresh = active & (j >= off.stored[r]) & (j < upto) & (slot < 0)
    n_fresh = jnp.sum(fresh).astype(jnp.int64)
    evict = n_fresh - (params.capacity - state.cpu_count)
    skip = active & (evict > 0) & (_evictable(state) < evict)
    go = active & ~skip
    fresh = fresh & go
    state = _evict_lru(state, dims, jnp.where(go, jnp.maximum(evict, 0), 0))
    state = _insert(state, dims, params, keys, fresh, dims.offload_tiers, -1)
    state = _touch(state, keys, go & (n_fresh > 0) & (j < upto))
    # the writes, block by block and tier by tier
    t = max(dims.offload_tiers, 1)
    order = jnp.nonzero(fresh, size=dims.blocks_per_request, fill_value=0)[0]
    n_jobs = jnp.where(go, n_fresh, 0) * dims.offload_tiers

    def body(c, ops, on):
        off, k, full = c
        keys, order, now, params = ops
        off, _, overflow = submit(off, dims, params, now, (k % t).astype(jnp.int32), WRITE, params.block_bytes,
                                  keys[order[k // t]], on)
        return off, k + on, full | overflow

    off, _, full = masked_while(lambda c, ops: (c[1] < ops[0]) & ~c[2],
                                lambda c, ops, on: body(c, ops[1:], on),
                                (state.off, jnp.int64(0), jnp.asarray(False)), (n_jobs, keys, order, state.now, params))
    off = dataclasses.replace(off, stored=off.stored.at[jnp.where(go, r, dims.num_requests)].set(upto, mode="drop"),
                              store_skips=off.store_skips + skip, writes=off.writes + n_jobs)
    return dataclasses.replace(state, off=off, cpu_stores=state.cpu_stores + jnp.where(go, n_fresh, 0),
                               result=state.result | jnp.where(full, results.OFFLOAD_FULL, 0).astype(jnp.int32))


def after_execution(state, dims: EngineDims, params, req, active):
    """Poll the stations, then each running request (batch order) stores its new prompt blocks
    (offload_prompt_only; `validate` refuses it off)."""
    state = poll(state, dims, params.off, active)
    # the requests with new prompt blocks, in batch order: the loop visits only those (most of a
    # batch is decoding, and a store's slot search is O(CPU slots))
    slots = jnp.arange(dims.batch_slots)
    rows = jnp.maximum(state.batch_rows, 0)
    r = jnp.maximum(state.row_req[rows], 0)
    upto = jnp.minimum(state.row_progress[rows], req.input_len[r]) // dims.block_size
    new = active & (slots < state.batch_len) & (upto > state.off.stored[r])
    order = jnp.nonzero(new, size=dims.batch_slots, fill_value=0)[0]

    def body(c, ops, on):
        state, k = c
        params, req, order, r, upto, _ = ops
        i = order[k]
        return _store_request(state, dims, params.off, req, r[i], upto[i], on), k + on

    state = masked_while(lambda c, ops: c[1] < ops[-1], body, (state, jnp.int32(0)),
                         (params, req, order, r, upto, jnp.sum(new).astype(jnp.int32)))[0]
    return _mirror(state, dims, params, req, active)


def _mirror(state, dims: EngineDims, params, req, active):
    """The legacy mirror's write-through after each step: the full prompt blocks of every running
    request (batch order, block order), by their GPU blocks' keys, stored (LRU eviction) or
    touched; not decode blocks (reference_offload.OffloadKVCache.mirror)."""
    from blis_jax.engine import cpu_tier
    from blis_jax.engine.state import NO_KEY

    slots = jnp.arange(dims.batch_slots)
    rows = jnp.maximum(state.batch_rows, 0)
    r = jnp.maximum(state.row_req[rows], 0)
    j = jnp.arange(dims.blocks_per_request)
    in_row = active & (slots < state.batch_len)[:, None] & (j[None, :] < state.row_nblocks[rows][:, None]) \
        & ((j[None, :] + 1) * dims.block_size <= req.input_len[r][:, None])
    keys = jnp.where(in_row, state.block_key[jnp.maximum(state.row_blocks[rows], 0)], NO_KEY).reshape(-1)
    off = state.off
    store = cpu_tier.LruStore(off.mir_slot_key, off.mir_slot_stamp, off.mir_key_slot, off.mir_tick)
    store, _, _ = cpu_tier.lru_pass(store, dims, params.off.capacity, off.mir_count, keys, keys != NO_KEY, active)
    return dataclasses.replace(state, off=dataclasses.replace(
        off, mir_slot_key=store.slot_key, mir_slot_stamp=store.slot_stamp, mir_key_slot=store.key_slot,
        mir_tick=store.tick, mir_count=jnp.sum(store.slot_key >= 0).astype(jnp.int64)))


# ----------------------------------------------------------------------------- batch formation


def _promote(state, dims: EngineDims, params: OffloadParams, r, keys, j, tier, start, length, active):
    """A promotion read of blocks [start, start + length) from `tier` (all of them read; those not
    on CPU take CPU slots, ref -1) if the CPU tier has room for them among its free and
    evictable slots, else refused. Returns (state, submitted)."""
    run = (j >= start) & (j < start + length)
    new = run & (state.cpu_key_slot[keys] < 0)
    n_new = jnp.sum(new).astype(jnp.int64)
    room = params.capacity - state.cpu_count + _evictable(state)
    go = active & (n_new <= room)
    off, job, overflow = submit(state.off, dims, params, state.now, tier, READ,
                                length.astype(jnp.float64) * params.block_bytes, r.astype(jnp.int64), go)
    go = go & ~overflow
    off = dataclasses.replace(off, attempted=off.attempted + active, refused=off.refused + (active & ~go & ~overflow),
                              promotion_blocks=off.promotion_blocks + jnp.where(go, length, 0),
                              promo=off.promo.at[jnp.where(go, r, dims.num_requests)].set(PROMOTING, mode="drop"))
    state = dataclasses.replace(state, off=off,
                                result=state.result | jnp.where(overflow, results.OFFLOAD_FULL, 0).astype(jnp.int32))
    state = _evict_lru(state, dims, jnp.where(go, jnp.maximum(n_new - (params.capacity - state.cpu_count), 0), 0))
    return _insert(state, dims, params, keys, new & go, -1, job.astype(jnp.int32)), go


# How long a warm load takes (found against BLIS's G03 admissions on 2 MiB blocks; the reference's
# `warm_rules`, tests/reference_offload.py, says which request bounds each figure): with any
# promoted key, a fixed time (8.96-14.91 ms fit); else per block the legacy mirror does not hold
# (128.7-139.5 µs fit); a load whose run the GPU or the mirror continues is timed at batch
# formations, per block the mirror does not hold (325.6-563.8 µs fit).
PROMOTED_LOAD_US = 11_520
CPU_LOAD_US_PER_BLOCK = 129
FORMATION_LOAD_US_PER_BLOCK = 420


def _warm_load(state, dims: EngineDims, params, r, n_hold, finish, tier, active):
    """Defer r as a warm load (vLLM load_async): a job of no station (`tier` WARM_LOAD: ready at the
    first poll past `finish`; FORMATION_LOAD: at the first batch formation past it), holding
    `n_hold` GPU blocks from the free-list head, keys dropped, until then (_complete /
    _release_held). Returns (state, deferred)."""
    state, job, go = _stationless_job(state, dims, r, finish, tier, active)
    misses = state.kv_misses
    n = jnp.where(go, jnp.minimum(n_hold, state.free_count), 0)
    state, ids = kv.pop_blocks(state, dims, n, params.total_kv_blocks, dims.blocks_per_request)
    live = jnp.arange(dims.blocks_per_request) < n
    held = jnp.where(live, ids, dims.kv_blocks)
    off = state.off
    off = dataclasses.replace(
        off,
        block_job=off.block_job.at[held].set(job.astype(jnp.int32), mode="drop"),
        block_seq=off.block_seq.at[held].set(off.hold_tick + jnp.arange(dims.blocks_per_request), mode="drop"),
        hold_tick=off.hold_tick + n, warm_loads=off.warm_loads + go)
    return dataclasses.replace(state, off=off, kv_misses=misses), go


def _stationless_job(state, dims: EngineDims, r, finish, tier, active):
    """A job of no station (`tier` WARM_LOAD, FORMATION_LOAD or JOINED_READ) for request r, finishing at
    `finish`; r is then PROMOTING. No free job slot is OFFLOAD_FULL. Returns (state, job, taken)."""
    off = state.off
    job = jnp.argmax(off.job_finish == INF_TIME)
    overflow = active & (off.job_finish[job] != INF_TIME)
    go = active & ~overflow
    at = jnp.where(go, job, dims.offload_jobs)
    off = dataclasses.replace(
        off,
        job_finish=off.job_finish.at[at].set(finish, mode="drop"),
        job_tier=off.job_tier.at[at].set(tier, mode="drop"),
        job_write=off.job_write.at[at].set(False, mode="drop"),
        job_item=off.job_item.at[at].set(r.astype(jnp.int64), mode="drop"),
        promo=off.promo.at[jnp.where(go, r, dims.num_requests)].set(PROMOTING, mode="drop"))
    return dataclasses.replace(state, off=off,
                               result=state.result | jnp.where(overflow, results.OFFLOAD_FULL, 0).astype(jnp.int32)), \
        job, go


def _join(state, dims: EngineDims, r, finish, active):
    """Defer r on blocks another request's read is bringing in (no read, no draw, no attempt): a
    job of no station (JOINED_READ) finishing with the last of those reads, so that the poll reporting
    them reports r ready. Returns (state, joined)."""
    state, _, go = _stationless_job(state, dims, r, finish, JOINED_READ, active)
    return state, go


def before_admission(state, dims: EngineDims, params, req, r, n_hit, on_gpu, active):
    """The skip-scan's look at waiting request r (GPU prefix `n_hit` blocks, `on_gpu` the prompt
    blocks the GPU holds): deferred while its async load is in flight; deferred as a warm load when
    the staging tier continues the prefix further than the legacy mirror; a promotion submitted (and
    r deferred) when its prefix continues, past the blocks on CPU, on a secondary tier. Returns
    (state, skipped, loaded earlier, warm-loaded earlier, the staging tier's run past the GPU prefix)."""
    off = state.off
    p = off.promo[r]
    deferred = active & (p == PROMOTING)
    j, keys, n_full = _prompt_keys(dims, req, r)
    slot = state.cpu_key_slot[keys]
    staged = (slot >= 0) & (off.slot_ref[jnp.maximum(slot, 0)] >= 0) & (j < n_full)
    on_cpu = staged | ((off.pro_key_slot[keys] >= 0) & (j < n_full))
    cpu_run = _run_from(n_hit, on_cpu, j)
    mirror_run = _run_from(n_hit, (off.mir_key_slot[keys] >= 0) & (j < n_full), j)
    # its blocks: the continuation the CPU holds and the GPU does not. A load holds none when only
    # promoted keys come (G03 request 115: holding 114's 64 takes its cached prefix) or when the GPU
    # holds none of the prompt's blocks (G03 request 203: 201's held blocks take its prefix)
    n_load = _run_from(n_hit, on_cpu & ~on_gpu, j)
    loaded = (j >= n_hit) & (j < n_hit + n_load)
    mirrored = off.mir_key_slot[keys] >= 0
    unmirrored = jnp.sum(loaded & ~mirrored).astype(jnp.int64)
    after = jnp.minimum(n_hit + n_load, dims.blocks_per_request - 1)
    continued = (n_hit + n_load < n_full) & (on_gpu[after] | mirrored[after])
    no_hold = ~jnp.any(staged & loaded) | ~jnp.any(on_gpu & (j < n_full))
    took = jnp.where(continued, unmirrored * FORMATION_LOAD_US_PER_BLOCK,
                     jnp.where(jnp.any(~staged & loaded), PROMOTED_LOAD_US,
                               jnp.maximum(unmirrored, 1) * CPU_LOAD_US_PER_BLOCK))
    state, warm = _warm_load(state, dims, params, r, jnp.where(no_hold, 0, n_load), state.now + took,
                             jnp.where(continued, FORMATION_LOAD, WARM_LOAD).astype(jnp.int32),
                             active & ~deferred & (p == NO_PROMOTION) & (cpu_run > mirror_run))
    deferred = deferred | warm
    off = state.off
    # blocks the legacy mirror continues are reloaded, not promoted (G03 request 172)
    far_start = n_hit + jnp.maximum(cpu_run, mirror_run)
    runs = jnp.stack([_run_from(far_start, off.on_tier[t, keys] & (j < n_full), j)
                      for t in range(dims.offload_tiers)]) if dims.offload_tiers else jnp.zeros(1, jnp.int64)
    tier = jnp.argmax(runs).astype(jnp.int32)   # the longest run, the first tier on a tie
    want = active & ~deferred & (p == NO_PROMOTION) & (runs[tier] > 0)
    # every block of the run already coming in by another read: r joins it (G04 requests 90, 91)
    run = (j >= far_start) & (j < far_start + runs[tier])
    slot = state.cpu_key_slot[keys]
    ref_job = off.slot_job[jnp.maximum(slot, 0)]
    pending = (slot >= 0) & (off.slot_ref[jnp.maximum(slot, 0)] == -1) & (ref_job >= 0)
    finish = jnp.max(jnp.where(run & pending, off.job_finish[jnp.maximum(ref_job, 0)], 0))
    state, joined = _join(state, dims, r, finish, want & jnp.all(pending | ~run))
    state, promoted = _promote(state, dims, params.off, r, keys, j, tier, far_start, runs[tier], want & ~joined)
    skipped = deferred | joined | promoted
    proceeds = active & ~skipped
    off = state.off
    return dataclasses.replace(state, off=dataclasses.replace(
        off, promo=off.promo.at[jnp.where(proceeds, r, dims.num_requests)].set(NO_PROMOTION, mode="drop"))), \
        skipped, proceeds & (p >= PROMOTED), proceeds & (p == WARM_LOADED), cpu_run


def after_reload(state, dims: EngineDims, req, r, n_hit, n_reload):
    """The reloaded CPU continuation is touched (block order) and counted."""
    j, keys, _ = _prompt_keys(dims, req, r)
    state = _touch(state, keys, (j >= n_hit) & (j < n_hit + n_reload))
    return dataclasses.replace(state, off=dataclasses.replace(state.off, cpu_reloads=state.off.cpu_reloads + n_reload))


# ----------------------------------------------------------------------------- the skip-scan's cursor
# fcfs wait queue (waitqueue.py): the preempted stack (top first), then FIFO positions. The cursor
# is (front entries skipped, FIFO position of the current candidate); admitted FIFO entries past
# the head are marked `taken` so that the head skips them (waitqueue._skip_gone).


def _fifo_gone(state, pos):
    slot = pos & (state.win_status.shape[0] - 1)
    return (state.win_status[slot] != QUEUED) | state.off.taken[slot]


def _next_fifo(state, pos):
    """The first FIFO position >= pos still waiting (or enq_pos)."""
    return masked_while(lambda c, s: (c < s.enq_pos) & _fifo_gone(s, c), lambda c, s, on: c + on, pos, state)


def cursor_start(state):
    return jnp.int32(0), _next_fifo(state, state.fifo_head)


def cursor_valid(state, cursor):
    k, pos = cursor
    return (k < state.front_len) | (pos < state.enq_pos)


def candidate(state, cursor):
    """(request at the cursor, whether it is a preempted one)."""
    k, pos = cursor
    from_front = k < state.front_len
    n = state.enqueue_order.shape[0]
    r = jnp.where(from_front, state.front[jnp.maximum(state.front_len - 1 - k, 0)],
                  state.enqueue_order[jnp.minimum(pos, n - 1)])
    return r, from_front


def take(state, dims: EngineDims, r, from_front, cursor, admit):
    """Remove the admitted candidate from the wait queue."""
    from blis_jax.engine import waitqueue

    state = waitqueue.remove(state, dims, r, admit & from_front)
    fifo = admit & ~from_front
    slot = jnp.where(fifo, cursor[1] & (dims.window - 1), dims.window)
    return dataclasses.replace(state, wait_len=state.wait_len - fifo,
                               off=dataclasses.replace(state.off, taken=state.off.taken.at[slot].set(True, mode="drop")))


def advance(state, cursor, from_front, passed, admitted):
    """The cursor after the candidate was passed over (skipped) or admitted."""
    k, pos = cursor
    k = k + (passed & from_front)
    moved = (passed | admitted) & ~from_front
    pos = jnp.where(moved, _next_fifo(state, pos + moved), pos)
    return k, pos
