"""The compressed ITL log (engine/itl_log.py, itl_log.record_step): scripted decode patterns.

The engine's scenarios never leave a running request without a token for a step (running
requests are scheduled first), so the run log's gap path is driven here directly: a script of
which rows decode in which step, checked against the samples a per-token log would hold.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import dims_floor, latency_model, params_from, random_scenario, small_dims

from blis_jax.engine import itl_log, results
from blis_jax.engine import simulate as sim
from blis_jax.engine.itl_log import ItlLogReader
from blis_jax.engine.output import COMPLETED, TIMED_OUT, SimOutput, itl_from_samples
from blis_jax.engine.state import log_exit

SETTINGS = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "total_kv_blocks": 500}


def _state(dims):
    requests = random_scenario(7, n=4)
    req = sim.request_arrays(requests, dims)
    state = sim.start(dims, params_from(SETTINGS), req, latency_model())
    rows = jnp.arange(3)
    return dataclasses.replace(
        state,
        row_req=state.row_req.at[rows].set(jnp.arange(3, dtype=jnp.int32)),
        row_admit_step=state.row_admit_step.at[rows].set(0),
        row_num_itl=state.row_num_itl.at[rows].set(0),
    )


def _run_script(dims, script, samples, read_every=None):
    """script[k] = rows decoding in step k; returns (final state, reader)."""
    state = _state(dims)
    reader = ItlLogReader()
    s = dims.batch_slots
    rows = jnp.arange(s, dtype=jnp.int32)
    log_step = jax.jit(lambda st, sl, dec, smp: itl_log.record_step(st, sl, dims, rows, rows, dec, smp, jnp.asarray(True)))
    for k, decoding in enumerate(script):
        decoded = jnp.zeros(s, bool).at[jnp.asarray(decoding, jnp.int32)].set(True)
        state, step_sample = log_step(state, state.step_sample, decoded, jnp.int64(samples[k]))
        state = dataclasses.replace(state, step_sample=step_sample, steps=state.steps + 1,
                                    row_num_itl=state.row_num_itl.at[:s].add(decoded.astype(jnp.int64)))
        if read_every and (k + 1) % read_every == 0:
            state = reader.read(state)
    return state, reader


SCRIPT = [[0, 1], [0], [0, 1, 2], [1, 2], [0, 1], [2]]
SAMPLES = [100, 200, 300, 400, 500, 600]
# per-token samples each row would have logged
EXPECTED = {r: [SAMPLES[k] for k, rows in enumerate(SCRIPT) if r in rows] for r in range(3)}


@pytest.mark.parametrize("read_every", [None, 1, 2, 4])
def test_runs_with_gaps_rebuild_every_sample(read_every):
    dims = dataclasses.replace(small_dims(), step_log=8 if read_every is None else 4, run_log=8)
    state, reader = _run_script(dims, SCRIPT, SAMPLES, read_every)
    assert int(state.result) == 0
    for r in range(3):
        state = log_exit(state, dims, r, COMPLETED, jnp.asarray(True), row=jnp.int32(r))
    s = jax.device_get(state)
    completed = np.zeros(4, bool)
    completed[:3] = True
    step_us, runs = reader.finish(s, 4, completed)
    assert step_us.tolist() == SAMPLES
    num_itl = np.array([len(EXPECTED[r]) for r in range(3)] + [0])
    status = np.array([COMPLETED] * 3 + [TIMED_OUT])
    out = SimOutput(status=status, ttft_us=[1, 1, 1, -1], e2e_us=[9, 9, 9, -1], itl_sum_us=np.zeros(4),
                        num_itl=num_itl, sched_delay_us=np.zeros(4), output_tokens=np.zeros(4),
                        handled_by=np.zeros(4), itl_step_us=step_us, itl_runs=runs,
                        **{c: 0 for c in ("preemption_count", "kv_hits", "kv_misses", "dropped_unservable",
                                          "timed_out", "length_capped", "total_input_tokens", "sim_end_us",
                                          "still_queued", "still_running", "kv_allocation_failures", "peak_batch_size")})
    assert out.itl_samples().tolist() == EXPECTED[0] + EXPECTED[1] + EXPECTED[2]
    values, counts = out.itl_pool(np.array([False, True, True, False]))
    pooled = sorted(np.repeat(values, counts).tolist())
    assert pooled == sorted(EXPECTED[1] + EXPECTED[2])
    # each row skipped one step: one closed run per row went through the run log
    assert len(runs) == 3 + 3


def test_runs_before_the_last_admission_are_dropped():
    dims = dataclasses.replace(small_dims(), step_log=8, run_log=8)
    state, reader = _run_script(dims, SCRIPT, SAMPLES)
    # row 1 re-admitted at step 2 (as after a preemption): its run closed before that is dropped
    state = dataclasses.replace(state, row_admit_step=state.row_admit_step.at[1].set(2))
    state = log_exit(state, dims, 1, COMPLETED, jnp.asarray(True), row=jnp.int32(1))
    completed = np.array([False, True, False, False])
    step_us, runs = reader.finish(jax.device_get(state), 4, completed)
    assert runs.tolist() == [[1, 2, 4]]


@pytest.mark.parametrize("step_log, run_log, bit", [(4, 8, results.STEP_LOG_FULL), (8, 1, results.RUN_LOG_FULL)])
def test_full_logs_set_a_growable_result_bit(step_log, run_log, bit):
    dims = dataclasses.replace(small_dims(), step_log=step_log, run_log=run_log)
    state, _ = _run_script(dims, SCRIPT, SAMPLES)
    assert int(state.result) & bit and bit & results.GROWABLE


@pytest.mark.slow  # its own program shape (CI time)
def test_a_small_chunk_and_log_give_the_same_output_as_one_chunk():
    requests = random_scenario(11, n=60, rate_rps=80.0)
    params = params_from({**SETTINGS, "max_num_seqs": 16})
    # one program shape for both runs (the chunk size sets the step-log capacity)
    floor = {("fcfs", "fcfs"): sim.choose_dims(
        input_len=requests.input_len, output_len=requests.output_len, prefix_group=requests.prefix_group,
        prefix_len=requests.prefix_len, max_num_seqs=16, max_num_batched_tokens=256, total_kv_blocks=500,
        block_size=16, step_log=200_000)}
    with dims_floor(floor):
        whole = sim.simulate_instance(requests, params, latency_model())
        chunked = sim.simulate_instance(requests, params, latency_model(), events_per_chunk=37)
    assert whole.result == chunked.result == 0
    np.testing.assert_array_equal(whole.itl_samples(), chunked.itl_samples())
    for name in ("itl_step_us", "itl_runs", "ttft_us", "e2e_us", "num_itl", "itl_sum_us"):
        np.testing.assert_array_equal(getattr(whole, name), getattr(chunked, name), err_msg=name)
    # the pool agrees with the per-request sums
    done = whole.completed_mask()
    by_request = np.zeros(len(requests), np.int64)
    for r, first, last in whole.itl_runs.tolist():
        by_request[r] += int(whole.itl_step_us[first : last + 1].astype(np.int64).sum())
    np.testing.assert_array_equal(by_request[done], whole.itl_sum_us[done])


def test_itl_from_samples_round_trips():
    fields = itl_from_samples([5, 6, 7], [COMPLETED, TIMED_OUT, COMPLETED], [1, 0, 2])
    assert fields["itl_runs"].tolist() == [[0, 0, 0], [2, 1, 1], [2, 2, 2]]
