"""inference-perf multi-turn chat as an open-loop load (`inference_perf.multi_turn_mode: open-loop`,
`blis-jax fit --load-generator open-loop`): Poisson arrivals at the stage rate per user, user
labels, strict validation, and the closed-loop default left unchanged. No simulation runs here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from blis_jax.cli import build_parser
from blis_jax.cli import fit as fit_commands
from blis_jax.cli.app import UsageError
from blis_jax.config import load_coefficients
from blis_jax.errors import ConfigError
from blis_jax.fit import fit as F
from blis_jax.fit.observed import parse_observed
from blis_jax.workload.convert import convert_inference_perf
from blis_jax.workload.generate import generate_requests, generate_workload
from blis_jax.workload.inference_perf import expand_inference_perf
from blis_jax.workload.spec import parse_spec, spec_to_dict

P, U = 3, 4
SYS, Q, OUT = 64, 100, 20
STAGES = ((6.0, 40.0), (15.0, 30.0))       # (rate req/s, duration s)


def _raw(mode: str | None = "open-loop", stages=STAGES, multi_turn: bool = True, seed: int = 7) -> dict:
    ip = {"stages": [{"rate": r, "duration": d} for r, d in stages],
          "shared_prefix": {"num_unique_system_prompts": P, "num_users_per_system_prompt": U,
                            "system_prompt_len": SYS, "question_len": Q, "output_len": OUT,
                            "enable_multi_turn_chat": multi_turn}}
    if mode is not None:
        ip["multi_turn_mode"] = mode
    return {"version": "2", "seed": seed, "inference_perf": ip}


@pytest.fixture(scope="module")
def open_loop():
    return generate_workload(_raw(), sessions="error")


# ------------------------------------------------------------------------- arrivals


def test_each_stage_gets_poisson_arrivals_at_exactly_the_stage_rate(open_loop):
    req = open_loop.requests
    assert open_loop.sessions == ()                      # nothing closed-loop left for the engine
    start = 0.0
    scaled_iats = []
    for s, (rate, duration) in enumerate(STAGES):
        lo, hi = start * 1e6, (start + duration) * 1e6
        mine = np.char.startswith(req.client_id.astype(str), f"stage-{s}-")
        t = req.arrival_us[mine]
        assert t.min() >= lo and t.max() < hi            # inside the stage window
        expected = rate * duration                       # Poisson count: mean = variance = rate·duration
        assert abs(len(t) - expected) < 4 * math.sqrt(expected)
        per_user = rate / (P * U)
        users = np.unique(req.client_id[mine])
        assert len(users) == P * U
        for u in users:
            times = np.sort(req.arrival_us[req.client_id == u]).astype(np.float64)
            # Gaps from the window start: by memorylessness all are Exp(per_user) (the censored
            # gap to the window end is left out).
            scaled_iats.append(np.diff(np.concatenate([[lo], times])) / 1e6 * per_user)
        start += duration
    iats = np.concatenate(scaled_iats)
    assert len(iats) > 500
    assert stats.kstest(iats, "expon").pvalue > 1e-3
    assert abs(iats.mean() - 1.0) < 4 / math.sqrt(len(iats))   # moment check: mean 1/rate


def test_single_stage_is_poisson_too_not_an_exact_count():
    req = generate_requests(_raw(stages=((7.5, 40.0),)))
    assert set(np.char.startswith(req.client_id.astype(str), "prompt-")) == {True}
    assert abs(len(req) - 300) < 4 * math.sqrt(300)
    assert req.arrival_us.max() < 40_000_000
    counts = np.unique(req.client_id, return_counts=True)[1]
    assert len(counts) == P * U and counts.var() > 0        # not the closed-loop even split


def test_many_seeds_total_count_is_unbiased():
    # Σ over 20 seeds of a Poisson(rate·duration) count: mean 20·300, sd √6000.
    totals = [len(generate_requests(_raw(stages=((7.5, 40.0),), seed=s))) for s in range(20)]
    assert abs(sum(totals) - 6000) < 4 * math.sqrt(6000)


def test_lengths_prefix_and_labels(open_loop):
    req = open_loop.requests
    assert set(req.input_len) == {SYS + Q} and set(req.output_len) == {OUT} and set(req.prefix_len) == {SYS}
    names = np.array(req.prefix_group_names)[req.prefix_group]
    np.testing.assert_array_equal(names, req.tenant_id)
    assert set(req.slo_class) == {"standard"} and (req.deadline_us == 0).all()
    assert "reason_ratio" not in req.trace_columns
    assert np.all(np.diff(req.arrival_us) >= 0)
    # One session per user (client), its rounds 0, 1, 2, … in arrival order.
    sessions = {}
    for client in np.unique(req.client_id):
        rows = np.flatnonzero(req.client_id == client)
        assert len(set(req.session_id[rows])) == 1
        sessions[str(req.session_id[rows[0]])] = client
        np.testing.assert_array_equal(req.round_index[rows], np.arange(len(rows)))
        assert np.all(np.diff(req.arrival_us[rows]) >= 0)
    assert len(sessions) == len(np.unique(req.client_id)) == len(STAGES) * P * U
    index = {rc.spec.id: rc.index for rc in open_loop.clients}
    assert all(sid == f"session-{index[str(c)]}-0" for sid, c in sessions.items())


def test_same_seed_is_identical_and_convert_keeps_arrivals(open_loop):
    again = generate_workload(_raw(), sessions="first_round").requests
    for field in ("arrival_us", "input_len", "output_len", "client_id", "session_id", "round_index"):
        np.testing.assert_array_equal(getattr(again, field), getattr(open_loop.requests, field))
    converted = convert_inference_perf(_raw())
    assert "inference_perf" not in converted and converted.get("num_requests", 0) == 0
    # The converted clients are plain v2 clients, which draw BLIS's token IDs between arrivals
    # (blis-rng §5.3); the open-loop extension draws none, so only the clients and processes
    # carry over, not the exact arrivals.
    plain = generate_requests(converted)
    assert set(plain.client_id) == set(open_loop.requests.client_id)


def test_an_explicit_num_requests_still_caps():
    raw = _raw(stages=((7.5, 40.0),))
    raw["num_requests"] = 100
    req = generate_requests(raw)
    assert len(req) == 100 and req.round_index.max() < 100


# ------------------------------------------------------------------- default + validation


def test_closed_loop_stays_the_default_and_unchanged():
    default = parse_spec(_raw(mode=None))
    assert default.inference_perf.multi_turn_mode == "closed-loop"
    explicit = parse_spec(_raw(mode="closed-loop"))
    assert explicit == default
    assert "multi_turn_mode" not in spec_to_dict(default)["inference_perf"]      # written only when set
    assert spec_to_dict(parse_spec(_raw()))["inference_perf"]["multi_turn_mode"] == "open-loop"
    closed = expand_inference_perf(default)
    assert closed == expand_inference_perf(explicit)
    assert all(c.multi_turn is not None and c.multi_turn.single_session for c in closed.clients)
    assert closed.num_requests == sum(math.floor(r * d) for r, d in STAGES)
    with pytest.raises(ConfigError, match=r"^inference_perf\.shared_prefix\.enable_multi_turn_chat: .*closed-loop"):
        generate_requests(_raw(mode=None))
    first = generate_workload(_raw(mode=None), sessions="first_round")
    assert len(first.sessions) == len(first.requests) == len(STAGES) * P * U


@pytest.mark.parametrize("mutate, message", [
    (lambda ip: ip.update(multi_turn_mode="open"),
     r"^inference_perf\.multi_turn_mode: 'open' is not one of closed-loop, open-loop"),
    (lambda ip: ip.update(multi_turn_mode=True), r"^inference_perf\.multi_turn_mode: "),
    (lambda ip: ip["shared_prefix"].update(multi_turn_mode="open-loop"),
     r"^inference_perf\.shared_prefix\.multi_turn_mode: unknown key"),
    (lambda ip: ip["shared_prefix"].update(enable_multi_turn_chat=False),
     r"^inference_perf\.multi_turn_mode: 'open-loop' applies to multi-turn chat only"),
])
def test_bad_multi_turn_mode_names_the_key(mutate, message):
    raw = _raw()
    mutate(raw["inference_perf"])
    with pytest.raises(ConfigError, match=message):
        parse_spec(raw)


# ------------------------------------------------------------------------------- fit


def _experiment(workload: dict) -> dict:
    return {"id": "x", "config": {"model": "meta-llama/Llama-3.1-8B-Instruct", "hardware": "H100", "tp": 1,
                                  "max_num_seqs": 32, "max_num_batched_tokens": 512, "total_kv_blocks": 4000,
                                  "workload": workload},
            "observed": {"ttft_mean_ms": 1.0, "e2e_mean_ms": 1.0}}


def test_fit_load_generator_rewrites_only_multi_turn_inference_perf():
    closed = _raw(mode=None)
    assert F.observed_workload(closed, "blis") is closed
    opened = F.observed_workload(closed, "open-loop")
    assert opened["inference_perf"]["multi_turn_mode"] == "open-loop"
    assert "multi_turn_mode" not in closed["inference_perf"]            # the input is not modified
    single = _raw(mode=None, multi_turn=False)
    assert F.observed_workload(single, "open-loop") is single
    clients = {"version": "2", "aggregate_rate": 1.0, "num_requests": 5, "clients": [{"id": "c"}]}
    assert F.observed_workload(clients, "open-loop") is clients
    with pytest.raises(ConfigError, match=r"^--load-generator 'closed': use one of blis, open-loop"):
        F.observed_workload(closed, "closed")
    assert fit_commands.LOAD_GENERATORS == F.LOAD_GENERATORS
    assert fit_commands.DEFAULTS["load_generator"] == "blis"


def test_fit_prepare_resolves_open_loop_experiments():
    theta, nb = F.start_vector(load_coefficients())
    obs = parse_observed({"experiments": [_experiment(_raw(mode=None, stages=((6.0, 20.0),)))]}).experiments
    (closed,) = F.prepare(obs, theta, nb)
    (opened,) = F.prepare(obs, theta, nb, load_generator="open-loop")
    closed, opened = closed.scenario, opened.scenario
    assert closed.sessions is not None and opened.sessions is None   # sessions only in BLIS's encoding
    assert len(closed.requests) == 120                             # every round, arrivals set by the engine
    assert abs(len(opened.requests) - 120) < 4 * math.sqrt(120)
    assert set(opened.requests.input_len) == {SYS + Q} and opened.requests.round_index.max() > 0


def test_fit_flag_parses_and_is_in_the_command_line():
    parser = build_parser()
    args = parser.parse_args(["fit", "--observed", "o.json"])
    assert args.load_generator == "blis"
    assert "--load-generator blis" in fit_commands._command_line(args)
    args = parser.parse_args(["fit", "--observed", "o.json", "--load-generator", "open-loop"])
    assert "--load-generator open-loop" in fit_commands._command_line(args)
    with pytest.raises(UsageError, match=r"--load-generator: invalid choice: 'closed'"):
        parser.parse_args(["fit", "--observed", "o.json", "--load-generator", "closed"])



# ------------------------------------------------------------------------------- fit: output lengths


def test_fit_observed_output_lengths_replace_the_configured_length():
    raw = _experiment(_raw(mode=None, stages=((6.0, 20.0),)))
    raw["observed"]["output_len_mean"] = 16.4
    (obs,) = parse_observed({"experiments": [raw]}).experiments
    assert obs.output_len_mean == 16.4
    assert F.simulated_output_len(obs, "configured") is None
    assert F.simulated_output_len(obs, "observed") == 16
    workload = F.observed_workload(obs.workload, "open-loop", 16)
    assert workload["inference_perf"]["shared_prefix"]["output_len"] == 16
    assert workload["inference_perf"]["multi_turn_mode"] == "open-loop"
    assert obs.workload["inference_perf"]["shared_prefix"]["output_len"] == OUT     # input not modified
    theta, nb = F.start_vector(load_coefficients())
    (configured,) = F.prepare([obs], theta, nb, load_generator="open-loop")
    (observed,) = F.prepare([obs], theta, nb, load_generator="open-loop", output_lengths="observed")
    configured, observed = configured.scenario.requests, observed.scenario.requests
    assert set(configured.output_len) == {OUT} and set(observed.output_len) == {16}
    np.testing.assert_array_equal(configured.arrival_us, observed.arrival_us)


def test_fit_observed_output_lengths_need_the_observed_mean():
    (obs,) = parse_observed({"experiments": [_experiment(_raw())]}).experiments
    assert obs.output_len_mean is None
    with pytest.raises(ConfigError, match=r"^--output-lengths observed: experiment x has no "
                                          r"observed.output_len_mean"):
        F.simulated_output_len(obs, "observed")
    with pytest.raises(ConfigError, match=r"^--output-lengths 'all': use one of configured, observed"):
        F.simulated_output_len(obs, "all")
    clients = {"version": "2", "aggregate_rate": 1.0, "num_requests": 5, "clients": [{"id": "c"}]}
    with pytest.raises(ConfigError, match=r"^--output-lengths observed: the workload has no "
                                          r"inference_perf.shared_prefix"):
        F.observed_workload(clients, "blis", 10)
    bad = _experiment(_raw())
    bad["observed"]["output_len_mean"] = -3
    with pytest.raises(ConfigError, match=r"experiments\[0\].observed.output_len_mean = -3 must be a finite "
                                          r"number > 0"):
        parse_observed({"experiments": [bad]})


def test_fit_output_lengths_flag():
    parser = build_parser()
    args = parser.parse_args(["fit", "--observed", "o.json"])
    assert args.output_lengths == "configured" == fit_commands.DEFAULTS["output_lengths"]
    assert fit_commands.OUTPUT_LENGTHS == F.OUTPUT_LENGTHS
    args = parser.parse_args(["fit", "--observed", "o.json", "--output-lengths", "observed"])
    assert "--output-lengths observed" in fit_commands._command_line(args)
