"""BLIS's legacy CPU KV tier (blis-features §2.10, `--kv-cpu-blocks`; `sim/kv/tiered.go`).

A CPU store of block contents keyed by content key (kv.content_key stands in for BLIS's hash),
LRU over at most `capacity` entries:

* after each step every hashed block of the running requests is written through to it
  (`mirror`): an entry already there is touched, a new one is stored, evicting the least
  recently used entry when the store is full;
* when a new request is allocated, the full prompt blocks after its GPU-cached prefix that are
  on CPU are reloaded into free GPU blocks (`reload`, with BLIS's order of operations: see there);
  each adds `reload_us` = base latency + ⌈block size / bandwidth⌉ µs to the current step. The
  request then claims the GPU-cached prefix as it stands after the reload (batch.py); its
  prefill chunk, fixed before the reload, is not shortened.

In the engine the store is `dims.cpu_blocks` slots (key, LRU stamp) plus a key → slot map over
the whole key space (`dims.cpu_keys`), so membership is one gather and runs stay jitted and
vmappable. `dims.cpu_blocks == 0` (no CPU tier) traces none of this.

Blocks a request allocates at token positions other than their index (after a reload re-keyed
its own cached blocks, or past a prefix that reached beyond its chunk) get a key nothing else has
(kv.unique_key), as BLIS hashes them, so they are stored on CPU and counted as BLIS counts them.

Known differences from BLIS (tests/blis_diff.py names the reference cases they affect; the eager
reference tests/reference_tiered.py has the first one right):
* one pass of `mirror` counts one store for each key not on CPU when the pass starts, and the
  evictions that leave the store full: BLIS's sequential pass can evict a key before a later use
  in the same pass (an old entry it touches late, or a block it stored early) and then stores it
  again, counting one more store and eviction each time. The entries after each pass, and their
  LRU order, are BLIS's; the store and eviction counts (KV Thrashing Rate) are lower under CPU
  pressure, by those re-stores (tests/test_cpu_tier.py);
* an allocation that fails after a reload claims nothing, where BLIS leaves the claimed prefix
  committed to the waiting request (no rollback). The engine counts these allocations
  (`cpu_reload_failures`, SimOutput.cpu_reload_failures) and `simulate` warns when there are
  any, so that figures off BLIS's in that regime are never given silently.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int64

from blis_jax.engine.dims import EngineDims, bucket
from blis_jax.engine.loops import masked_while
from blis_jax.errors import ConfigError

BIG = (1 << 62)


@dataclasses.dataclass(frozen=True)
class CpuTier:
    """Host-side settings: `--kv-cpu-blocks`, `--kv-transfer-bandwidth` (BLIS calls it blocks per
    tick, but divides the block size in tokens by it; see reload_time_us),
    `--kv-transfer-base-latency` (µs). BLIS's `--kv-offload-threshold` is ignored, as BLIS ignores it."""

    blocks: int
    bandwidth: float = 100.0
    base_latency_us: int = 0


class CpuTierParams(eqx.Module):
    capacity: Int64[Array, ""]  # CPU blocks (--kv-cpu-blocks)
    reload_us: Int64[Array, ""]  # step-time cost of one reloaded block


def reload_time_us(block_size: int, bandwidth: float, base_latency: int) -> int:
    """Step time of one reloaded block: base latency + ⌈block size (tokens) / bandwidth⌉ µs, as BLIS."""
    return int(base_latency) + math.ceil(block_size / bandwidth)


def make_params(cpu_blocks: int, block_size: int, bandwidth: float, base_latency: int) -> CpuTierParams:
    if not (isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0):
        raise ConfigError(f"--kv-transfer-bandwidth must be a finite number > 0, got {bandwidth!r}")
    if int(base_latency) < 0:
        raise ConfigError(f"--kv-transfer-base-latency must be >= 0, got {base_latency!r}")
    return CpuTierParams(capacity=jnp.asarray(int(cpu_blocks), jnp.int64),
                         reload_us=jnp.asarray(reload_time_us(block_size, bandwidth, base_latency), jnp.int64))


def engine_sizes(dims: EngineDims, cpu_blocks: int) -> dict:
    """Dims of a run with a CPU tier of `cpu_blocks` blocks. Its steps are not coasted (coast.py
    does not mirror)."""
    # content keys, then the unique keys of blocks at shifted positions (kv.unique_key)
    keys = dims.prefix_groups * dims.prefix_blocks + 2 * dims.num_requests * dims.blocks_per_request
    return dict(cpu_blocks=bucket(cpu_blocks, 16), cpu_keys=keys, coast_steps=1)


def init_arrays(dims: EngineDims) -> dict:
    c, k = dims.cpu_blocks, dims.cpu_keys if dims.cpu_blocks else 0
    return dict(
        cpu_slot_key=jnp.full(c, -1, jnp.int64),
        cpu_slot_stamp=jnp.full(c, BIG, jnp.int64),
        cpu_key_slot=jnp.full(k, -1, jnp.int32),
        cpu_tick=jnp.int64(0),
        cpu_count=jnp.int64(0),
        cpu_stores=jnp.int64(0),
        cpu_evictions=jnp.int64(0),
        cpu_misses=jnp.int64(0),
        cpu_reload_failures=jnp.int64(0),
        cpu_pending_us=jnp.int64(0),
    )


def on_cpu(state, keys, fresh=False):
    """Whether each content key can be reloaded from CPU. With an offload chain (offload.py): the
    keys in its legacy mirror, and after an async load (`fresh`) also the staging tier's entries
    not still being brought in by a promotion read (ref count -1)."""
    safe = jnp.clip(keys, 0, state.cpu_key_slot.shape[0] - 1)
    slot = state.cpu_key_slot[safe]
    if state.off is not None:
        staged = (slot >= 0) & (state.off.slot_ref[jnp.maximum(slot, 0)] >= 0)
        return (state.off.mir_key_slot[safe] >= 0) | (fresh & staged)
    return slot >= 0


def mirror(state, dims: EngineDims, params, active):
    """Write every hashed block of the running batch through to CPU (batch order, block order).

    BLIS touches or stores the blocks one by one; an LRU store then holds the `capacity` keys
    used last, each stamped with its last use. So here every key of the pass is stamped with
    its last position in the pass (tick + position), and the entries kept are the `capacity`
    most recent of the old entries and the pass's keys together: the `evict` least recent go,
    old or new (a new entry can be evicted by later ones in the same pass)."""
    from blis_jax.engine.state import NO_KEY

    slots = jnp.arange(dims.batch_slots)
    rows = jnp.maximum(state.batch_rows, 0)
    j = jnp.arange(dims.blocks_per_request)
    in_row = active & (slots < state.batch_len)[:, None] & (j[None, :] < state.row_nblocks[rows][:, None])
    blocks = state.row_blocks[rows]
    keys = jnp.where(in_row, state.block_key[jnp.maximum(blocks, 0)], NO_KEY).reshape(-1)
    store = LruStore(state.cpu_slot_key, state.cpu_slot_stamp, state.cpu_key_slot, state.cpu_tick)
    store, n_new, evict = lru_pass(store, dims, params.cpu.capacity, state.cpu_count, keys, keys != NO_KEY, active)
    return dataclasses.replace(
        state,
        cpu_slot_key=store.slot_key,
        cpu_slot_stamp=store.slot_stamp,
        cpu_key_slot=store.key_slot,
        cpu_tick=store.tick,
        cpu_count=jnp.sum(store.slot_key >= 0).astype(jnp.int64),
        cpu_stores=state.cpu_stores + jnp.where(active, n_new, 0),
        cpu_evictions=state.cpu_evictions + jnp.where(active, evict, 0),
    )


class LruStore(eqx.Module):
    """An LRU key store's arrays: CB slots (key, LRU stamp), the key -> slot map over KS keys, the tick."""

    slot_key: Int64[Array, " CB"]
    slot_stamp: Int64[Array, " CB"]
    key_slot: Array  # int32 [KS]
    tick: Int64[Array, ""]


def _first_and_last_use(keys, key_space: int):
    """For each position of `keys` (values in [0, key_space], key_space for none), the first and
    the last position holding the same key. Per-step work stays independent of the number of
    requests (the key space grows with it): a scatter over the key space while that space is
    at most 8x the pass (cheapest there), else a sort of the pass's keys."""
    m = keys.shape[0]
    pos = jnp.arange(m, dtype=jnp.int64)
    if key_space <= 8 * m:
        in_keys = jnp.minimum(keys, key_space - 1)
        first = jnp.full(key_space, m, jnp.int64).at[keys].min(pos, mode="drop")[in_keys]
        last = jnp.full(key_space, -1, jnp.int64).at[keys].max(pos, mode="drop")[in_keys]
        return first, last
    packed = jnp.sort(keys.astype(jnp.int64) * m + pos)   # by key, then position
    key, at = packed // m, packed % m
    starts = jnp.concatenate([jnp.ones(1, bool), key[1:] != key[:-1]])
    ends = jnp.concatenate([key[1:] != key[:-1], jnp.ones(1, bool)])
    i = jnp.arange(m)
    seg_first = at[jax.lax.cummax(jnp.where(starts, i, 0))]
    seg_last = at[jax.lax.cummin(jnp.where(ends, i, m - 1), reverse=True)]
    return jnp.zeros(m, jnp.int64).at[at].set(seg_first), jnp.zeros(m, jnp.int64).at[at].set(seg_last)


def lru_pass(store: LruStore, dims: EngineDims, capacity, count, keys, valid, active):
    """One write-through pass of `keys` (the `valid` ones, in order) into the LRU store (see
    `mirror`; `count`: its entries). Returns (store, keys newly stored, entries evicted).

    The pass is padded to every batch slot's whole block row; its valid keys (the running
    requests' blocks) are usually far fewer. When the padded pass is long (at least 4x
    `short_pass(dims)`) and they fit `short_pass(dims)`, the pass runs on them alone, in order
    (the same entries, order and counts: only the stamps' spacing differs); else on the whole
    padded pass, in a loop of at most one iteration so that under vmap only the lanes that need
    it pay for it."""
    m = keys.shape[0]
    short = short_pass(dims)
    if 4 * short > m:   # little to gain for the cost of compiling two passes
        return _pass(store, dims, capacity, count, keys, valid, active)
    fits = jnp.sum(valid) <= short
    # the valid keys' positions, in order (a scatter: cheaper here than jnp.nonzero)
    at = jnp.full(short, m, jnp.int32).at[jnp.where(valid, jnp.cumsum(valid) - 1, short)].set(
        jnp.arange(m, dtype=jnp.int32), mode="drop")
    store, n_new, evict = _pass(store, dims, capacity, count, keys[jnp.minimum(at, m - 1)], (at < m) & fits,
                                active & fits)

    def cond(carry, ops):
        return ~carry[-1] & ~ops[-1]

    def body(carry, ops, on):
        store, n_new, evict, done = carry
        capacity, count, keys, valid, active, _ = ops
        on = on & ~done   # read from the carry, so that XLA cannot hoist the pass out of the loop
        store, more, evicted = _pass(store, dims, capacity, count, keys, valid & on, active & on)
        return store, n_new + more, evict + evicted, done | on

    store, n_new, evict, _ = masked_while(cond, body, (store, n_new, evict, jnp.asarray(False)),
                                          (capacity, count, keys, valid, active, fits))
    return store, n_new, evict


def short_pass(dims: EngineDims) -> int:
    """Keys of a pass run on its valid keys alone: twice the GPU blocks (a running batch's blocks
    are distinct but for shared prefix blocks)."""
    return bucket(2 * dims.kv_blocks)


def _pass(store: LruStore, dims: EngineDims, capacity, count, keys, valid, active):
    """lru_pass over `keys` as they are."""
    m = keys.shape[0]
    pos = jnp.arange(m, dtype=jnp.int64)
    nk = dims.cpu_keys
    safe_key = jnp.where(valid, keys, nk)
    in_keys = jnp.minimum(safe_key, nk - 1)
    first_pos, last_pos = _first_and_last_use(safe_key, nk)
    first = valid & (first_pos == pos)
    slot = store.key_slot[in_keys]
    present = first & (slot >= 0)
    new = first & (slot < 0)
    n_new = jnp.sum(new).astype(jnp.int64)
    stamp = store.tick + last_pos       # a key's last use in this pass
    c = dims.cpu_blocks
    slot_stamp = store.slot_stamp.at[jnp.where(present, slot, c)].set(stamp, mode="drop")
    evict = jnp.maximum(count + n_new - capacity, 0)
    # The new keys by last use: at each pass position, how many new keys were last used before it.
    last_of_new = valid & (last_pos == pos) & (slot < 0)
    new_before = jnp.cumsum(last_of_new) - last_of_new

    # Eviction of the `evict` least recently used of the old entries and the new keys: a loop of
    # at most one iteration so that under vmap the sort runs only on lanes that evict. The traced
    # values it reads are operands: a custom vmap rule (masked_while) cannot close over batched
    # ones, as a cluster's instances are.
    def cond(carry, ops):
        return ~carry[-1] & (ops[0] > 0)

    def body(carry, ops, on):
        slot_key, slot_stamp, key_slot, dropped, _ = carry
        evict, tick, new_before, last_pos, stamp, new = ops
        occupied = slot_key >= 0
        by_stamp = jnp.where(occupied, slot_stamp, BIG)
        order = jnp.argsort(by_stamp)
        rank = jnp.zeros(c, jnp.int64).at[order].set(jnp.arange(c, dtype=jnp.int64))
        # An entry's rank among old and new together: its rank among the old ones plus the new keys
        # used before it (none before an entry this pass did not touch: its stamp is below the tick).
        touched = occupied & (slot_stamp >= tick)
        rank = rank + jnp.where(touched, new_before[jnp.clip(slot_stamp - tick, 0, m - 1)], 0)
        gone = on & occupied & (rank < evict)
        new_rank = new_before[jnp.clip(last_pos, 0, m - 1)] + jnp.searchsorted(by_stamp[order], stamp)
        key_slot = key_slot.at[jnp.where(gone, slot_key, nk)].set(-1, mode="drop")
        return (jnp.where(gone, -1, slot_key), jnp.where(gone, BIG, slot_stamp), key_slot,
                dropped | (on & new & (new_rank < evict)), on)

    slot_key, slot_stamp, key_slot, dropped, _ = masked_while(
        cond, body, (store.slot_key, slot_stamp, store.key_slot, jnp.zeros(m, bool), jnp.asarray(False)),
        (evict, store.tick, new_before, last_pos, stamp, new))
    # The new entries kept, in order of first use, into the free slots below the capacity, in slot order.
    kept = new & ~dropped
    empty = (slot_key < 0) & (jnp.arange(c) < capacity)
    free_slots = jnp.nonzero(empty, size=c, fill_value=c)[0]
    dest = jnp.where(kept, free_slots[jnp.clip(jnp.cumsum(kept) - 1, 0, c - 1)], c)
    slot_key = slot_key.at[dest].set(keys, mode="drop")
    slot_stamp = slot_stamp.at[dest].set(stamp, mode="drop")
    key_slot = key_slot.at[jnp.where(dest < c, safe_key, nk)].set(dest.astype(jnp.int32), mode="drop")
    return LruStore(slot_key, slot_stamp, key_slot, store.tick + jnp.where(active, m, 0)), n_new, evict


def reload(state, dims: EngineDims, params, req, r, n_hit, cand, hit, active, fresh=False):
    """BLIS's reload from CPU when a new request is allocated (`sim/kv/tiered.go`).

    From the first block past the GPU-cached prefix, the prompt's full blocks that are on CPU and
    not on the GPU are reloaded, stopping at the first CPU miss, at the first block the GPU
    already holds, and at the free count. Each reload pops the free-list head, takes the block's
    content key and goes back to the free-list tail (refcount 0). The head can be one of the
    request's own cached blocks, still on the free list: it is then re-keyed and its prefix lost
    (BLIS claims the cached prefix only afterwards). Afterwards the GPU-cached prefix is looked up
    again. `fresh`: the request comes from an async load (offload.py; on_cpu). Returns (state,
    the blocks of that prefix, its length, the number reloaded, the number
    of the request's cached blocks re-keyed)."""
    from blis_jax.engine import kv

    m = dims.blocks_per_request
    j = jnp.arange(m, dtype=jnp.int64)
    keys = kv.content_key(dims, req, r, j)
    n_full = req.input_len[r] // dims.block_size
    # A block the GPU holds stops the reload unless the reload has popped it by then (BLIS checks
    # block by block): reload i pops the free list's i-th block.
    on_gpu = hit & ~(state.block_free[jnp.maximum(cand, 0)] & (kv.free_rank(state, dims, params.total_kv_blocks, cand)
                                                              < j - n_hit))
    if dims.offload:
        # ... or any free block holding its key (a stale copy): popping it deletes the key's map
        # entry (kv.pop_blocks)
        every = jnp.arange(dims.kv_blocks)
        rank = jnp.where(state.block_free & (state.block_key >= 0),
                         kv.free_rank(state, dims, params.total_kv_blocks, every), BIG)
        first = jnp.min(jnp.where(state.block_key[None, :] == keys[:, None], rank[None, :], BIG), axis=1)
        on_gpu = on_gpu & ~(first < j - n_hit)
    want = on_cpu(state, keys, fresh) & ~on_gpu & (j < n_full)
    run = jnp.sum(jnp.cumprod(jnp.where(j >= n_hit, want, True).astype(jnp.int32)) * (j >= n_hit))
    run = jnp.where(active, jnp.minimum(run, state.free_count), 0).astype(jnp.int64)
    # The request's cached blocks the reload pops (re-keyed): BLIS counts them as hits all the same.
    lost = jnp.sum((j < n_hit) & state.block_free[jnp.maximum(cand, 0)]
                   & (kv.free_rank(state, dims, params.total_kv_blocks, cand) < run)).astype(jnp.int64)
    misses = state.kv_misses
    state, ids = kv.pop_blocks(state, dims, run, params.total_kv_blocks, m)
    live = j < run
    state = kv.register_full_blocks(state, dims, req, jnp.broadcast_to(r, (m,)), ids, n_hit + j, live, popped=live)
    state = kv.push_free(state, dims, ids, live)
    state = dataclasses.replace(state, kv_misses=misses,
                                cpu_pending_us=state.cpu_pending_us + run * params.cpu.reload_us)
    # the prefix as the GPU holds it now
    k = jnp.clip(j - n_hit, 0, m - 1)
    blocks = jnp.where((j >= n_hit) & (j < n_hit + run), ids[k], cand)
    ok = (j < n_full) & (blocks >= 0) & (state.block_key[jnp.maximum(blocks, 0)] == keys)
    if dims.offload:   # and still in the map (the reload's pops may have deleted the entry)
        mapped = state.group_block[jnp.maximum(req.prefix_group[r], 0), jnp.minimum(j, dims.prefix_blocks - 1)]
        ok = ok & ((j >= req.shared_blocks[r]) | (mapped == blocks))
    n_cached = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int64)
    return state, blocks, n_cached, run, lost
