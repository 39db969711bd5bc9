"""Engine invariants on randomized small scenarios (BLIS INV-1..INV-6, spec §5.1).

Llama-3.1-8B / H100 / trained-physics, 200-250 requests each, numpy RNG with fixed seeds:
overload, KV pressure with preemption (and fully cached prompts), deadlines with chunked
prefill, prefix groups under eviction (with deadlines that outlive the run, so timeout events
remain after the last step), max_model_len / KV-capacity drops with a horizon cut,
priority-fcfs + priority preemption. The jitted engine is advanced with event_limit = events + 1
per call, i.e. by the smallest unit `advance` takes (one step, together with the enqueue and
timeout events due before it), and the whole state is checked after every call; at the end: causality, determinism, the
event-by-event run equals the chunked `simulate_instance` run, and the pure-Python oracle
(tests/reference_engine.py) agrees request by request, exactly.

The scenarios of one scheduler / preemption policy share one compiled program (a dims floor,
see engine_helpers), so the file compiles the engine twice.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import chex
import numpy as np
import pytest
from engine_helpers import (
    BLOCK_SIZE,
    latency_model,
    max_dims,
    natural_dims,
    raise_dims,
    random_scenario,
    request_rows,
    request_status,
    run_oracle,
    simulate,
    small_dims,
    step_events,
)

from blis_jax.engine import output as so
from blis_jax.engine import results as rc
from blis_jax.engine import simulate as sim
from blis_jax.engine import state as st
from blis_jax.engine.params import INF_TIME
from blis_jax.latency import output_token_time_us, post_decode_time_us, queueing_time_us

# name -> (request-set kwargs, engine settings, what the scenario must exercise)
SCENARIOS = {
    "overload": (
        {"seed": 11, "n": 250, "rate_rps": 150.0, "input_range": (32, 700), "output_range": (1, 80)},
        {"max_num_seqs": 8, "max_num_batched_tokens": 512, "total_kv_blocks": 4000},
        ("queueing",),
    ),
    "kv_pressure": (
        {"seed": 12, "n": 100, "rate_rps": 30.0, "input_range": (16, 300), "output_range": (10, 120),
         "block_multiple_frac": 0.4, "burst_frac": 0.2},
        {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "total_kv_blocks": 48},
        ("preemption",),
    ),
    "deadlines": (
        {"seed": 13, "n": 200, "rate_rps": 40.0, "input_range": (16, 600), "output_range": (5, 150),
         "deadline_frac": 0.6, "deadline_range_us": (1, 1_500_000)},
        {"max_num_seqs": 32, "max_num_batched_tokens": 768, "long_prefill_token_threshold": 64,
         "total_kv_blocks": 200},
        ("timeouts", "preemption"),
    ),
    "prefix_groups": (
        {"seed": 14, "n": 250, "rate_rps": 40.0, "input_range": (16, 200), "output_range": (1, 60),
         "num_groups": 3, "prefix_range": (32, 200), "block_multiple_frac": 0.3,
         "deadline_frac": 0.3, "deadline_range_us": (2_000_000, 60_000_000)},
        {"max_num_seqs": 48, "max_num_batched_tokens": 1024, "total_kv_blocks": 120},
        ("prefix_hits", "preemption", "late_deadlines"),
    ),
    "mml_drops_horizon": (
        {"seed": 15, "n": 200, "rate_rps": 20.0, "input_range": (16, 400), "output_range": (0, 60),
         "zero_output_frac": 0.1},
        {"max_num_seqs": 24, "max_num_batched_tokens": 512, "max_model_len": 350, "total_kv_blocks": 24,
         "horizon_us": 7_000_000},
        ("drops", "horizon_cut"),
    ),
    "priority": (
        {"seed": 16, "n": 200, "rate_rps": 40.0, "input_range": (16, 300), "output_range": (5, 100),
         "num_priorities": 5, "deadline_frac": 0.2, "deadline_range_us": (200_000, 3_000_000),
         "block_multiple_frac": 0.2},
        {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "total_kv_blocks": 64,
         "scheduler": "priority-fcfs", "preemption_policy": "priority"},
        ("preemption", "timeouts"),
    ),
}


@cache
def scenario(name: str):
    kwargs, settings, _ = SCENARIOS[name]
    return random_scenario(**kwargs), settings


@cache
def floors() -> dict:
    groups: dict = {}
    for name in SCENARIOS:
        requests, settings = scenario(name)
        d = natural_dims(requests, settings)
        groups.setdefault((d.scheduler, d.preemption_policy), []).append(d)
    return {key: raise_dims(max_dims(dims), small_dims(*key)) for key, dims in groups.items()}


def dims_of(name: str):
    requests, settings = scenario(name)
    d = natural_dims(requests, settings)
    return raise_dims(d, floors()[(d.scheduler, d.preemption_policy)])


@cache
def chunked_output(name: str) -> so.SimOutput:
    requests, settings = scenario(name)
    return simulate(requests, settings, latency_model(), floors())


# ----------------------------------------------------------------------------- per-event checks


class StateChecker:
    """Checks one host copy of the EngineState after every `advance` call."""

    def __init__(self, requests, settings, dims):
        self.requests, self.settings, self.dims = requests, settings, dims
        self.n = len(requests)
        self.total = settings["total_kv_blocks"]
        self.prev_now = -1
        self.events = 0
        self.seen_preempted_row = False

    def __call__(self, s):
        try:
            self.check(s)
        except AssertionError as e:
            raise AssertionError(f"after event {int(s.events)} (t = {int(s.now)} µs): {e}") from None
        self.events += 1

    def check(self, s):
        n, dims, total = self.n, self.dims, self.total
        now = int(s.now)
        assert now < INF_TIME, "the clock reached INF_TIME: an event was processed with nothing left to do"
        assert int(s.result) == 0, f"result code {int(s.result)} ({rc.describe(int(s.result))})"
        assert now >= self.prev_now, f"clock went back {self.prev_now} -> {now}"
        self.prev_now = now
        horizon = self.settings.get("horizon_us")
        assert horizon is None or now <= horizon

        # --- request conservation (INV-1): injected = enqueue events fired
        status = request_status(s, n)
        enq = int(s.enq_pos)
        count = {code: int(np.sum(status == code)) for code in
                 (st.NOT_ARRIVED, st.QUEUED, st.RUNNING, st.COMPLETED, st.TIMED_OUT, st.DROPPED, st.LENGTH_CAPPED)}
        completed = count[st.COMPLETED] + count[st.LENGTH_CAPPED]
        injected = completed + count[st.QUEUED] + count[st.RUNNING] + count[st.DROPPED] + count[st.TIMED_OUT]
        assert injected == enq, f"injected {enq} != completed+queued+running+dropped+timed_out {injected} {count}"
        assert count[st.NOT_ARRIVED] == n - enq
        pending = set(np.asarray(s.enqueue_order)[enq:].tolist()) & set(range(n))
        assert set(np.flatnonzero(status == st.NOT_ARRIVED).tolist()) == pending, "pending set != not-yet-enqueued"
        assert int(s.dropped) == count[st.DROPPED]
        assert int(s.timed_out) == count[st.TIMED_OUT]
        assert int(s.length_capped) == count[st.LENGTH_CAPPED]
        if hasattr(s, "finished"):
            assert int(s.finished) == completed + count[st.TIMED_OUT] + count[st.DROPPED]
        assert int(s.wait_len) == count[st.QUEUED], f"wait_len {int(s.wait_len)} != queued {count[st.QUEUED]}"

        # --- every request in exactly one place
        bl = int(s.batch_len)
        assert 0 <= bl <= self.settings["max_num_seqs"] and bl <= dims.batch_slots
        batch_rows = np.asarray(s.batch_rows[:bl])
        assert np.all(batch_rows >= 0) and len(set(batch_rows.tolist())) == bl, f"batch rows {batch_rows}"
        row_state, row_req = np.asarray(s.row_state), np.asarray(s.row_req)
        assert np.all(row_state[batch_rows] == st.ROW_RUNNING)
        assert int(np.sum(row_state == st.ROW_RUNNING)) == bl, "a running row outside the batch"
        in_batch = row_req[batch_rows]
        running = np.flatnonzero(status == st.RUNNING)
        assert sorted(in_batch.tolist()) == running.tolist(), "batch requests != RUNNING requests"
        rows_of = request_rows(s, n)
        assert np.array_equal(rows_of[in_batch], batch_rows), "a running request's row is not its batch row"
        queued = np.flatnonzero(status == st.QUEUED)
        assert not set(queued.tolist()) & set(in_batch.tolist())
        preempted_rows = np.flatnonzero(row_state == st.ROW_PREEMPTED)
        if len(preempted_rows):
            self.seen_preempted_row = True
            owners = row_req[preempted_rows]
            assert np.all(status[owners] == st.QUEUED), "a preempted row's request is not queued"
            assert np.array_equal(rows_of[owners], preempted_rows), "preempted row not linked to its request"
        held = rows_of[rows_of >= 0]
        assert len(set(held.tolist())) == len(held), "two requests share a block-table row"
        assert np.all(status[rows_of >= 0] <= st.RUNNING), "a finished request still holds a row"
        if hasattr(s, "win_status"):  # in-flight requests must fit the window
            from engine_helpers import _in_flight

            pos, _, _ = _in_flight(s, n)
            assert len(pos) == 0 or pos.max() - pos.min() < s.win_status.shape[0]

        # --- KV block conservation (INV-4)
        ref, free = np.asarray(s.block_ref), np.asarray(s.block_free)
        assert np.all(ref >= 0), "negative refcount"
        assert not free[total:].any() and not ref[total:].any(), "a block beyond total_kv_blocks is in use"
        ref, free = ref[:total], free[:total]
        assert np.array_equal(free, ref == 0), "block_free disagrees with refcount == 0"
        used = int(np.sum(ref > 0))
        assert int(s.free_count) == int(free.sum()), f"free_count {int(s.free_count)} != #free {int(free.sum())}"
        assert int(s.free_count) + used == total, f"free {int(s.free_count)} + used {used} != total {total}"
        tables = []
        nblocks, blocks = np.asarray(s.row_nblocks), np.asarray(s.row_blocks)
        kv_tokens, offset, progress = np.asarray(s.row_kv_tokens), np.asarray(s.row_offset), np.asarray(s.row_progress)
        for row in batch_rows:
            t = blocks[row, : nblocks[row]]
            assert np.all((t >= 0) & (t < total)), f"row {row} table {t}"
            assert len(set(t.tolist())) == len(t), f"row {row} holds a block twice: {t}"
            held_tokens = kv_tokens[row] - offset[row]
            assert 0 <= held_tokens and nblocks[row] == -(-held_tokens // BLOCK_SIZE), (
                f"row {row}: {nblocks[row]} blocks for {held_tokens} tokens")
            r = row_req[row]
            assert 0 <= progress[row] <= kv_tokens[row] <= self.requests.input_len[r] + self.requests.output_len[r]
            tables.append(t)
        refs = np.bincount(np.concatenate(tables), minlength=total) if tables else np.zeros(total, np.int64)
        assert np.array_equal(refs, ref), "refcounts != block-table references of running rows"
        assert int(ref.sum()) == int(nblocks[batch_rows].sum())
        # the free list (never-used blocks, then the released-block ring) holds each free block once
        fresh = list(range(int(s.fresh_next), total))
        ring, ring_pos = np.asarray(s.ring), np.asarray(s.ring_pos)
        live = []
        for p in range(int(s.ring_head), int(s.ring_tail)):
            e = int(ring[p % ring.shape[0]])
            if e >= 0 and np.asarray(s.block_free)[e] and ring_pos[e] == p:
                live.append(e)
        listed = fresh + live
        assert len(listed) == len(set(listed)), "a block is on the free list twice"
        assert sorted(listed) == np.flatnonzero(free).tolist(), "free list != set of free blocks"


def check_final(out: so.SimOutput, requests, settings, model):
    """Causality and guard consistency of a finished run (SimOutput conventions)."""
    n = len(requests)
    arrival, inp, outp = requests.arrival_us, requests.input_len, requests.output_len
    queueing = np.asarray(queueing_time_us(model, np.asarray(inp))).astype(np.int64)
    a2, post = int(output_token_time_us(model)), int(post_decode_time_us(model))
    done = out.status == so.COMPLETED
    assert out.result == so.RESULT_OK
    # INV-5: arrival <= enqueue <= schedule < first token <= completion
    assert np.all(out.ttft_us[done] > 0)
    assert np.all(out.e2e_us[done] >= out.ttft_us[done])
    assert np.all(out.sched_delay_us[done] >= queueing[done]), "scheduled before enqueue"
    assert np.all(out.ttft_us[done] > out.sched_delay_us[done] + a2 - 1), "first token before admission"
    # the last step of a completed request ends by the end of the run (E2E also counts α2 per
    # token and the post-decode overhead on top of the step times)
    last_step_end = arrival[done] + out.e2e_us[done] - np.where(outp[done] > 0, post, 0) - (out.num_itl[done] + 1) * a2
    assert np.all(last_step_end <= out.sim_end_us[0])
    # E2E is TTFT plus the decode gaps plus the post-decode overhead; one gap per extra token
    assert np.array_equal(out.e2e_us[done], out.ttft_us[done] + out.itl_sum_us[done] + np.where(outp[done] > 0, post, 0))
    assert np.array_equal(out.num_itl[done], np.maximum(outp[done] - 1, 0))
    assert np.array_equal(out.output_tokens[done], outp[done])
    assert np.all(out.itl_pool()[0] > a2 - 1)
    # guards (§2.3): dropped exactly when unservable
    mml, total = settings.get("max_model_len", 0), settings["total_kv_blocks"]
    unservable = ((mml > 0) & ((inp >= mml) | ((outp > 0) & (inp + outp > mml)))) | (-(-inp // BLOCK_SIZE) > total)
    arrived = out.status != so.NOT_ARRIVED
    assert np.array_equal(out.status[arrived] == so.DROPPED, unservable[arrived])
    # timeouts only for requests with a deadline; not-arrived only past the horizon
    to = out.status == so.TIMED_OUT
    assert np.all(requests.deadline_us[to] > 0)
    assert np.all(requests.deadline_us[to] <= max(out.sim_end_us[0], int(arrival[to].max(initial=0)) + 1) + 10**9)
    horizon = settings.get("horizon_us")
    not_arrived = out.status == so.NOT_ARRIVED
    if horizon is None:
        assert not not_arrived.any() and out.still_queued[0] == 0 and out.still_running[0] == 0
    else:
        assert np.all(arrival[not_arrived] + queueing[not_arrived] > horizon)
        assert out.sim_end_us[0] <= horizon
    # INV-1 on the output
    assert int(out.completed_mask().sum() + out.still_queued[0] + out.still_running[0] + out.dropped_unservable[0]
               + out.timed_out[0]) == int(arrived.sum())
    assert n == out.num_requests


# ----------------------------------------------------------------------------- tests


# The priority scenario compiles the priority scheduler's program of its own, and the overload
# scenario runs longest: slow (CI time).
@pytest.fixture(params=[pytest.param(n, marks=pytest.mark.slow) if n in ("priority", "overload") else n
                        for n in SCENARIOS])
def name(request):
    return request.param


def test_invariants_hold_throughout_the_run(name):
    requests, settings = scenario(name)
    model = latency_model()
    dims = dims_of(name)
    checker = StateChecker(requests, settings, dims)
    state, _, params = step_events(requests, settings, model, dims, checker, chunk=1)
    assert checker.events > len(requests), f"only {checker.events} events"
    stepped = sim.to_output(state, dims, params, requests, int(state.result))
    check_final(stepped, requests, settings, model)

    # the scenario exercises what it is meant to
    wants = SCENARIOS[name][2]
    if "preemption" in wants:
        assert stepped.preemption_count[0] > 0 and checker.seen_preempted_row
    if "timeouts" in wants:
        assert stepped.timed_out[0] > 0
    if "prefix_hits" in wants:
        assert stepped.kv_hits[0] > 0
    if "drops" in wants:
        assert stepped.dropped_unservable[0] > 0
    if "horizon_cut" in wants:
        assert (stepped.status == so.NOT_ARRIVED).any() and stepped.still_queued[0] + stepped.still_running[0] > 0
    if "late_deadlines" in wants:  # timeout events left after the last step (discarded, no clock tick)
        assert int(np.max(requests.deadline_us)) > stepped.sim_end_us[0] and settings.get("horizon_us") is None
    if "queueing" in wants:
        assert np.max(stepped.sched_delay_us) > 1_000_000

    # smallest steps == the host driver's 200k-event chunks
    chunked = chunked_output(name)
    for field in so.SimOutput.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(stepped, field), getattr(chunked, field),
                                      err_msg=f"{name}: SimOutput.{field} stepped != chunked")


def test_deterministic(name):
    requests, settings = scenario(name)
    a = chunked_output(name)
    b = simulate(requests, settings, latency_model(), floors())
    for field in so.SimOutput.__dataclass_fields__:
        x, y = np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"{name}: SimOutput.{field} differs between runs"


def test_agrees_with_oracle(name):
    assert_agrees_with_oracle(name, chunked_output(name))


@pytest.mark.slow  # its own compiled program; default suite time
def test_split_allocation_agrees_with_oracle(monkeypatch):
    """At large allocation dims a step allocates with a small program when it can and the full
    one otherwise (kv.allocate_rows); both paths, taken in one run, agree with the oracle."""
    from blis_jax.engine import kv

    small = 2  # most steps of this scenario allocate more blocks, some fewer
    monkeypatch.setattr(kv, "SMALL_ALLOCATION", small)
    traced_sizes = set()
    allocate = kv._allocate_rows

    def recording(*args):
        traced_sizes.add(args[-1])
        return allocate(*args)

    monkeypatch.setattr(kv, "_allocate_rows", recording)
    name = "prefix_groups"
    requests, settings = scenario(name)
    # an alloc_blocks no other test compiles, so this run traces (and takes) the split path
    split = {key: dataclasses.replace(floor, alloc_blocks=2 * max(floor.alloc_blocks, kv.SPLIT_ALLOCATION_FROM))
             for key, floor in floors().items()}
    out = simulate(requests, settings, latency_model(), split)
    assert {small, split[("fcfs", "fcfs")].alloc_blocks} <= traced_sizes, traced_sizes
    assert_agrees_with_oracle(name, out)


def assert_agrees_with_oracle(name: str, out: so.SimOutput) -> None:
    requests, settings = scenario(name)
    per, counters = run_oracle(requests, settings, latency_model())
    ids = requests.request_id
    for key in ("status", "ttft_us", "e2e_us", "sched_delay_us", "itl_sum_us", "num_itl", "output_tokens"):
        got = np.asarray(getattr(out, key)).astype(np.int64)
        bad = np.flatnonzero(got != per[key])
        assert not len(bad), (f"{name}: {key} differs for {len(bad)} requests; first: request "
                              f"{int(ids[bad[0]])} engine {got[bad[0]]} oracle {per[key][bad[0]]}")
    done = out.completed_mask()
    oracle_samples = [x for i in np.flatnonzero(done) for x in per["itl"][i]]
    np.testing.assert_array_equal(out.itl_samples(), np.asarray(oracle_samples, np.int64))
    pairs = {"preemption_count": "preemption_count", "kv_hits": "kv_hits", "kv_misses": "kv_misses",
             "dropped_unservable": "dropped_unservable", "timed_out": "timed_out", "length_capped": "length_capped",
             "total_input_tokens": "total_input_tokens", "sim_end_us": "sim_end_us", "still_queued": "still_queued",
             "still_running": "still_running"}
    got = {k: int(getattr(out, k)[0]) for k in pairs}
    want = {k: int(counters[v]) for k, v in pairs.items()}
    assert got == want, f"{name}: counters differ: " + str({k: (got[k], want[k]) for k in got if got[k] != want[k]})
    chex.assert_equal(int(done.sum()), counters["completed"])
