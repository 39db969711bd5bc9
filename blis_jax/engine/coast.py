"""Decode runs: the steps after a step that can only repeat it, executed as one event.

After a step, the next ones are plain decode steps (the same requests, one token each) as long
as nothing can join the batch (the wait queue is empty, the batch is at max_num_seqs, or the
queue's head needs more free KV blocks for its first chunk than there are: decode steps only
take blocks, so it stays blocked), every running request is past its prompt, the batch fits
the token budget, no request finishes or reaches max_model_len, the KV blocks they take are
free (so nothing is preempted), and no other event that matters comes first: a timeout, the
horizon, the cluster's next event, or an enqueue while the batch has room. (An enqueue into a
full batch's wait queue commutes with the steps: it touches only the queue, so it is processed
after the run, at its own time.)

Such a run has a closed form: contexts grow by one per step, so the step times follow from the
batch alone; each request takes a new block every `block_size` tokens, so allocations come in a
fixed order (by step, then batch slot); and every step logs one ITL sample for the whole batch.

Running up to `dims.coast_steps` such steps as one event changes nothing in the output (the
per-step state is reproduced exactly) and cuts the loop's iterations where instances are
lightly loaded: a lone request decoding 256 tokens takes a handful of iterations instead of 256.
Under vmap every lane pays for the lane with the most iterations, so this is what makes wide
sweeps and many-instance clusters cheap.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from blis_jax import latency
from blis_jax.engine import batch, itl_log, kv
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.params import EngineParams
from blis_jax.engine.state import EngineState, RequestArrays

_NEVER = jnp.iinfo(jnp.int64).max


class _Batch(NamedTuple):
    """The running batch after a step, per batch slot."""

    valid: jnp.ndarray
    rows: jnp.ndarray
    req: jnp.ndarray  # request of each slot
    progress: jnp.ndarray
    input_len: jnp.ndarray
    nblocks: jnp.ndarray
    own_kv: jnp.ndarray  # tokens held by the row's own blocks
    spare: jnp.ndarray  # free token slots in the row's last block
    most_steps: jnp.ndarray  # run steps before a request finishes or reaches max_model_len
    t_limit: jnp.ndarray  # steps must start before this
    plain: jnp.ndarray  # the next step is a plain decode step (before the time limit)


def _batch(state: EngineState, dims: EngineDims, params: EngineParams, req: RequestArrays, next_step, t_enqueue,
           t_limit, head_blocked):
    valid = jnp.arange(dims.batch_slots) < state.batch_len
    rows = jnp.maximum(state.batch_rows, 0)
    r = jnp.maximum(state.row_req[rows], 0)
    progress = state.row_progress[rows]
    input_len, output_len = req.input_len[r], req.output_len[r]
    nblocks = state.row_nblocks[rows].astype(jnp.int64)
    own_kv = state.row_kv_tokens[rows] - state.row_offset[rows]
    spare = nblocks * dims.block_size - own_kv
    # Step j (1-based) of the run leaves a request at progress + j; the step in which it
    # finishes (or reaches max_model_len) runs as a normal step.
    leaves_after = input_len + jnp.maximum(output_len, 1) - 1 - progress
    mml = params.max_model_len
    leaves_after = jnp.where(mml > 0, jnp.minimum(leaves_after, mml - 1 - progress), leaves_after)
    most_steps = jnp.min(jnp.where(valid, leaves_after - 1, _NEVER))
    full = state.batch_len >= params.max_num_seqs
    t_limit = jnp.minimum(t_limit, t_enqueue) if dims.sample_wait else jnp.where(full, t_limit,
                                                                                  jnp.minimum(t_limit, t_enqueue))
    # A waiting request that cannot join (no room in the batch, or too few free blocks for its
    # first chunk: `head_blocked`) leaves the steps plain; an enqueue ends the run unless the
    # batch is full.
    plain = (((state.wait_len == 0) | full | head_blocked) & (state.batch_len > 0)
             & (state.batch_len <= params.max_num_batched_tokens) & (most_steps >= 1) & (next_step < t_limit)
             & jnp.all(~valid | ((progress >= input_len) & (spare >= 0) & (spare < dims.block_size))))
    return _Batch(valid, rows, r, progress, input_len, nblocks, own_kv, spare, most_steps, t_limit, plain)


def decode_run(state: EngineState, step_sample, dims: EngineDims, params: EngineParams, req: RequestArrays, model,
               next_step, t_enqueue, t_limit, active):
    """Run the plain decode steps that start at `next_step` (scheduled by the step just run)
    and before `t_limit` (and `t_enqueue`, the next enqueue, unless the batch is full), at most
    `dims.coast_steps`. Returns (state, step_sample, next_step):
    the clock at the last step run, and the start of the step after it."""

    # A loop of at most one iteration, so that the run's work is skipped when no lane coasts.
    # Evaluated once (the loop's cond and body see the same state): it is the costly part.
    head_blocked = batch.head_stays_blocked(state, dims, params, req, params.max_num_batched_tokens - state.batch_len)

    def cond(c, ops):
        params, req, _, next_step, t_enqueue, t_limit, active, head_blocked = ops
        return active & ~c[-1] & _batch(c[0], dims, params, req, next_step, t_enqueue, t_limit, head_blocked).plain

    def body(c, ops, on):
        params, req, model, next_step, t_enqueue, t_limit, _, head_blocked = ops
        return (*_run(c[0], dims, params, req, model, next_step, t_enqueue, t_limit, head_blocked, on),
                jnp.asarray(True))

    carry = (state, jnp.int64(0), jnp.zeros(dims.coast_steps, jnp.int64), next_step, jnp.asarray(False))
    state, k, sample, following, _ = masked_while(
        cond, body, carry, (params, req, model, next_step, t_enqueue, t_limit, active, head_blocked))
    # The ITL samples of the run's steps: the step log stays out of loops (carrying it copies it).
    j = jnp.arange(1, dims.coast_steps + 1)
    at_step = jnp.where(j <= k, (state.steps - k + j - 1) % dims.step_log, dims.step_log)
    return state, step_sample.at[at_step].set(sample.astype(jnp.int32), mode="drop"), following


def _run(state: EngineState, dims: EngineDims, params: EngineParams, req: RequestArrays, model, next_step, t_enqueue,
         t_limit, head_blocked, active):
    """(state after the run, its length k, the steps' ITL samples [K], the next step's start)."""
    b = _batch(state, dims, params, req, next_step, t_enqueue, t_limit, head_blocked)
    bs = dims.block_size
    # KV blocks taken by the first j steps: a request with `spare` free slots takes its blocks
    # in steps spare, spare + bs, ... (0-based), so only the per-residue counts matter.
    residue = jnp.arange(bs)
    per_class = jnp.sum(b.valid[:, None] & (b.spare[:, None] == residue[None, :]), axis=0)
    j = jnp.arange(1, dims.coast_steps + 1, dtype=jnp.int64)
    blocks_by = jnp.sum(jnp.maximum((j[:, None] - residue[None, :] + bs - 1) // bs, 0) * per_class[None, :], axis=1)
    # step j of the run: every context has grown by j - 1
    feats = latency.BatchFeatures(scheduled=b.valid, is_prefill=jnp.zeros_like(b.valid),
                                  new_tokens=b.valid.astype(jnp.int64), progress=b.progress, input_len=b.input_len)
    dur = latency.decode_run_step_times_us(model, feats, j - 1)
    start = next_step + jnp.cumsum(dur) - dur
    log_room = state.step_log_base + dims.step_log - state.steps  # step j has index steps + j - 1
    ok = ((j <= b.most_steps) & (start < b.t_limit) & (blocks_by <= state.free_count)
          & (blocks_by <= dims.alloc_blocks) & (j <= log_room))
    k = jnp.where(active & b.plain, jnp.sum(jnp.cumprod(ok.astype(jnp.int64))), 0)
    on = k > 0
    last = jnp.maximum(k - 1, 0)
    sample = jnp.where(j <= k, dur + latency.output_token_time_us(model), 0)
    ran = b.valid & on

    # step 1 may begin a decode run (a request whose prompt finished in the step before)
    state = itl_log.record_runs(state, dims, b.rows, b.req, ran, on)
    state = _allocate(state, dims, params, req, b, ran, k, jnp.where(on, blocks_by[last], 0))
    at_row = jnp.where(ran, b.rows, dims.rows)
    clock = jnp.where(on, start[last], state.now)
    state = dataclasses.replace(
        state,
        row_progress=state.row_progress.at[at_row].add(k, mode="drop"),
        row_num_itl=state.row_num_itl.at[at_row].add(k, mode="drop"),
        row_itl_sum=state.row_itl_sum.at[at_row].add(jnp.sum(sample), mode="drop"),
        row_run_last=state.row_run_last.at[at_row].set(state.steps + k - 1, mode="drop"),
        row_new=state.row_new.at[at_row].set(1, mode="drop"),
        steps=state.steps + k,
        coasted_steps=state.coasted_steps + k,
        # the queue is constant within a run when dims.sample_wait (the only case where this is read)
        wait_depth_sum=state.wait_depth_sum + k * state.wait_len,
        events=state.events + k,
        now=clock,
        sim_end=jnp.maximum(state.sim_end, clock),
    )
    return state, k, sample, jnp.where(on, start[last] + dur[last], next_step)


def _allocate(state: EngineState, dims: EngineDims, params: EngineParams, req: RequestArrays, b: _Batch, ran, k,
              total):
    """The run's KV blocks: `k` more tokens per running request. The free list hands them out
    in (step, batch slot) order, as `k` one-token allocations would."""
    bs = dims.block_size
    rows, r, nblocks, spare = b.rows, b.req, b.nblocks, b.spare
    state, ids = kv.pop_blocks(state, dims, total, params.total_kv_blocks, dims.alloc_blocks)
    # Allocation m of a request with `spare` free slots happens in step spare + m·bs; before it
    # come m blocks of every request, one more of each with a smaller spare, and those of the
    # same spare in earlier slots.
    residue = jnp.arange(bs)
    in_class = ran[:, None] & (spare[:, None] == residue[None, :])
    same_before = jnp.sum((jnp.cumsum(in_class, axis=0) - in_class) * in_class, axis=1)
    per_class = jnp.sum(in_class, axis=0)
    smaller = (jnp.cumsum(per_class) - per_class)[jnp.clip(spare, 0, bs - 1)]
    m = jnp.arange(-(-dims.coast_steps // bs), dtype=jnp.int64)
    count = jnp.where(ran, jnp.maximum((k - spare + bs - 1) // bs, 0), 0)
    live = m[None, :] < count[:, None]  # [S, M]
    pos = m[None, :] * state.batch_len + (smaller + same_before)[:, None]
    new_ids = ids[jnp.clip(pos, 0, dims.alloc_blocks - 1)]
    block_index = nblocks[:, None] + m[None, :]
    last_index = jnp.maximum(nblocks - 1, 0)
    last_blocks = state.row_blocks[rows, last_index]  # read before the table is updated
    # Rewriting each row's last block with its value orders that read first (see kv.allocate_rows).
    keep_last = ran & (nblocks > 0)
    row_blocks = state.row_blocks.at[
        jnp.concatenate([jnp.where(live, rows[:, None], dims.rows).reshape(-1), jnp.where(keep_last, rows, dims.rows)]),
        jnp.concatenate([jnp.where(live, block_index, 0).reshape(-1), last_index]),
    ].set(jnp.concatenate([new_ids.reshape(-1), last_blocks]), mode="drop")
    at_row = jnp.where(ran, rows, dims.rows)
    state = dataclasses.replace(
        state,
        row_blocks=row_blocks,
        row_nblocks=state.row_nblocks.at[at_row].add(count.astype(jnp.int32), mode="drop"),
        row_kv_tokens=state.row_kv_tokens.at[at_row].add(k, mode="drop"),
    )
    # Content keys of the blocks that are full at the end (nothing reads them during the run).
    keyed = ran & (state.row_offset[rows] == 0)
    new_kv = b.own_kv + k
    full_new = live & keyed[:, None] & ((block_index + 1) * bs <= new_kv[:, None])
    r_new = jnp.broadcast_to(r[:, None], full_new.shape)
    state = kv.register_full_blocks(state, dims, req, r_new.reshape(-1), new_ids.reshape(-1),
                                    block_index.reshape(-1), full_new.reshape(-1))
    filled = keyed & (nblocks > 0) & (spare > 0) & (k >= spare)
    # read back from the updated table (see kv.allocate_rows)
    return kv.register_full_blocks(state, dims, req, r, row_blocks[rows, last_index], last_index, filled)
