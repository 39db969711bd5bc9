"""vLLM continuous batching: form one step's batch (blis-features §2.5, §2.6).

Phase 1 gives every running request, in batch order, its next prefill chunk or one decode
token under the step's token budget. When the KV blocks for all of them fit (the common case)
this is one vectorized allocation; otherwise an exact request-by-request pass runs with
recompute preemption (victim: batch tail for `fcfs`, least urgent / latest arrival for
`priority`). Phase 2 then admits waiting requests head-of-line, claiming prefix-cache hits,
unless a preemption happened this step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from blis_jax.engine import cpu_tier, kv, lora, offload, waitqueue
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.params import EngineParams
from blis_jax.engine.state import (
    QUEUED,
    ROW_FREE,
    ROW_PREEMPTED,
    ROW_RESERVED,
    ROW_RUNNING,
    RUNNING,
    EngineState,
    RequestArrays,
    row_of,
    set_row,
    set_status,
)
from blis_jax.engine import results


def remove_batch_slots(state: EngineState, dims: EngineDims, drop) -> EngineState:
    """Remove the masked slots from the running batch, keeping the order of the rest."""
    slots = jnp.arange(dims.batch_slots)
    keep = (slots < state.batch_len) & ~drop
    dest = jnp.where(keep, jnp.cumsum(keep) - 1, dims.batch_slots)
    batch_rows = jnp.full_like(state.batch_rows, -1).at[dest].set(state.batch_rows, mode="drop")
    return dataclasses.replace(state, batch_rows=batch_rows, batch_len=jnp.sum(keep).astype(jnp.int32))


def wanted_tokens(state: EngineState, params: EngineParams, req: RequestArrays, rows, valid):
    """Tokens each running request would take this step with an unlimited budget."""
    safe = jnp.maximum(rows, 0)
    r = jnp.maximum(state.row_req[safe], 0)
    progress = state.row_progress[safe]
    input_len, output_len = req.input_len[r], req.output_len[r]
    mml = params.max_model_len
    chunk_cap = params.long_prefill_token_threshold
    prefill = input_len - progress
    prefill = jnp.where((chunk_cap > 0) & (chunk_cap < prefill), chunk_cap, prefill)
    prefill = jnp.where(mml > 0, jnp.minimum(prefill, jnp.maximum(mml - 1 - progress, 0)), prefill)
    decode = jnp.where((output_len > 0) & ~((mml > 0) & (progress + 1 > mml - 1)), 1, 0)
    return jnp.where(valid, jnp.where(progress < input_len, prefill, decode), 0)


def _preempt(state: EngineState, dims: EngineDims, req: RequestArrays, slot, budget, active):
    """Recompute preemption of the request in batch `slot`: back to the queue head with its
    progress, ITL samples and KV blocks dropped (its block table is kept for re-hits)."""
    row = jnp.maximum(state.batch_rows[slot], 0)
    r = state.row_req[row]
    budget = budget + jnp.where(active, state.row_new[row], 0)
    state = kv.release_row(state, dims, row, active)
    at_row = jnp.where(active, row, dims.rows)
    state = dataclasses.replace(
        state,
        row_state=state.row_state.at[at_row].set(ROW_PREEMPTED, mode="drop"),
        row_progress=state.row_progress.at[at_row].set(0, mode="drop"),
        row_kv_tokens=state.row_kv_tokens.at[at_row].set(0, mode="drop"),
        row_new=state.row_new.at[at_row].set(0, mode="drop"),
        row_ttft=state.row_ttft.at[at_row].set(-1, mode="drop"),
        row_num_itl=state.row_num_itl.at[at_row].set(0, mode="drop"),
        row_itl_sum=state.row_itl_sum.at[at_row].set(0, mode="drop"),
        row_run_first=state.row_run_first.at[at_row].set(-1, mode="drop"),
        preemptions=state.preemptions + active,
    )
    state = set_status(state, r, QUEUED, active)
    state = remove_batch_slots(state, dims, active & (jnp.arange(dims.batch_slots) == slot))
    return waitqueue.push_front(state, dims, req, r, active), budget


def _victim_slot(state: EngineState, dims: EngineDims, req: RequestArrays):
    if dims.preemption_policy == "fcfs":
        return state.batch_len - 1
    slots = jnp.arange(dims.batch_slots)
    r = jnp.maximum(state.row_req[jnp.maximum(state.batch_rows, 0)], 0)
    # least urgent (largest vLLM priority), then latest arrival; ties go to the later slot
    key = req.priority[r] * (1 << 44) + state.arrival[r]
    key = jnp.where(slots < state.batch_len, key, -1)
    return dims.batch_slots - 1 - jnp.argmax(key[::-1])


def _schedule_running_exact(state, dims, params, req, budget, needed):
    """Phase 1 request by request, preempting on allocation failure (only where `needed`).
    Each iteration either allocates for request i or preempts one victim and retries."""

    def cond(c, ops):
        state, i, budget, _, stop = c
        return ops[2] & ~stop & (i < state.batch_len) & (budget > 0)

    def body(c, ops, on):
        params, req, _ = ops
        state, i, budget, preempted, stop = c
        row = state.batch_rows[i]
        want = wanted_tokens(state, params, req, row[None], jnp.asarray([True]))[0]
        n = jnp.minimum(want, budget)
        need = kv.blocks_needed(dims, state.row_nblocks[row], state.row_kv_tokens[row], n, state.row_offset[row])
        fits = need <= state.free_count
        state = kv.allocate_rows(state, dims, req, row[None], n[None], (on & fits & (n > 0))[None],
                                 params.total_kv_blocks)
        state = dataclasses.replace(
            state, row_new=state.row_new.at[jnp.where(on & fits, row, dims.rows)].set(n, mode="drop")
        )
        victim = _victim_slot(state, dims, req)
        state, new_budget = _preempt(state, dims, req, victim, jnp.where(fits, budget - n, budget), on & ~fits)
        # the requester itself was the victim: its allocation fails and phase 1 ends
        next_i = jnp.where(fits, i + 1, jnp.where(victim < i, i - 1, i))
        return (state, jnp.where(on, next_i, i), jnp.where(on, new_budget, budget), preempted | (on & ~fits),
                stop | (on & ~fits & (victim == i)))

    state, _, budget, preempted, _ = masked_while(
        cond, body, (state, jnp.int32(0), budget, jnp.asarray(False), jnp.asarray(False)), (params, req, needed)
    )
    return state, budget, preempted


def schedule_running(state: EngineState, dims: EngineDims, params: EngineParams, req: RequestArrays, active):
    """Phase 1. Returns (state, budget left, whether a preemption happened)."""
    slots = jnp.arange(dims.batch_slots)
    valid = active & (slots < state.batch_len)
    rows = state.batch_rows
    budget = params.max_num_batched_tokens
    want = wanted_tokens(state, params, req, rows, valid)
    # Under a shared budget each request gets min(want, what earlier ones left): a clamp of the
    # exclusive prefix sum.
    n = jnp.clip(budget - (jnp.cumsum(want) - want), 0, want)
    safe = jnp.maximum(rows, 0)
    need = kv.blocks_needed(dims, state.row_nblocks[safe], state.row_kv_tokens[safe], n, state.row_offset[safe])
    need = jnp.where(valid, need, 0)
    fits = jnp.sum(need) <= state.free_count
    state = kv.allocate_rows(state, dims, req, rows, n, valid & (n > 0) & fits, params.total_kv_blocks)
    row_new = state.row_new.at[jnp.where(valid & fits, rows, dims.rows)].set(n, mode="drop")
    state = dataclasses.replace(state, row_new=row_new)
    budget_left = jnp.where(fits, budget - jnp.sum(n), budget)
    # Exact pass only when the blocks do not fit (a loop with no iterations otherwise).
    return _schedule_running_exact(state, dims, params, req, budget_left, active & ~fits)


def first_chunk(params: EngineParams, req: RequestArrays, r, start, budget, prefilled=False):
    """Tokens that admitting waiting request r computes in this step, from prompt token `start`
    on (its cached prefix before it; a reserved PD decode sub-request decodes one token)."""
    n = req.input_len[r] - start
    cap = params.long_prefill_token_threshold
    n = jnp.where((cap > 0) & (cap < n), cap, n)
    n = jnp.where(prefilled, 1, n)
    n = jnp.minimum(n, budget)
    mml = params.max_model_len
    return jnp.where(mml > 0, jnp.minimum(n, jnp.maximum(mml - 1 - start, 0)), n)


def head_stays_blocked(state: EngineState, dims: EngineDims, params: EngineParams, req: RequestArrays, budget):
    """Phase 2 cannot admit the wait-queue head now, nor after any number of plain decode steps
    (coast.py): its first chunk alone needs more blocks than are free. Those steps only take
    blocks, and evicting its cached prefix only lengthens the chunk, so the head stays blocked
    for the whole run. Never with a PD decode sub-request (it starts on reserved blocks), a CPU
    tier (a failed admission reloads and counts a miss) or LoRA (the gate acts on the head)."""
    if dims.transfers or dims.cpu_blocks or dims.lora_slots:
        return jnp.asarray(False)
    _, r, _ = waitqueue.head(state, dims)
    n_hit, _, _ = kv.cached_blocks(state, dims, req, r)
    n = first_chunk(params, req, r, n_hit * dims.block_size, budget)
    # Not admit_waiting's whole need (+ cached blocks on the free list): with the chunk capped,
    # an eviction leaves the chunk as it is and lowers that term, so the need could fall.
    return (budget <= 0) | ((n + dims.block_size - 1) // dims.block_size > state.free_count)


def admit_waiting(state: EngineState, dims: EngineDims, params: EngineParams, req: RequestArrays, budget, preempted,
                  active):
    """Phase 2: admit queue heads while batch room, budget and KV blocks allow."""
    bs = dims.block_size

    def wants_more(c, ops):
        params, _, active, preempted = ops
        state, budget, stop, cursor = c
        if dims.offload:  # the scan goes past deferred requests (offload.py): while any is left
            return (active & ~stop & ~preempted & (state.batch_len < params.max_num_seqs)
                    & offload.cursor_valid(state, cursor) & (budget > 0))
        return (active & ~stop & ~preempted & (state.batch_len < params.max_num_seqs) & (state.wait_len > 0)
                & (budget > 0))

    def cond(c, ops):
        return wants_more(c, ops) & (c[0].batch_len < dims.batch_slots)

    def body(c, ops, on):
        params, req, _, _ = ops
        state, budget, stop, cursor = c
        if dims.offload:
            r, from_front = offload.candidate(state, cursor)
        else:
            state, r, _ = waitqueue.head(state, dims)
        old_row = row_of(state, r)
        # A PD decode sub-request starts decoding on the prompt KV reserved for it (transfer.py).
        prefilled = ((old_row >= 0) & (state.row_state[jnp.maximum(old_row, 0)] == ROW_RESERVED)
                     if dims.transfers else jnp.asarray(False))
        n_hit, cached, on_gpu = kv.cached_blocks(state, dims, req, r)
        n_hit = jnp.where(prefilled, 0, n_hit)
        scanned = on
        if dims.offload:
            # deferred for a promotion read in flight, or one just submitted: passed over
            state, skipped, promoted, warm, cpu_run = offload.before_admission(state, dims, params, req, r, n_hit,
                                                                               on_gpu, on)
            on = on & ~skipped
        start = jnp.where(prefilled, req.input_len[r], n_hit * bs)
        n = first_chunk(params, req, r, start, budget, prefilled)
        # BLIS quirk: a zero-token admission claims none of its cached blocks (kv.py)
        n_claim = jnp.where(n > 0, n_hit, 0)
        lora_ok = lora.resident_ready(state, req.adapter[r]) if dims.lora_slots else jnp.asarray(True)
        # Where the row's KV starts: tokens held, position of its first block, tokens allocated.
        kv_start, row_offset, n_alloc, ahead = start, start - n_claim * bs, n, jnp.int64(0)
        n_reload = jnp.int64(0)
        if dims.cpu_blocks:
            # BLIS (tiered.go) reloads from CPU inside the allocation of a new request: the chunk
            # `n` is already fixed, and the request claims the GPU-cached prefix as it is after
            # the reload (cpu_tier.reload), at most the blocks the chunk reaches; the chunk's
            # tokens past that prefix get new blocks.
            state, blocks, n_cached, n_reload, lost = cpu_tier.reload(
                state, dims, params, req, r, n_hit, cached, on_gpu,
                on & ~prefilled & (n > 0) & lora_ok & (~warm if dims.offload else True),
                fresh=promoted if dims.offload else False)
            reloaded = n_reload > 0
            if dims.offload:
                state = offload.after_reload(state, dims, req, r, n_hit, n_reload)
            end = start + n
            # The prefix reaches past the chunk: the row claims the blocks up to the chunk's end
            # and its later chunks follow them, at token positions that do not match their
            # blocks (BLIS hashes them as garbage; here offset 1: kv.unique_key), unless the chunk
            # ends on a block boundary: then the positions match and the blocks get their real keys.
            over = reloaded & (end <= n_cached * bs)
            m = jnp.where(over, (end + bs - 1) // bs, n_cached)
            kv_from = jnp.maximum(start, n_cached * bs)
            cached = jnp.where(reloaded, blocks, cached)
            n_claim = jnp.where(reloaded, m, n_claim)
            aligned = over & (end % bs == 0)
            kv_start = jnp.where(aligned, end, jnp.where(over, m * bs + 1, jnp.where(reloaded, kv_from, start)))
            row_offset = jnp.where(aligned, 0, jnp.where(over, 1, jnp.where(reloaded, kv_from - m * bs, row_offset)))
            n_alloc = jnp.where(over, 0, jnp.where(reloaded, end - kv_from, n))
            ahead = jnp.where(over, kv_start - end, 0)
        j = jnp.arange(dims.blocks_per_request)
        cached_on_free_list = jnp.sum((j < n_claim) & state.block_free[jnp.maximum(cached, 0)])
        safe_old = jnp.maximum(old_row, 0)
        need = jnp.where(prefilled, kv.blocks_needed(dims, state.row_nblocks[safe_old], state.row_kv_tokens[safe_old], n),
                         (n_alloc + bs - 1) // bs + cached_on_free_list)
        admit = on & (need <= state.free_count) & lora_ok
        if dims.cpu_blocks:
            # Not yet as BLIS: an admission that fails after a reload leaves nothing claimed here,
            # where BLIS keeps the claimed prefix committed to the waiting request (no rollback;
            # the G02 case): those are counted, for a warning. CPU misses: failed allocations
            # without a reload (a head the LoRA gate stops makes no allocation).
            state = dataclasses.replace(
                state, cpu_misses=state.cpu_misses + (on & lora_ok & ~prefilled & (n > 0) & (n_reload == 0) & ~admit),
                cpu_reload_failures=state.cpu_reload_failures + ((n_reload > 0) & ~admit))

        free_row = jnp.argmax(state.row_state == ROW_FREE)
        no_row = admit & (old_row < 0) & (state.row_state[free_row] != ROW_FREE)
        row = jnp.where(old_row >= 0, old_row, free_row).astype(jnp.int32)
        at_row = jnp.where(admit, row, dims.rows)
        state = kv.claim_cached(state, dims, row, cached, n_claim, admit & ~prefilled)
        if dims.cpu_blocks:
            state = dataclasses.replace(state, row_ahead=state.row_ahead.at[at_row].set(ahead, mode="drop"),
                                        kv_hits=state.kv_hits + jnp.where(admit, lost, 0))
        if dims.offload:
            # after a warm load (no reload: fresh blocks) the blocks the staging tier continued
            # count as hits, up to the chunk's end
            warm_hits = jnp.where(admit & warm & ~prefilled & (n > 0),
                                  jnp.minimum(cpu_run, (start + n + bs - 1) // bs - n_hit), 0)
        state = dataclasses.replace(
            state,
            row_req=state.row_req.at[at_row].set(r, mode="drop"),
            row_state=state.row_state.at[at_row].set(ROW_RUNNING, mode="drop"),
            row_progress=state.row_progress.at[at_row].set(jnp.where(prefilled, start, 0), mode="drop"),
            row_kv_tokens=state.row_kv_tokens.at[at_row].set(kv_start, mode="drop"),
            row_offset=state.row_offset.at[at_row].set(jnp.where(prefilled, 0, row_offset), mode="drop"),
            row_ttft=state.row_ttft.at[at_row].set(jnp.where(prefilled, 0, -1), mode="drop"),
            row_num_itl=state.row_num_itl.at[at_row].set(0, mode="drop"),
            row_itl_sum=state.row_itl_sum.at[at_row].set(0, mode="drop"),
            row_sched_delay=state.row_sched_delay.at[at_row].set(state.now - state.arrival[r], mode="drop"),
            row_admit_step=state.row_admit_step.at[at_row].set(state.steps, mode="drop"),
            row_run_first=state.row_run_first.at[at_row].set(-1, mode="drop"),
            result=state.result | jnp.where(no_row, results.ROWS_FULL, 0).astype(jnp.int32),
        )
        state = kv.allocate_rows(state, dims, req, row[None], n_alloc[None], admit[None], params.total_kv_blocks)
        if dims.offload:
            state = dataclasses.replace(state, kv_hits=state.kv_hits + warm_hits, kv_misses=state.kv_misses - warm_hits)
            state = offload.take(state, dims, r, from_front, cursor, admit)
        else:
            state = waitqueue.pop_head(state, dims, admit)
        state = dataclasses.replace(
            state,
            row_new=state.row_new.at[at_row].set(n, mode="drop"),
            batch_rows=state.batch_rows.at[jnp.where(admit, state.batch_len, dims.batch_slots)].set(row, mode="drop"),
            batch_len=state.batch_len + admit,
        )
        state = set_row(set_status(state, r, RUNNING, admit), r, row, admit)
        if dims.lora_slots:  # the request pins its adapter until it leaves (a preempted one keeps it)
            state = lora.touch(lora.pin(state, req.adapter[r], 1, admit & (old_row < 0)), req.adapter[r], admit)
        if dims.offload:
            # a request admitted after its promotion whose allocation fails is passed over too
            passed = scanned & ~admit & (skipped | promoted)
            cursor = offload.advance(state, cursor, from_front, passed, admit)
            return state, jnp.where(admit, budget - n, budget), stop | (on & ~admit & ~promoted), cursor
        return state, jnp.where(admit, budget - n, budget), stop | (on & ~admit), cursor

    ops = (params, req, active, preempted)
    cursor = ()
    if dims.offload:
        state = offload.at_formation(state, dims, params.off, active)   # loads timed at formations
        state = waitqueue.head(state, dims)[0]   # the FIFO head past finished entries
        cursor = offload.cursor_start(state)
    state, budget, stop, cursor = masked_while(cond, body, (state, budget, jnp.asarray(False), cursor), ops)
    # Slots fewer than max-num-seqs (a sweep starts small): the scheduler would admit more, so
    # the run is redone with more slots instead of continuing with a different schedule.
    full = wants_more((state, budget, stop, cursor), ops)
    return dataclasses.replace(state, result=state.result | jnp.where(full, results.BATCH_FULL, 0).astype(jnp.int32),
                               peak_batch_len=jnp.maximum(state.peak_batch_len, state.batch_len))
