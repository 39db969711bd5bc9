"""observe: dispatching and sessions against the local test server (spec §6; worked examples
E11, E12, E17): dispatch order, warm-up exclusion, the concurrency limit, error runs,
closed-loop follow-ups driven by real completions, concurrency users, prewarm, interrupts."""

from __future__ import annotations

import argparse
import asyncio
import time

from observe_helpers import client_for, run, workload

from blis_jax.observe.dispatcher import Dispatcher
from blis_jax.observe.prompts import PromptBuilder
from blis_jax.observe.records import itl_records
from blis_jax.observe.sessions import LiveSessions, parse_think_time_dist, think_sampler
from blis_jax.observe.testserver import OpenAITestServer, ServerConfig
from blis_jax.observe.warmup import prewarm
from blis_jax.cli.observe import build_workload

FAST = ServerConfig(ttft_ms=1.0, itl_ms=0.0)


async def _dispatch(w, config=FAST, *, timeout_s=5.0, interrupt_after_s=None, **kw):
    async with OpenAITestServer(config) as server, client_for(server.url, timeout_s=timeout_s) as client:
        d = Dispatcher(w, client, PromptBuilder(1.0), LiveSessions(w, horizon_us=w.horizon_us),
                       max_concurrency=kw.pop("max_concurrency", 256), **kw)
        if interrupt_after_s is not None:
            asyncio.get_running_loop().call_later(interrupt_after_s, d.interrupt)
        records = await d.run()
        return d, records, server


def dispatch(w, config=FAST, **kw):
    return run(_dispatch(w, config, **kw))


def spec_workload(spec: dict, seed=None, num_requests=0, horizon=0) -> object:
    from blis_jax.observe.workload import from_spec
    return from_spec(spec, seed, num_requests, horizon, label="spec.yaml")


def test_e11_open_loop_exact_sequence_with_one_slot():
    w = workload([0, 5000, 5000, 10000, 20000], input_len=[11, 22, 33, 44, 55])
    _, records, _ = dispatch(w, max_concurrency=1)
    assert [r.index for r in records] == [0, 1, 2, 3, 4]
    assert [r.planned.arrival_us for r in records] == [0, 5000, 5000, 10000, 20000]
    assert [int(w.requests.input_len[r.planned.row]) for r in records] == [11, 22, 33, 44, 55]
    assert all(r.outcome.status == "ok" for r in records)


def test_e11_warmup_exclusion():
    _, records, server = dispatch(workload([0, 1000, 2000, 3000, 4000]), warmup_requests=2)
    assert sorted(r.index for r in records) == [2, 3, 4]
    assert server.received == 5  # warm-ups are sent, only not recorded
    _, records, _ = dispatch(workload([0, 1000]), warmup_requests=5)
    assert records == []


def test_e11_concurrency_limit_is_never_exceeded():
    w = workload([0, 10_000, 20_000, 30_000, 40_000], output_len=[3] * 5)
    d, records, server = dispatch(w, ServerConfig(ttft_ms=10.0, itl_ms=10.0), max_concurrency=2)
    assert len(records) == 5 and all(r.outcome.status == "ok" for r in records)
    assert server.max_in_flight <= 2 and d.max_in_flight == 2
    # later requests queue behind busy slots: sent late, never re-timed
    late = [r.outcome.send_us for r in sorted(records, key=lambda r: r.index)]
    assert late == sorted(late)


def test_e11_all_errors_complete_the_run():
    _, records, _ = dispatch(workload([i * 1000 for i in range(10)]), ServerConfig(error_status=500))
    assert len(records) == 10
    assert all(r.outcome.status == "error" and r.outcome.error_message == "HTTP 500: upstream error" for r in records)


def _multi_turn(max_rounds):
    return {"version": "2", "seed": 3, "num_requests": 1, "clients": [{
        "id": "mt", "rate_fraction": 1.0, "arrival": {"process": "poisson"},
        "input_distribution": {"type": "constant", "params": {"value": 20}},
        "output_distribution": {"type": "constant", "params": {"value": 4}},
        "reasoning": {"multi_turn": {"max_rounds": max_rounds, "think_time_us": 10_000,
                                     "context_growth": "accumulate", "single_session": True}}}],
        "aggregate_rate": 10.0}


def test_e12_follow_up_arrives_think_time_after_the_completion():
    w = spec_workload(_multi_turn(2))
    d, records, server = dispatch(w)
    assert [r.planned.round_index for r in records] == [0, 1]
    first, second = records
    assert first.planned.session_id == second.planned.session_id != ""
    done_offset = (first.outcome.last_chunk_us - first.outcome.send_us)  # lower bound of the completion
    assert second.planned.arrival_us >= first.planned.arrival_us + done_offset + 10_000
    assert second.planned.arrival_us - (first.planned.arrival_us + 10_000) < 200_000
    # accumulate: round 1's prompt starts with round 0's words, then the output IDs 1..n
    p0, p1 = server.bodies[0]["prompt"], server.bodies[1]["prompt"]
    assert p1.startswith(p0 + "bravo charlie delta echo ")
    assert second.outcome.streaming is False  # follow-ups never stream without --record-itl


def test_e12_failed_round_ends_the_session():
    w = spec_workload(_multi_turn(3))
    _, records, _ = dispatch(w, ServerConfig(error_status=500))
    assert [r.planned.round_index for r in records] == [0]


def test_e12_record_itl_streams_follow_ups():
    w = spec_workload(_multi_turn(2))
    _, records, _ = dispatch(w, stream_all=True)
    assert [r.outcome.streaming for r in records] == [True, True]
    follow = [r for r in records if r.planned.round_index == 1][0]
    assert follow.outcome.num_chunks >= 2
    assert any(rid == follow.index for rid, _, _ in itl_records(records))


def test_e12_concurrency_users_seeds_and_budget():
    args = argparse.Namespace(workload_spec="", workload="", concurrency=4, think_time_ms=400, seed=None,
                              num_requests=100, horizon=0, prefix_tokens=None, rate=None,
                              **{f"{k}_tokens{s}": None for k in ("prompt", "output")
                                 for s in ("", "_stdev", "_min", "_max")})
    w = build_workload(args, diag=None)
    assert w.requests.arrival_us[w.static_rows].tolist() == [0, 100_000, 200_000, 300_000]
    args.concurrency, args.think_time_ms, args.num_requests = 5, 0, 12
    args.output_tokens, args.output_tokens_min, args.output_tokens_max, args.output_tokens_stdev = 3, 1, 5, 1
    args.prompt_tokens, args.prompt_tokens_stdev = 20, 5
    w = build_workload(args, diag=None)
    assert len(w.static_rows) == 5
    _, records, _ = dispatch(w)
    assert len(records) == 12  # 5 seeds + a budget of 7 follow-ups
    users = {r.planned.session_id for r in records}
    assert len(users) == 5 and all(u for u in users)
    by_user = {}
    for r in sorted(records, key=lambda r: r.index):
        by_user.setdefault(r.planned.session_id, []).append(r.planned.round_index)
    assert all(rounds == list(range(len(rounds))) for rounds in by_user.values())
    # a user's round k is the k-th row of its own chain (its own lengths, blis-rng §7 step 5),
    # whichever users completed first
    rows = {}
    for r in records:
        rows.setdefault(r.planned.session_id, {})[r.planned.round_index] = r.planned.row
    for chain in rows.values():
        assert all(chain[k] == w.links.next_round[chain[k - 1]] for k in range(1, len(chain)))


def test_concurrency_user_removed_after_a_failure():
    args = argparse.Namespace(workload_spec="", workload="", concurrency=2, think_time_ms=0, seed=None,
                              num_requests=10, horizon=0, prefix_tokens=None, rate=None, prompt_tokens=20,
                              prompt_tokens_stdev=1, prompt_tokens_min=2, prompt_tokens_max=40, output_tokens=2,
                              output_tokens_stdev=0, output_tokens_min=1, output_tokens_max=4)
    _, records, _ = dispatch(build_workload(args, diag=None), ServerConfig(error_status=503))
    assert len(records) == 2  # both users' first request failed: no follow-ups


def test_interrupt_aborts_in_flight_and_stops_dispatching():
    w = workload([0, 0, 50_000_000], output_len=[50] * 3)
    d, records, _ = dispatch(w, ServerConfig(ttft_ms=2000.0), interrupt_after_s=0.3)
    assert len(records) == 2 and d.dispatched == 2
    assert all(r.outcome.status == "error" and r.outcome.error_message == "HTTP error: context canceled"
               for r in records)


def test_e17_prewarm_runs_for_its_duration_and_stops_on_interrupt():
    async def go(duration, stop_after):
        async with OpenAITestServer(FAST) as server, client_for(server.url) as client:
            stop = asyncio.Event()
            if stop_after is not None:
                asyncio.get_running_loop().call_later(stop_after, stop.set)
            t = time.monotonic()
            sent, failed = await prewarm(client, duration, stop, lambda m: None)
            return time.monotonic() - t, sent, failed, server.bodies[0]
    took, sent, failed, body = run(go(1.0, None))
    assert 1.0 <= took < 3.0 and sent >= 1 and failed == 0
    assert body == {"model": "M", "prompt": "warm " * 256, "stream": False, "max_tokens": 64}
    took, _, _, _ = run(go(30.0, 0.5))
    assert took < 2.0


def test_think_time_dist_parsing_and_sampling():
    assert parse_think_time_dist("constant:value=500ms") == ("constant", {"value": 500_000.0})
    kind, params = parse_think_time_dist("lognormal:mu=2.0,sigma=0.6,min=3s,max=30s")
    draw = think_sampler(kind, params, seed=1)
    values = [draw(0) for _ in range(200)]
    assert min(values) >= 3_000_000 and max(values) <= 30_000_000
    for bad, message in (("gamma:k=1", 'unsupported think-time-dist type "gamma"'), ("lognormal", "must have format"),
                         ("lognormal:mu=1", "requires sigma"), ("constant:value=1,value=2", "duplicate key")):
        try:
            parse_think_time_dist(bad)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            assert message in str(e)
        else:
            raise AssertionError(bad)


def test_server_ignoring_min_tokens_is_warned_about():
    from blis_jax.observe.client import Client, ClientConfig

    async def go():
        async with OpenAITestServer(ServerConfig(ttft_ms=1.0, itl_ms=0.0, ignore_min_tokens=True,
                                                 default_output_tokens=2)) as server:
            async with Client.make_session(4) as session:
                warnings = []
                client = Client(ClientConfig(server_url=server.url, model="M"), session, warn=warnings.append)
                w = workload([0], output_len=[5])
                records = await Dispatcher(w, client, PromptBuilder(1.0), LiveSessions(w), max_concurrency=1).run()
                return records, warnings
    records, warnings = run(go())
    assert records[0].outcome.output_tokens == 2 and records[0].outcome.finish_reason == "stop"
    assert warnings == ["generated 2 tokens (< min_tokens=5); server may not support min_tokens"]


def test_server_rejecting_priority_like_a_default_vllm():
    w = workload([0, 1000], slo_class=["critical", "batch"])
    _, records, server = dispatch(w, ServerConfig(ttft_ms=1.0, itl_ms=0.0, reject_priority=True), max_concurrency=1)
    by_class = {str(w.requests.slo_class[r.planned.row]): r.outcome for r in records}
    assert by_class["critical"].status == "ok"
    assert (by_class["batch"].status, by_class["batch"].error_message) == (
        "error", "HTTP 400: priority scheduling is not enabled")
    assert [b["priority"] for b in server.bodies] == [0, 5]


def _flags(**kw):
    base = dict(workload_spec="", workload="", concurrency=0, think_time_ms=None, seed=None, num_requests=0,
                horizon=0, prefix_tokens=None, rate=None,
                **{f"{k}_tokens{s}": None for k in ("prompt", "output") for s in ("", "_stdev", "_min", "_max")})
    return argparse.Namespace(**{**base, **kw})


def test_preset_and_distribution_workloads_are_runs_workloads():
    from blis_jax.scenario import resolve
    from blis_jax.scenario.settings import apply_settings

    w = build_workload(_flags(workload="chatbot", rate=5.0, num_requests=3), diag=None)
    assert w.workload_spec == "preset:chatbot"
    assert w.requests.deadline_us.tolist() == [0, 0, 0]  # observe pushes no client timeout
    # the same arrivals and lengths as `blis-jax run` generates for the same flags and seed
    run_requests = resolve(apply_settings({"rate": 5, "num-requests": 3, "workload": "chatbot"}, "run")).requests
    assert w.requests.arrival_us.tolist() == run_requests.arrival_us.tolist() == [199_999, 399_998, 599_997]
    assert w.requests.input_len.tolist() == run_requests.input_len.tolist()
    assert w.requests.output_len.tolist() == run_requests.output_len.tolist()
    d = build_workload(_flags(rate=10.0, num_requests=4, prefix_tokens=16, seed=3), diag=None)
    assert d.workload_spec is None and d.seed == 3 and d.prefix_lengths == {"shared": 16}
    assert (d.requests.prefix_len == 16).all() and d.requests.arrival_us[0] == 99_999


def test_follow_up_is_not_held_back_by_a_later_pre_generated_request():
    spec = _multi_turn(2)
    spec["num_requests"] = 3
    spec["aggregate_rate"] = 2.0
    # BLIS's constant process starts one interval in: round 0 at 1/1.5 s, the single request at 2 s
    spec["clients"][0]["arrival"] = {"process": "constant"}
    spec["clients"][0]["rate_fraction"] = 1.5
    spec["clients"].append({"id": "single", "rate_fraction": 0.5, "arrival": {"process": "constant"},
                            "input_distribution": {"type": "constant", "params": {"value": 20}},
                            "output_distribution": {"type": "constant", "params": {"value": 2}}})
    w = spec_workload(spec)
    static = w.requests.arrival_us[w.static_rows].tolist()
    assert static[-1] - static[0] >= 900_000  # a pre-generated request about 1 s after round 0
    _, records, _ = dispatch(w)
    assert len(records) == 3  # round 0, its follow-up and the single request (BLIS counts both rounds)
    first = min((r for r in records if r.planned.session_id), key=lambda r: r.index)
    follow = [r for r in records if r.planned.session_id and r.planned.round_index == 1][0]
    # sent about the think time after round 0 completed, not after the later request's arrival
    assert follow.outcome.send_us - first.outcome.last_chunk_us < 300_000
    assert follow.planned.arrival_us < static[-1]
