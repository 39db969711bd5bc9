"""Concurrency users (blis-features §4.9): `concurrency: N` closed-loop users, `think_time_us`.

User u's first request arrives at u·think/N; each completion brings the user's next request a
think time later (INV-10, to the microsecond), under a global follow-up budget
num_requests − initial requests; a timeout, a drop or the horizon ends a user. Every engine
run here shares one compiled program (a dims floor).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from engine_helpers import dims_floor, latency_model, params_from

from blis_jax.engine import simulate as sim
from blis_jax.engine.output import COMPLETED, TIMED_OUT
from blis_jax.errors import ConfigError
from blis_jax.latency import output_token_time_us, post_decode_time_us
from blis_jax.metrics import session_summary
from blis_jax.workload.generate import generate_workload
from blis_jax.workload.sessions import closed_loop_requests

THINK = 20_000
SETTINGS = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "total_kv_blocks": 2000}
FLOOR = {("fcfs", "fcfs"): sim.choose_dims(
    input_len=np.full(64, 400), output_len=np.full(64, 200), prefix_group=np.full(64, -1),
    prefix_len=np.zeros(64, np.int64), max_num_seqs=8, max_num_batched_tokens=512, total_kv_blocks=2000,
    block_size=16, step_log=200_000, num_sessions=8)}


def _users(client_id="u", concurrency=4, think=THINK, output_mean=20, output_max=40, **extra):
    return {"id": client_id, "concurrency": concurrency, "think_time_us": think,
            "input_distribution": {"type": "gaussian", "params": {"mean": 150, "std_dev": 40, "min": 10, "max": 300}},
            "output_distribution": {"type": "gaussian",
                                    "params": {"mean": output_mean, "std_dev": 10, "min": 1, "max": output_max}},
            **extra}


def _spec(*clients, num_requests=24, **top):
    return {"version": "2", "seed": 7, "num_requests": num_requests, "clients": list(clients or [_users()]), **top}


def _run(spec, *, horizon_us=None, **overrides):
    generated = generate_workload(spec, sessions="first_round", **overrides)
    requests, links = closed_loop_requests(generated)
    with dims_floor(FLOOR):
        final, out = sim.simulate_sessions(requests, links, params_from({**SETTINGS, "horizon_us": horizon_us}),
                                           latency_model())
    assert out.result == 0
    return final, out


def _done_at(final, out):
    """Completion tick (end of the last step): arrival + E2E − α1 − α2 per output token."""
    model = latency_model()
    a1, a2 = int(post_decode_time_us(model)), int(output_token_time_us(model))
    return final.arrival_us + out.e2e_us - a1 - a2 * final.output_len


def _by_user(final):
    """{session id: its rows in round order}."""
    users = {}
    for s in np.unique(final.session_id):
        mine = np.flatnonzero(final.session_id == s)
        users[str(s)] = mine[np.argsort(final.round_index[mine])]
    return users


def _check_chains(final, out, think=None):
    """Round indices 0..k and INV-10 with equality: a round arrives think after its predecessor
    completed (`think`: {client id: µs}, default THINK). Returns {user: rows}."""
    done_at = _done_at(final, out)
    users = _by_user(final)
    for rows in users.values():
        assert final.round_index[rows].tolist() == list(range(len(rows)))
        assert len(set(final.client_id[rows])) == 1
        assert (out.status[rows[:-1]] == COMPLETED).all()   # only a completion brings a next round
        wait = THINK if think is None else think[str(final.client_id[rows[0]])]
        np.testing.assert_array_equal(final.arrival_us[rows[1:]], done_at[rows[:-1]] + wait)
    return users


def _max_in_flight(final, out, mask=None):
    """Most requests (of `mask`) arrived and not yet finished at any instant (finished =
    completion tick)."""
    mask = np.ones(len(final), bool) if mask is None else mask
    finished = np.where(out.status == COMPLETED, _done_at(final, out), np.iinfo(np.int64).max)[mask]
    times = np.concatenate([final.arrival_us[mask], finished])
    delta = np.concatenate([np.ones(len(finished), int), -np.ones(len(finished), int)])
    order = np.lexsort((delta, times))          # a finish before an arrival at the same tick
    return int(np.cumsum(delta[order]).max())


def test_users_run_closed_loop_until_num_requests():
    final, out = _run(_spec())
    assert len(final) == 24 and (out.status == COMPLETED).all()
    assert sorted(final.request_id.tolist()) == list(range(24)) and (np.diff(final.arrival_us) >= 0).all()
    users = _check_chains(final, out)
    # BLIS names users concurrency_<client>_user_<u> (blis-rng §6.2)
    assert sorted(users) == [f"concurrency_u_user_{u}" for u in range(4)]
    # user u's first request at u·think/N
    assert [int(final.arrival_us[users[f"concurrency_u_user_{u}"][0]]) for u in range(4)] == [0, 5000, 10000, 15000]
    assert sum(len(r) for r in users.values()) == 24 and min(len(r) for r in users.values()) >= 2
    assert _max_in_flight(final, out) == 4
    # the run ends at the last completion (not at a follow-up row's placeholder arrival)
    assert int(np.max(out.sim_end_us)) == int(_done_at(final, out).max())
    assert set(final.client_id) == {"u"}
    # lengths are fresh per request (pool rows drawn iid), not repeated from round 0
    assert len(set(final.output_len.tolist())) > 5
    summary = session_summary(out, final)
    assert summary.sessions == 4 and summary.ttft_cold[4] == 4 and summary.ttft_warm[4] == 20


def test_each_user_draws_its_follow_ups_from_its_own_stream():
    """BLIS: user u's k-th follow-up takes the k-th lengths of u's blueprint stream, whatever
    order the users complete in (blis-rng §7 step 5). Here the users' rounds have random lengths,
    so they do not complete in turn."""
    generated = generate_workload(_spec(), sessions="first_round")
    final, out = _run(_spec())
    users = _by_user(final)
    # follow-ups in generation order (rows are in arrival order, all think times equal): not in turn
    turns = [int(str(s).rsplit("_", 1)[1]) for s in final.session_id[final.round_index > 0]]
    assert turns != [k % 4 for k in range(len(turns))]
    plans = {p.session_id: p for p in generated.sessions}
    for user, rows in users.items():
        plan = plans[user]
        k = len(rows) - 1
        assert (final.input_len[rows[1:]] - plan.prefix_len).tolist() == plan.fresh[:k].tolist(), user
        assert final.output_len[rows[1:]].tolist() == plan.output[:k].tolist(), user


def test_the_budget_caps_follow_ups_and_goes_in_completion_order():
    final, out = _run(_spec(), num_requests=6)
    assert len(final) == 6 and (out.status == COMPLETED).all()
    users = _check_chains(final, out)
    follow = final.round_index > 0
    assert follow.sum() == 2 and (final.round_index <= 1).all()
    # the two follow-ups went to the two users whose first request completed first
    done_at = _done_at(final, out)
    first = {u: rows[0] for u, rows in users.items()}
    earliest = sorted(first, key=lambda u: (done_at[first[u]], first[u]))[:2]
    assert sorted(str(s) for s in final.session_id[follow]) == sorted(earliest)
    # no budget beyond the initial requests: every user gets exactly one request
    final, out = _run(_spec(), num_requests=4)
    assert len(final) == 4 and (final.round_index == 0).all()


def test_the_horizon_interrupts_users_and_runs_are_deterministic():
    horizon = 400_000
    final, out = _run(_spec(), horizon_us=horizon)
    assert 4 < len(final) < 24 and final.arrival_us.max() <= horizon
    users = _check_chains(final, out)
    done_at = _done_at(final, out)
    for rows in users.values():
        last = rows[-1]
        # the budget is not spent, so a user stops only when its next arrival is past the horizon
        assert out.status[last] != COMPLETED or done_at[last] + THINK > horizon
    again_final, again = _run(_spec(), horizon_us=horizon)
    for name in ("arrival_us", "input_len", "output_len", "session_id", "round_index", "request_id"):
        assert getattr(final, name).tobytes() == getattr(again_final, name).tobytes()
    for name in ("status", "ttft_us", "e2e_us", "itl_step_us", "itl_runs"):
        assert getattr(out, name).tobytes() == getattr(again, name).tobytes()


def test_a_timed_out_request_ends_its_user():
    # 150 ms timeout (steps take ~7 ms): requests with long outputs time out, ending their users
    spec = _spec(_users(timeout=150_000), num_requests=40)
    final, out = _run(spec)
    timed_out = out.status == TIMED_OUT
    assert timed_out.any() and (final.round_index > 0).any()
    assert int(out.timed_out[0]) == int(timed_out.sum())
    users = _check_chains(final, out)
    for rows in users.values():
        assert not timed_out[rows[:-1]].any()      # a timed-out request is its user's last
    # every user ended by a timeout before the budget was spent
    assert len(final) < 40 and all(timed_out[rows[-1]] for rows in users.values())
    # follow-ups carry the client timeout relative to their own arrival
    np.testing.assert_array_equal(final.deadline_us, final.arrival_us + 150_000)


def test_concurrency_clients_share_the_budget():
    spec = _spec(_users("a", concurrency=2, think=10_000), _users("b", concurrency=3, think=30_000),
                 num_requests=20)
    final, out = _run(spec)
    assert len(final) == 20 and (out.status == COMPLETED).all()
    users = _check_chains(final, out, {"a": 10_000, "b": 30_000})
    for index, client, think, n in ((0, "a", 10_000, 2), (1, "b", 30_000, 3)):
        mine = {u: rows for u, rows in users.items() if final.client_id[rows[0]] == client}
        assert sorted(mine) == [f"concurrency_{client}_user_{u}" for u in range(n)]
        assert [int(final.arrival_us[mine[f"concurrency_{client}_user_{u}"][0]]) for u in range(n)] == \
            [u * think // n for u in range(n)]
        assert _max_in_flight(final, out, final.client_id == client) <= n
    # one budget for both: 15 follow-ups in all, however they split
    assert (final.round_index > 0).sum() == 15 and len(set(final.client_id[final.round_index > 0])) == 2


def test_concurrency_users_need_num_requests_and_cannot_mix_with_multi_turn():
    with pytest.raises(ConfigError, match=r"^num_requests: concurrency users \(clients\[0\]\.concurrency\)"):
        closed_loop_requests(generate_workload(_spec(num_requests=0, horizon=1_000_000), sessions="first_round"))
    with pytest.raises(ConfigError, match=r"concurrency clients cannot be mixed"):
        multi_turn = {k: v for k, v in _users("m").items() if k not in ("concurrency", "think_time_us")}
        multi_turn.update(rate_fraction=1.0, reasoning={"multi_turn": {"max_rounds": 3}})
        generate_workload(_spec(_users(), multi_turn, aggregate_rate=10.0), sessions="first_round")


def test_cli_run_with_concurrency_users(tmp_path):
    import io

    import yaml

    from blis_jax.cli import main

    path = tmp_path / "users.yaml"
    path.write_text(yaml.safe_dump(_spec()))
    out, err = io.StringIO(), io.StringIO()
    results = tmp_path / "results.json"
    with dims_floor(FLOOR):
        rc = main(["run", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--hardware", "H100", "--tp", "1",
                   "--workload-spec", str(path), "--total-kv-blocks", "2000", "--max-num-seqs", "8",
                   "--max-num-batched-tokens", "512", "--results-path", str(results)], stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    stdout = out.getvalue()
    assert '"completed_requests": 24' in stdout
    duration = float(re.search(r'"vllm_estimated_duration_s": ([0-9.e+-]+)', stdout).group(1))
    assert 0.1 < duration < 10
    assert "=== Session Metrics ===" in stdout and "Sessions: 4" in stdout and "(n=20)" in stdout
    assert results.exists()
