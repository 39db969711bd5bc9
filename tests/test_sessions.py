"""Closed-loop sessions (blis-features §4.9): the loop generates each next round.

The strongest check is BLIS's own generating run of the C06 case: its trace records the
arrival, first-chunk and last-chunk times of every round, all produced closed-loop from the 20
round-0 arrivals. Fed the same round-0 arrivals and lengths, the engine must produce the same
follow-up arrivals and token times, to the microsecond.
"""

from __future__ import annotations

import collections
import csv
import json
from unittest import mock

import numpy as np
import pytest
from engine_helpers import dims_floor, latency_model, params_from, random_scenario

from blis_jax.config import load_gpu, load_model
from blis_jax.engine import simulate as sim
from blis_jax.engine.output import COMPLETED, TIMED_OUT
from blis_jax.engine.params import make_engine_params
from blis_jax.latency import build_latency_model, output_token_time_us, post_decode_time_us
from blis_jax.workload.generate import generate_workload, load_spec
from blis_jax.workload.requests import make_request_set
from blis_jax.workload.sessions import FOLLOW_UP_ARRIVAL, SessionLinks, closed_loop_requests

from shared_data import BLIS_DIFF, needs_blis_diff  # noqa: E402

C06 = BLIS_DIFF / "C06_inference_perf_multiturn_scout"
THINK_US = 3_333_333
FOLLOW_UP_TIMEOUT_US = 300_000_000


def _c06_generating_run_inputs():
    rows = list(csv.DictReader((C06 / "trace.csv").open()))
    info = json.loads((C06 / "case.json").read_text())
    sessions = collections.defaultdict(list)
    for r in rows:
        sessions[r["session_id"]].append(r)
    for rs in sessions.values():
        rs.sort(key=lambda r: int(r["round_index"]))
    chains = sorted(sessions.values(), key=lambda rs: int(rs[0]["arrival_time_us"]))
    ordered = [rs[0] for rs in chains] + [r for rs in chains for r in rs[1:]]
    position = {id(r): i for i, r in enumerate(ordered)}
    n, n0 = len(ordered), len(chains)
    next_round, slot = np.full(n, -1), np.full(n, -1)
    for k, rs in enumerate(chains):
        for a, b in zip(rs, rs[1:]):
            next_round[position[id(a)]] = position[id(b)]
        for a in rs:
            slot[position[id(a)]] = k
    # The generating run shared the 256-token system prompt per tenant (its prefix group); the
    # trace flattens it into the row, so it is restored here.
    prefix = 256
    requests = make_request_set(
        request_id=np.arange(n),
        arrival_us=[int(r["arrival_time_us"]) if i < n0 else FOLLOW_UP_ARRIVAL for i, r in enumerate(ordered)],
        input_len=[prefix + int(r["input_tokens"]) if r["round_index"] == "0" else int(r["input_tokens"])
                   for r in ordered],
        output_len=[int(r["output_tokens"]) for r in ordered],
        deadline_us=[int(r["deadline_us"]) if i < n0 else 0 for i, r in enumerate(ordered)],
        prefix_group=[r["tenant_id"] for r in ordered], prefix_len=[prefix] * n,
        session_id=[r["session_id"] for r in ordered], round_index=[int(r["round_index"]) for r in ordered])
    links = SessionLinks(follow_up=np.arange(n) >= n0, next_round=next_round, think_time_us=np.full(n, THINK_US),
                         timeout_us=np.where(np.arange(n) >= n0, FOLLOW_UP_TIMEOUT_US, 0), session_slot=slot,
                         num_sessions=n0)
    model = build_latency_model("trained-physics", load_model(info["model"]), load_gpu(info["hardware"]), tp=info["tp"])
    params = make_engine_params(total_kv_blocks=info["total_kv_blocks"], max_model_len=info["max_model_len"])
    return rows, requests, links, model, params


@needs_blis_diff
@pytest.mark.slow  # default suite time (C06's run is also checked in test_run_blis_diff.py)
def test_c06_generating_run_is_reproduced_to_the_microsecond():
    rows, requests, links, model, params = _c06_generating_run_inputs()
    assert set(requests.input_len) == {606}          # the generating run's flattened length
    final, out = sim.simulate_sessions(requests, links, params, model)
    assert out.result == 0 and len(final) == len(rows) == 600
    ref = {(r["session_id"], int(r["round_index"])): r for r in rows}
    post = int(post_decode_time_us(model))
    for i in range(len(final)):
        r = ref[(str(final.session_id[i]), int(final.round_index[i]))]
        assert int(final.arrival_us[i]) == int(r["arrival_time_us"]), i
        assert int(final.arrival_us[i] + out.ttft_us[i]) == int(r["first_chunk_time_us"]), i
        # the trace's last chunk is before the post-decode overhead α1 that E2E includes
        assert int(final.arrival_us[i] + out.e2e_us[i]) == int(r["last_chunk_time_us"]) + post, i
        assert int(final.deadline_us[i]) == int(r["deadline_us"]), i
    # rows in the trace's order and numbered by it: same-tick follow-ups in generation order (blis-rng §12)
    assert [(str(s), int(k)) for s, k in zip(final.session_id, final.round_index)] == \
        [(r["session_id"], int(r["round_index"])) for r in rows]
    assert final.request_id.tolist() == [int(r["request_id"]) for r in rows]
    # case.json notes: the generating run's cache hit rate was 0.3173
    hit_rate = float(out.kv_hits[0]) / float(out.kv_hits[0] + out.kv_misses[0])
    assert round(hit_rate, 4) == 0.3173


def _chain_inputs(*, output=(30, 30, 30, 30), timeout_us=0, horizon_us=None, think_us=200_000, input_len=200,
                  sessions=2, max_model_len=0, total_kv_blocks=2000):
    """`sessions` sessions of len(output) rounds, starting 1 ms apart."""
    rounds = len(output)
    n0, n = sessions, sessions * rounds
    follow_rows = {(s, r): n0 + s * (rounds - 1) + (r - 1) for s in range(sessions) for r in range(1, rounds)}
    row = {**{(s, 0): s for s in range(sessions)}, **follow_rows}
    next_round, slot = np.full(n, -1), np.zeros(n, np.int64)
    outputs, rounds_of = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for (s, r), i in row.items():
        slot[i], outputs[i], rounds_of[i] = s, output[r], r
        if r + 1 < rounds:
            next_round[i] = row[(s, r + 1)]
    requests = make_request_set(
        request_id=np.arange(n), arrival_us=[1000 * i if i < n0 else FOLLOW_UP_ARRIVAL for i in range(n)],
        input_len=np.full(n, input_len), output_len=outputs, session_id=[f"s{slot[i]}" for i in range(n)],
        round_index=rounds_of)
    follow = np.arange(n) >= n0
    links = SessionLinks(follow_up=follow, next_round=next_round, think_time_us=np.full(n, think_us),
                         timeout_us=np.where(follow, timeout_us, 0), session_slot=slot, num_sessions=sessions)
    params = params_from({"max_num_seqs": 8, "max_num_batched_tokens": 512, "total_kv_blocks": total_kv_blocks,
                          "horizon_us": horizon_us, "max_model_len": max_model_len})
    return requests, links, params


# One program shape for every chain scenario below (each would otherwise compile its own).
CHAIN_FLOOR = {("fcfs", "fcfs"): sim.choose_dims(
    input_len=np.full(16, 200), output_len=np.full(16, 600), prefix_group=np.full(16, -1),
    prefix_len=np.zeros(16, np.int64), max_num_seqs=8, max_num_batched_tokens=512, total_kv_blocks=2000,
    block_size=16, step_log=200_000, num_sessions=4)}


def _run_chain(requests, links, params):
    with dims_floor(CHAIN_FLOOR):
        return sim.simulate_sessions(requests, links, params, latency_model())


@pytest.mark.slow  # default suite time
def test_rounds_follow_completions_by_the_think_time():
    requests, links, params = _chain_inputs(output=(30, 5, 60, 1))
    model = latency_model()
    final, out = _run_chain(requests, links, params)
    assert len(final) == 8 and (out.status == COMPLETED).all()
    a2, a1 = int(output_token_time_us(model)), int(post_decode_time_us(model))
    for s in ("s0", "s1"):
        mine = np.flatnonzero(final.session_id == s)
        mine = mine[np.argsort(final.round_index[mine])]
        assert final.round_index[mine].tolist() == [0, 1, 2, 3]
        # completion = end of the last step = arrival + E2E − α1 − α2 per output token (INV-10)
        done_at = final.arrival_us[mine] + out.e2e_us[mine] - a1 - a2 * final.output_len[mine]
        np.testing.assert_array_equal(final.arrival_us[mine[1:]], done_at[:-1] + 200_000)
    # follow-ups are numbered after the static requests, in arrival order
    assert sorted(final.request_id.tolist()) == list(range(8))
    assert (np.diff(final.arrival_us) >= 0).all()


def test_a_timed_out_round_ends_its_session():
    # round 2 (600 output tokens) cannot finish within its 1 s timeout; round 3 never exists
    requests, links, params = _chain_inputs(output=(20, 20, 600, 20), timeout_us=1_000_000, sessions=1)
    final, out = _run_chain(requests, links, params)
    assert final.round_index.tolist() == [0, 1, 2]
    assert out.status.tolist() == [COMPLETED, COMPLETED, TIMED_OUT]
    assert int(out.timed_out[0]) == 1
    np.testing.assert_array_equal(final.deadline_us[1:], final.arrival_us[1:] + 1_000_000)


def test_the_horizon_interrupts_a_session_and_outputs_are_deterministic():
    requests, links, params = _chain_inputs(output=(20,) * 6, horizon_us=1_500_000, think_us=400_000)
    final, out = _run_chain(requests, links, params)
    assert 0 < len(final) < 12
    assert final.arrival_us.max() <= 1_500_000
    again_final, again = _run_chain(requests, links, params)
    np.testing.assert_array_equal(final.arrival_us, again_final.arrival_us)
    for name in ("status", "ttft_us", "e2e_us", "itl_step_us", "itl_runs"):
        assert getattr(out, name).tobytes() == getattr(again, name).tobytes()


def test_a_dropped_round_ends_its_session():
    # max_model_len 300: round 0 (200 + 30) fits, round 1 (200 + 150) is dropped at enqueue
    requests, links, params = _chain_inputs(output=(30, 150, 30), sessions=1, max_model_len=300)
    final, out = _run_chain(requests, links, params)
    assert final.round_index.tolist() == [0, 1]
    assert int(out.dropped_unservable[0]) == 1


def test_stale_timeouts_do_not_hit_a_reused_window_slot():
    """Completed requests' timeouts fire long after their window slot went to a newer request:
    with every deadline seconds after a sub-second service, nothing may time out."""
    requests = random_scenario(5, n=300, rate_rps=40.0, output_range=(30, 80), deadline_frac=1.0,
                               deadline_range_us=(2_500_000, 3_500_000))
    params = params_from({"max_num_seqs": 64, "max_num_batched_tokens": 2048, "total_kv_blocks": 6000})
    original = sim.choose_dims

    def narrow(**kwargs):
        import dataclasses
        return dataclasses.replace(original(**kwargs), window=64)

    with mock.patch.object(sim, "choose_dims", narrow):
        out = sim.simulate_instance(requests, params, latency_model())
    assert out.result == 0
    assert int(out.timed_out[0]) == 0 and (out.status == COMPLETED).all()
    # the slots really were reused before the stale timeouts fired
    assert len(requests) > 64 and int(requests.deadline_us.min()) > int(requests.arrival_us[64])


@needs_blis_diff
def test_spec_sessions_expand_into_linked_rounds():
    generated = generate_workload(load_spec(C06 / "workload.yaml"), sessions="first_round")
    requests, links = closed_loop_requests(generated)
    assert len(generated.requests) == 20 and len(requests) == 600 and links.num_sessions == 20
    follow = links.follow_up
    assert follow.sum() == 580 and (requests.arrival_us[~follow] < FOLLOW_UP_ARRIVAL).all()
    # each session is a chain of 30 rows: round 0 static, then linked follow-ups
    for s in range(20):
        chain, row = [], int(np.flatnonzero((links.session_slot == s) & ~follow)[0])
        while row >= 0:
            chain.append(row)
            row = int(links.next_round[row])
        assert requests.round_index[chain].tolist() == list(range(30))
        assert len(set(requests.session_id[chain])) == 1
    assert set(links.think_time_us[links.session_slot >= 0]) == {THINK_US}
    assert set(links.timeout_us[follow]) == {FOLLOW_UP_TIMEOUT_US}
    assert set(requests.input_len) == {606} and set(requests.output_len) == {180}

