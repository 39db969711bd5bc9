"""Paged KV cache of one instance: block pool, LRU free list and automatic prefix caching.

Behaviour follows BLIS's single-tier cache (blis-features §2.9):

* The free list starts as blocks 0..N-1 in order; allocation pops the head; a release
  appends a request's blocks to the tail in reverse order. Here the never-used blocks are a
  counter (`fresh_next`, always at the head) and released blocks sit in a FIFO ring. A free
  block that is claimed as a prefix-cache hit leaves the list from the middle: its ring entry
  becomes a tombstone (`ring_pos` no longer matches) that pops skip; the ring is compacted
  when it runs out of room.
* A free block keeps its content key until it is popped again, so freed prefixes stay
  reusable (LRU over free blocks).
* Content keys stand in for BLIS's SHA-256 hash chains. Token contents are synthetic: the
  full blocks inside a prefix group's shared prefix are identical across the group
  (key = group, block index); every other block is unique to its request (key = request,
  block index). Only full blocks get a key.
* Allocation is check-then-act: callers verify `blocks_needed <= free_count` first.
* BLIS quirk kept for parity: a prompt that is fully cached is admitted with zero new tokens
  and then claims nothing (no hits, no references); its later decode blocks start at token
  `row_offset` = prompt length and can never be hit, so they get no content key (with a CPU
  tier a unique one, `unique_key`, so that they are stored on CPU as BLIS stores them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from blis_jax.engine import results
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.state import NO_KEY, EngineState, RequestArrays, row_of


def content_key(dims: EngineDims, req: RequestArrays, r, j):
    """Content key of block j of request r (broadcasts over r and j)."""
    r = jnp.asarray(r)
    j = jnp.asarray(j, jnp.int64)
    group = req.prefix_group[r].astype(jnp.int64)
    shared = req.shared_blocks[r]
    group_key = group * dims.prefix_blocks + j
    own_key = dims.prefix_groups * dims.prefix_blocks + r.astype(jnp.int64) * dims.blocks_per_request + j
    return jnp.where(j < shared, group_key, own_key)


def blocks_needed(dims: EngineDims, nblocks, kv_tokens, new_tokens, offset=0):
    """New blocks for `new_tokens` more tokens after filling the last block's spare slots."""
    bs = dims.block_size
    spare = offset + nblocks.astype(jnp.int64) * bs - kv_tokens
    return (jnp.maximum(new_tokens - spare, 0) + bs - 1) // bs


# ----------------------------------------------------------------------------- free list


def _ring_entry_valid(state: EngineState, dims: EngineDims, pos):
    entry = state.ring[pos % dims.free_ring]
    safe = jnp.maximum(entry, 0)
    valid = (pos < state.ring_tail) & (entry >= 0) & state.block_free[safe] & (state.ring_pos[safe] == pos)
    return entry, valid


def _compact_ring(state: EngineState, dims: EngineDims) -> EngineState:
    """Drop tombstones: rewrite the live entries, in order, from position 0."""
    pos = state.ring_head + jnp.arange(dims.free_ring, dtype=jnp.int64)
    entry, valid = _ring_entry_valid(state, dims, pos)
    new_pos = jnp.cumsum(valid) - 1
    ring = jnp.full(dims.free_ring, -1, jnp.int32).at[jnp.where(valid, new_pos, dims.free_ring)].set(
        entry, mode="drop"
    )
    ring_pos = state.ring_pos.at[jnp.where(valid, entry, dims.kv_blocks)].set(new_pos, mode="drop")
    return dataclasses.replace(
        state, ring=ring, ring_pos=ring_pos, ring_head=jnp.int64(0), ring_tail=jnp.sum(valid).astype(jnp.int64)
    )


def _ensure_ring_room(state: EngineState, dims: EngineDims, incoming) -> EngineState:
    def needs(s):
        return s.ring_tail - s.ring_head + incoming > dims.free_ring

    def compact(c, _, on):
        s, _ = c
        new = _compact_ring(s, dims)
        keep = lambda a, b: jnp.where(on, a, b)  # noqa: E731
        s = dataclasses.replace(s, ring=keep(new.ring, s.ring), ring_pos=keep(new.ring_pos, s.ring_pos),
                                ring_head=keep(new.ring_head, s.ring_head), ring_tail=keep(new.ring_tail, s.ring_tail))
        return s, c[1] | on

    # A loop (not cond) so that under vmap the O(ring) compaction runs only when needed.
    state = masked_while(lambda c, extra: (c[0].ring_tail - c[0].ring_head + extra > dims.free_ring) & ~c[1],
                         compact, (state, jnp.asarray(False)), incoming)[0]
    return dataclasses.replace(
        state, result=state.result | jnp.where(needs(state), results.FREE_RING_FULL, 0).astype(jnp.int32)
    )


def pop_blocks(state: EngineState, dims: EngineDims, count, total_kv_blocks, max_blocks: int):
    """Pop `count` (<= max_blocks, static) blocks from the free-list head. Returns
    (state, ids[max_blocks]); the first `count` ids are valid. The popped blocks get
    refcount 1 and no content key."""
    m = max_blocks
    slot = jnp.arange(m, dtype=jnp.int64)
    count = jnp.minimum(count, m).astype(jnp.int64)
    fresh_left = total_kv_blocks - state.fresh_next.astype(jnp.int64)
    n_fresh = jnp.clip(jnp.minimum(count, fresh_left), 0)
    ids = jnp.where(slot < n_fresh, state.fresh_next.astype(jnp.int64) + slot, -1).astype(jnp.int32)
    need = count - n_fresh

    # The loop carries the state (read-only here) instead of capturing it: a captured block
    # array that is updated after the loop would be copied by XLA on every call.
    def cond(c, ops):
        _, got, head, s = c
        need, _ = ops
        return (got < need) & (head < s.ring_tail)

    def body(c, ops, on):
        ids, got, head, s = c
        need, n_fresh = ops
        pos = head + slot
        entry, valid = _ring_entry_valid(s, dims, pos)
        rank = jnp.cumsum(valid)
        take = on & valid & (rank <= need - got)
        ids = ids.at[jnp.where(take, n_fresh + got + rank - 1, m)].set(entry, mode="drop")
        taken = jnp.sum(take)
        last = jnp.max(jnp.where(take, slot, -1))
        next_head = jnp.where(got + taken >= need, head + last + 1, jnp.minimum(head + m, s.ring_tail))
        return ids, got + taken, jnp.where(on, next_head, head), s

    ids, _, head, state = masked_while(cond, body, (ids, jnp.int64(0), state.ring_head, state), (need, n_fresh))
    live = slot < count
    target = jnp.where(live, ids, dims.kv_blocks)
    if dims.offload:
        # Go deletes a reused block's key from the map by the block's own key, even when the key
        # maps to another block now (a warm load's fresh chunk leaves such stale copies, offload.py)
        old = state.block_key[jnp.maximum(ids, 0)].astype(jnp.int64)
        grouped = live & (old >= 0) & (old < dims.prefix_groups * dims.prefix_blocks)
        state = dataclasses.replace(state, group_block=state.group_block.at[
            jnp.where(grouped, old // dims.prefix_blocks, dims.prefix_groups), old % dims.prefix_blocks
        ].set(-1, mode="drop"), off=dataclasses.replace(
            state.off, popped_key=state.off.popped_key.at[target].set(jnp.where(live, old, -1), mode="drop")))
    state = dataclasses.replace(
        state,
        ring_head=head,
        fresh_next=(state.fresh_next + n_fresh).astype(jnp.int32),
        free_count=state.free_count - count,
        block_free=state.block_free.at[target].set(False, mode="drop"),
        block_ref=state.block_ref.at[target].set(1, mode="drop"),
        block_key=state.block_key.at[target].set(NO_KEY, mode="drop"),
        ring_pos=state.ring_pos.at[target].set(-1, mode="drop"),
        kv_misses=state.kv_misses + count,
    )
    return state, ids


def release_row(state: EngineState, dims: EngineDims, row, active=True) -> EngineState:
    """Drop one reference to every block of `row`; blocks reaching zero go to the free-list
    tail, last block first (so a request's early, shareable blocks are evicted last).
    A no-op unless `active` (handlers are branch-free, see events.py)."""
    j = jnp.arange(dims.blocks_per_request, dtype=jnp.int64)
    row = jnp.maximum(row, 0)
    nblocks = state.row_nblocks[row].astype(jnp.int64)
    owned = active & (j < nblocks)
    blocks = state.row_blocks[row]
    target = jnp.where(owned, blocks, dims.kv_blocks)
    block_ref = state.block_ref.at[target].add(-1, mode="drop")
    freed = owned & (block_ref[jnp.maximum(blocks, 0)] == 0)
    n_freed = jnp.sum(freed).astype(jnp.int64)
    state = _ensure_ring_room(dataclasses.replace(state, block_ref=block_ref), dims, n_freed)
    # rank in reverse block order among freed blocks
    rank = jnp.cumsum(freed[::-1])[::-1] - 1
    pos = state.ring_tail + rank
    return _write_free(state, dims, blocks, freed, pos, n_freed)


def _write_free(state: EngineState, dims: EngineDims, blocks, mask, pos, n, **more) -> EngineState:
    """Put the `mask`ed `blocks` on the free ring at positions `pos` (the caller made room for
    its `n` of them) and mark them free; `more`: other fields to replace as well."""
    return dataclasses.replace(
        state,
        ring=state.ring.at[jnp.where(mask, pos % dims.free_ring, dims.free_ring)].set(blocks, mode="drop"),
        ring_pos=state.ring_pos.at[jnp.where(mask, blocks, dims.kv_blocks)].set(pos, mode="drop"),
        block_free=state.block_free.at[jnp.where(mask, blocks, dims.kv_blocks)].set(True, mode="drop"),
        ring_tail=state.ring_tail + n,
        free_count=state.free_count + n,
        **more,
    )


# ----------------------------------------------------------------------------- allocation

# Block count of the small allocation program (see allocate_rows): a decode step of a full
# 128-slot batch needs at most one new block per request.
SMALL_ALLOCATION = 128
SPLIT_ALLOCATION_FROM = 1024  # alloc_blocks from which steps take the small program when they can


def unique_key(dims: EngineDims, r, j):
    """Key of block j of request r when the block holds tokens at another position than its index
    (a row with an offset): BLIS hashes such blocks to keys nothing else has. A key range after
    the content keys, so never a GPU prefix-cache hit; used only with a CPU tier, which stores them."""
    return (dims.prefix_groups * dims.prefix_blocks + (dims.num_requests + jnp.asarray(r).astype(jnp.int64))
            * dims.blocks_per_request + jnp.asarray(j, jnp.int64))


def register_full_blocks(state: EngineState, dims: EngineDims, req: RequestArrays, r, blocks, block_index, full,
                         unique=None, popped=None):
    """Give content keys to blocks that just became full (vectors of equal length); `unique`
    ones get `unique_key`. `popped`: the blocks just popped, in pop order (an offload chain)."""
    keys = content_key(dims, req, r, block_index)
    shared = full & (block_index < req.shared_blocks[r])
    if unique is not None:   # a CPU tier (else nothing of this is traced)
        keys = jnp.where(unique, unique_key(dims, r, block_index), keys)
        shared = shared & ~unique
    if dims.offload and popped is not None:
        # BLIS pops and keys blocks one by one: a block popped later whose old key is one
        # registered here deletes that map entry again (pop_blocks)
        old = state.off.popped_key[jnp.maximum(blocks, 0)]
        i = jnp.arange(blocks.shape[0])
        later = popped[None, :] & (i[None, :] > i[:, None]) & (old[None, :] == keys[:, None])
        shared = shared & ~jnp.any(later, axis=1)
    target = jnp.where(full, blocks, dims.kv_blocks)
    group = req.prefix_group[r]
    group_block = state.group_block.at[
        jnp.where(shared, group, dims.prefix_groups), jnp.where(shared, block_index, 0)
    ].set(blocks, mode="drop")
    return dataclasses.replace(state, block_key=state.block_key.at[target].set(keys, mode="drop"), group_block=group_block)


def allocate_rows(state: EngineState, dims: EngineDims, req: RequestArrays, rows, new_tokens, active, total_kv_blocks):
    """Allocate KV slots for `new_tokens` more tokens on each active row (vectors over slots).

    The caller has checked that the total of `blocks_needed` fits in `free_count`. Blocks are
    handed out in slot order, as BLIS allocates request by request.
    """
    total = jnp.sum(_rows_kv(state, dims, rows, new_tokens, active)[-1])
    # one row at a time needs at most a chunk's worth of blocks; a whole batch more
    max_blocks = dims.alloc_blocks if len(rows) > 1 else dims.row_alloc_blocks
    state = dataclasses.replace(
        state, result=state.result | jnp.where(total > max_blocks, results.ALLOC_OVERFLOW, 0).astype(jnp.int32)
    )
    small = min(max_blocks, SMALL_ALLOCATION)
    # One row: once per admission, not every step. A second program lengthens every compile,
    # so it is kept for dims where the full one is much larger (large token budgets, covers).
    if max_blocks < SPLIT_ALLOCATION_FROM or len(rows) == 1:
        return _allocate_rows(state, dims, req, rows, new_tokens, active, total_kv_blocks, max_blocks)

    # The per-call work scales with the static block count, and most steps allocate a few
    # blocks: those take the small program, the prompt chunks that need more the full one.
    # Loops of at most one iteration (not cond) so that under vmap each runs only if a lane needs it.
    def sized(size, wanted):
        def body(c, ops, on):
            state, done = c
            req, rows, new_tokens, active, total_kv_blocks, _ = ops
            return _allocate_rows(state, dims, req, rows, new_tokens, active & on, total_kv_blocks, size), done | on

        def cond(c, ops):
            return ~c[1] & wanted(ops[-1])

        return cond, body

    ops = (req, rows, new_tokens, active, total_kv_blocks, total)
    for size, wanted in ((small, lambda t: t <= small), (max_blocks, lambda t: t > small)):
        state, _ = masked_while(*sized(size, wanted), (state, jnp.asarray(False)), ops)
    return state


def _rows_kv(state: EngineState, dims: EngineDims, rows, new_tokens, active):
    """(safe rows, their block counts, token offsets, tokens held by their own blocks, new
    blocks needed)."""
    safe_rows = jnp.maximum(rows, 0)
    nblocks = state.row_nblocks[safe_rows].astype(jnp.int64)
    offset = state.row_offset[safe_rows]
    kv = state.row_kv_tokens[safe_rows] - offset
    return safe_rows, nblocks, offset, kv, jnp.where(active, blocks_needed(dims, nblocks, kv, new_tokens), 0)


def _allocate_rows(state: EngineState, dims: EngineDims, req: RequestArrays, rows, new_tokens, active,
                   total_kv_blocks, max_blocks: int):
    """`allocate_rows` with room for `max_blocks` (static) new blocks in all."""
    bs = dims.block_size
    safe_rows, nblocks, offset, kv, need = _rows_kv(state, dims, rows, new_tokens, active)
    total = jnp.sum(need)
    state, ids = pop_blocks(state, dims, total, total_kv_blocks, max_blocks)
    new_kv = kv + jnp.where(active, new_tokens, 0)
    r = state.row_req[safe_rows]
    last = jnp.maximum(nblocks - 1, 0)
    last_blocks = state.row_blocks[safe_rows, last]  # read before the table is updated

    # Owner of popped block p: the number of slots whose blocks end at or before p (a histogram
    # of the ends, cumulated; cheaper than a binary search per block).
    ends = jnp.cumsum(need)
    p = jnp.arange(max_blocks, dtype=jnp.int64)
    owner = jnp.cumsum(jnp.zeros(max_blocks, jnp.int32).at[ends].add(1, mode="drop"))
    owner = jnp.clip(owner, 0, len(need) - 1)
    k = p - (ends[owner] - need[owner])
    live = p < total
    block_index = nblocks[owner] + k
    # The scatter also rewrites each row's last block with its current value: that makes the
    # update depend on the read above, so XLA orders the read first and updates in place
    # (otherwise it copies the whole table to keep the old version alive).
    keep_last = active & (nblocks > 0)
    row_blocks = state.row_blocks.at[
        jnp.concatenate([jnp.where(live, safe_rows[owner], dims.rows), jnp.where(keep_last, safe_rows, dims.rows)]),
        jnp.concatenate([jnp.where(live, block_index, 0), last]),
    ].set(jnp.concatenate([ids, last_blocks]), mode="drop")
    state = dataclasses.replace(
        state,
        row_blocks=row_blocks,
        row_nblocks=state.row_nblocks.at[jnp.where(active, safe_rows, dims.rows)].add(
            need.astype(jnp.int32), mode="drop"
        ),
        row_kv_tokens=state.row_kv_tokens.at[jnp.where(active, safe_rows, dims.rows)].set(
            new_kv + offset, mode="drop"
        ),
    )
    # Keys for the new blocks that are full, and for each row's previously partial last block.
    # A row with an offset: no content key, or with a CPU tier (which stores them, as BLIS) a unique one.
    unique = (offset != 0) if dims.cpu_blocks else None
    keyed = (offset == 0) if unique is None else (offset == 0) | unique
    full_new = live & keyed[owner] & ((block_index + 1) * bs <= new_kv[owner])
    state = register_full_blocks(state, dims, req, r[owner], ids, block_index, full_new,
                                 None if unique is None else unique[owner], popped=live)
    was_partial = active & keyed & (nblocks > 0) & (nblocks * bs > kv)
    now_full = was_partial & (nblocks * bs <= new_kv)
    # Read from the updated table (same values): a read of the old one after the update makes
    # XLA copy the whole table to keep it alive.
    return register_full_blocks(state, dims, req, r, row_blocks[safe_rows, last], last, now_full, unique)


def cached_prefix(state: EngineState, dims: EngineDims, req: RequestArrays, r):
    """Longest run of the prompt's full blocks present in the cache, and those blocks.

    Shared-prefix blocks are found through the group table; a preempted request's own blocks
    through the block table it kept. A candidate counts only if its content key still matches
    (a reused block has been re-keyed).
    """
    n_hit, cand, _ = cached_blocks(state, dims, req, r)
    return n_hit, cand


def cached_blocks(state: EngineState, dims: EngineDims, req: RequestArrays, r):
    """`cached_prefix` plus, per full prompt block, whether it is in the cache at all (also past
    the first miss)."""
    j = jnp.arange(dims.blocks_per_request, dtype=jnp.int64)
    n_full = req.input_len[r] // dims.block_size
    keys = content_key(dims, req, r, j)
    group = jnp.maximum(req.prefix_group[r], 0)
    from_group = state.group_block[group, jnp.minimum(j, dims.prefix_blocks - 1)]
    old_row = row_of(state, r)
    safe_row = jnp.maximum(old_row, 0)
    from_row = jnp.where((old_row >= 0) & (j < state.row_nblocks[safe_row]), state.row_blocks[safe_row], -1)
    cand = jnp.where(j < req.shared_blocks[r], from_group, from_row)
    hit = (j < n_full) & (cand >= 0) & (state.block_key[jnp.maximum(cand, 0)] == keys)
    n_hit = jnp.sum(jnp.cumprod(hit.astype(jnp.int32)))
    return n_hit.astype(jnp.int64), cand, hit


def free_rank(state: EngineState, dims: EngineDims, total_kv_blocks, blocks):
    """Position in the free list (0 = the head, popped first) of each free block in `blocks`
    (meaningless for blocks in use). Never-used blocks come first, then the ring."""
    pos = state.ring_head + jnp.arange(dims.free_ring, dtype=jnp.int64)
    _, valid = _ring_entry_valid(state, dims, pos)
    before = jnp.cumsum(valid) - valid
    at = jnp.clip(state.ring_pos[jnp.maximum(blocks, 0)] - state.ring_head, 0, dims.free_ring - 1)
    return total_kv_blocks - state.fresh_next.astype(jnp.int64) + before[at]


def push_free(state: EngineState, dims: EngineDims, ids, live) -> EngineState:
    """Append the `live` blocks of `ids` (popped, refcount 1) to the free-list tail in order,
    refcount 0 (they keep their content keys)."""
    n = jnp.sum(live).astype(jnp.int64)
    state = _ensure_ring_room(state, dims, n)
    pos = state.ring_tail + jnp.cumsum(live) - 1
    block_ref = state.block_ref.at[jnp.where(live, ids, dims.kv_blocks)].set(0, mode="drop")
    return _write_free(state, dims, ids, live, pos, n, block_ref=block_ref)


def claim_cached(state: EngineState, dims: EngineDims, row, blocks, n_hit, active) -> EngineState:
    """Take a reference on the first `n_hit` cached blocks and put them at the start of `row`."""
    j = jnp.arange(dims.blocks_per_request, dtype=jnp.int64)
    n_hit = jnp.where(active, n_hit, 0)
    use = j < n_hit
    row_target = jnp.where(active, row, dims.rows)
    row_blocks = state.row_blocks.at[row_target].set(jnp.where(use, blocks, -1).astype(jnp.int32), mode="drop")
    # `blocks` as given, not read back from the table just written: that read feeds the free
    # count, which the next allocation's table scatter does not wait for, so XLA copied the
    # whole table twice per admission.
    target = jnp.where(use, blocks, dims.kv_blocks)
    was_free = use & state.block_free[jnp.maximum(blocks, 0)]
    return dataclasses.replace(
        state,
        block_ref=state.block_ref.at[target].add(1, mode="drop"),
        block_free=state.block_free.at[target].set(False, mode="drop"),
        free_count=state.free_count - jnp.sum(was_free),
        row_blocks=row_blocks,
        row_nblocks=state.row_nblocks.at[row_target].set(n_hit.astype(jnp.int32), mode="drop"),
        kv_hits=state.kv_hits + n_hit,
    )

