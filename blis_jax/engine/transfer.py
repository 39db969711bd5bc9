"""The decode side of prefill/decode disaggregation (blis-features §3.10), on one instance.

When a prefill instance finishes a disaggregated request's prompt, the cluster reserves KV
blocks for the whole prompt on the chosen decode instance (`reserve`: a block-table row in
state ROW_RESERVED holding ⌈input / block size⌉ fresh blocks; failure means the request is
dropped at the decode instance). When the transfer completes, the request is enqueued there
like any routed request (the inbox), but:

* its enqueue bypasses the guards (no unservable drop, no past-due check) and does not count
  its prompt in `total_input_tokens` (the prefill instance did) — events.enqueue;
* its admission starts at ProgressIndex = input with the reserved blocks: it takes one decode
  token per step from its first step on, and has no first-token time of its own (its row's
  TTFT is 0, so its E2E is its ITL sum + the post-decode overhead) — batch.admit_waiting.

The parent request's metrics are rebuilt from these by the cluster (cluster/pd_metrics.py).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from blis_jax.engine import kv, results
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.loops import masked_while
from blis_jax.engine.state import ROW_FREE, ROW_RESERVED, EngineState, RequestArrays


def reserve(state: EngineState, dims: EngineDims, req: RequestArrays, r, active, total_kv_blocks):
    """Reserve the blocks of request r's whole prompt; returns (state, reserved?)."""
    bs = dims.block_size
    input_len = req.input_len[r]
    blocks = (input_len + bs - 1) // bs
    free_row = jnp.argmax(state.row_state == ROW_FREE).astype(jnp.int32)
    has_row = state.row_state[free_row] == ROW_FREE
    ok = active & has_row & (blocks <= state.free_count)
    at_row = jnp.where(ok, free_row, dims.rows)
    state = dataclasses.replace(
        state,
        row_req=state.row_req.at[at_row].set(r, mode="drop"),
        row_state=state.row_state.at[at_row].set(ROW_RESERVED, mode="drop"),
        row_progress=state.row_progress.at[at_row].set(0, mode="drop"),
        row_kv_tokens=state.row_kv_tokens.at[at_row].set(0, mode="drop"),
        row_offset=state.row_offset.at[at_row].set(0, mode="drop"),
        row_nblocks=state.row_nblocks.at[at_row].set(0, mode="drop"),
        row_blocks=state.row_blocks.at[at_row].set(-1, mode="drop"),
        result=state.result | jnp.where(active & ~has_row, results.ROWS_FULL, 0).astype(jnp.int32),
    )
    # A prompt may need more blocks than one allocation pops: allocate it in chunks.
    chunk = (dims.row_alloc_blocks * bs)

    def more(c, ops):
        state, done = c
        n, go = ops[:2]
        return go & (done < n)

    def body(c, ops, on):
        state, done = c
        n, _, row, req, total_kv_blocks = ops
        take = jnp.minimum(n - done, chunk)
        state = kv.allocate_rows(state, dims, req, row[None], take[None], on[None], total_kv_blocks)
        return state, done + jnp.where(on, take, 0)

    state, _ = masked_while(more, body, (state, jnp.int64(0)), (input_len, ok, free_row, req, total_kv_blocks))
    return state, ok


def held_row(state: EngineState, r):
    """(row, is there one) of a reservation held for request r."""
    held = (state.row_req == r) & (state.row_state == ROW_RESERVED)
    return jnp.argmax(held).astype(jnp.int32), jnp.any(held)
