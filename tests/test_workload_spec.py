"""Workload spec v2: loading, validation, rate allocation, generation, inference-perf, convert
and compose (spec §1.5, §4.3–4.11, §4.14), checked against the blis-diff workload cases.

The generator now reproduces BLIS's traces row for row (test_go_generation.py); the
statistical comparisons here (per-client counts within 4σ of the expected share, length means
within max(10 %, 4 SE), two-sample KS) date from the keyed generator and still hold.
Everything RNG-independent (labels, prefix groups, constant lengths, counts of exact-count
samplers) is compared exactly.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from blis_jax.errors import ConfigError
from blis_jax.workload.convert import (
    compose,
    convert_inference_perf,
    convert_preset,
    dump_spec,
)
from blis_jax.workload.generate import (
    SESSION_DEFAULT_TIMEOUT_US,
    allocate_rates,
    expand_cohorts,
    generate_requests,
    generate_workload,
    resolve_clients,
)
from blis_jax.workload.inference_perf import expand_inference_perf
from blis_jax.workload.presets import generate_preset
from blis_jax.workload.spec import (
    ClientSpec,
    LifecycleSpec,
    WindowSpec,
    load_spec,
    load_yaml,
    parse_spec,
    spec_to_dict,
)
from blis_jax.workload.tracev2 import (
    TraceHeader,
    format_records,
    read_columns,
    requests_from_columns,
)

from shared_data import BLIS_DIFF, REFERENCE  # noqa: E402
from shared_data import needs_blis_diff as needs_reference  # noqa: E402
SPEC_CASES = ("C01", "C03", "C05", "C06", "D03", "D08", "E03")
OPEN_LOOP_CASES = ("C01", "C03", "D03", "D08", "E03")

G = {"type": "gaussian", "params": {"mean": 200, "std_dev": 50, "min": 10, "max": 400}}
E = {"type": "exponential", "params": {"mean": 100}}


def _case(prefix: str) -> Path:
    return next(p for p in BLIS_DIFF.iterdir() if p.name.startswith(prefix + "_"))


def _trace(case: Path) -> list[dict[str, str]]:
    with open(case / "trace.csv", newline="") as f:
        return list(csv.DictReader(f))


def _client(**kw) -> dict:
    base = {"id": "c", "rate_fraction": 1.0, "arrival": {"process": "poisson"},
            "input_distribution": G, "output_distribution": E}
    base.update(kw)
    return copy.deepcopy(base)


def _spec(*clients, **top) -> dict:
    out = {"version": "2", "seed": 11, "aggregate_rate": 20.0, "num_requests": 500, "clients": list(clients)}
    out.update(top)
    return out


# ---------------------------------------------------------------------- blis-diff specs


@needs_reference
@pytest.mark.parametrize("prefix", SPEC_CASES)
def test_reference_specs_load_and_round_trip(prefix):
    spec = load_spec(_case(prefix) / "workload.yaml")
    assert parse_spec(spec_to_dict(spec)) == spec
    assert parse_spec(load_yaml(dump_spec(spec))) == spec


@needs_reference
@pytest.mark.parametrize("prefix", OPEN_LOOP_CASES)
def test_generation_matches_reference_trace_statistically(prefix):
    case = _case(prefix)
    spec = load_spec(case / "workload.yaml")
    rows = _trace(case)
    requests = generate_requests(spec)
    n = spec.num_requests
    assert len(requests) == len(rows) == n
    assert (np.diff(requests.arrival_us) >= 0).all() and requests.request_id.tolist() == list(range(n))
    assert (requests.deadline_us == 0).all()       # no client timeout set: none, like the trace
    # The merged stream runs at the aggregate rate: N arrivals take ≈ N / rate seconds.
    duration = n / spec.aggregate_rate * 1e6
    for last in (requests.arrival_us[-1], max(int(r["arrival_time_us"]) for r in rows)):
        assert abs(last - duration) < 0.15 * duration
    total_f = sum(c.rate_fraction for c in spec.clients)
    for client in spec.clients:
        mine = requests.client_id == client.id
        theirs = [r for r in rows if r["client_id"] == client.id]
        share = client.rate_fraction / total_f
        burst = max(1.0, client.arrival.cv or 1.0) if client.arrival.process != "constant" else 1.0
        sigma = burst * math.sqrt(n * share * (1 - share))
        for count in (int(mine.sum()), len(theirs)):
            assert abs(count - n * share) < 4 * sigma, (client.id, count, n * share)
        # Labels and prefixes are exact.
        assert set(requests.tenant_id[mine]) == {r["tenant_id"] for r in theirs} == {client.tenant_id}
        assert set(requests.slo_class[mine]) == {r["slo_class"] for r in theirs}
        assert set(requests.prefix_len[mine]) == {int(r["prefix_length"]) for r in theirs}
        group = {requests.prefix_group_names[g] if g >= 0 else "" for g in requests.prefix_group[mine]}
        assert group == {r["prefix_group"] for r in theirs}
        # Lengths: means within max(10 %, 4 SE of the difference), and a two-sample KS test.
        for ours, column in ((requests.input_len[mine], "input_tokens"), (requests.output_len[mine], "output_tokens")):
            ref = np.array([int(r[column]) + (int(r["prefix_length"]) if column == "input_tokens" else 0)
                            for r in theirs])
            se = math.sqrt(ours.var() / len(ours) + ref.var() / len(ref))
            assert abs(ours.mean() - ref.mean()) < max(0.10 * ref.mean(), 4 * se), (client.id, column)
            assert stats.ks_2samp(ours, ref).pvalue > 1e-3, (client.id, column)


@needs_reference
def test_c05_inference_perf_expansion_matches_trace():
    case = _case("C05")
    spec = load_spec(case / "workload.yaml")
    rows = _trace(case)
    expanded = expand_inference_perf(spec)
    assert expanded.aggregate_rate == 17.0 and expanded.num_requests == 780     # 5·60 + 12·40
    assert {c.id for c in expanded.clients} == {r["client_id"] for r in rows}   # 2 stages × 4 × 5
    requests = generate_requests(spec)
    # Multi-stage clients are Poisson at exactly stage_rate/(P·U), so the count is random around
    # Σ⌊rate·duration⌋ = 780 (the reference drew 758) and capped at num_requests.
    for count in (len(requests), len(rows)):
        assert 780 - 4 * math.sqrt(780) < count <= 780
    # Constant lengths and prefixes: identical to the trace row for row.
    assert set(requests.input_len) == {int(r["input_tokens"]) + int(r["prefix_length"]) for r in rows} == {700}
    assert set(requests.output_len) == {int(r["output_tokens"]) for r in rows} == {150}
    assert set(requests.prefix_len) == {400}
    assert set(requests.slo_class) == {"standard"} and (requests.deadline_us == 0).all()
    names = np.array(requests.prefix_group_names)[requests.prefix_group]
    np.testing.assert_array_equal(names, requests.tenant_id)
    # Each stage's clients arrive inside the stage, at the stage's rate.
    for stage, (lo, hi, rate) in enumerate(((0, 60e6, 5.0), (60e6, 100e6, 12.0))):
        mine = np.char.startswith(requests.client_id.astype(str), f"stage-{stage}-")
        theirs = np.array([int(r["arrival_time_us"]) for r in rows if r["client_id"].startswith(f"stage-{stage}-")])
        for t in (requests.arrival_us[mine], theirs):
            assert t.min() >= lo and t.max() < hi
            expected = rate * (hi - lo) / 1e6
            assert abs(len(t) - expected) < 4 * math.sqrt(expected)


def test_single_stage_inference_perf_has_exact_counts():
    raw = {"version": "2", "seed": 3, "inference_perf": {
        "stages": [{"rate": 7.5, "duration": 40}],
        "shared_prefix": {"num_unique_system_prompts": 3, "num_users_per_system_prompt": 4,
                          "system_prompt_len": 64, "question_len": 100, "output_len": 20}}}
    requests = generate_requests(raw)
    assert len(requests) == 300                          # ⌊7.5 · 40⌋ exactly
    counts = sorted(np.unique(requests.client_id, return_counts=True)[1].tolist())
    assert counts == [25] * 12                          # even split
    # normalized exponential spans the stage; BLIS truncates each interval (blis-rng §3.3)
    assert 40_000_000 - 25 <= requests.arrival_us.max() <= 40_000_000
    assert set(requests.input_len) == {164} and set(requests.output_len) == {20}
    spec = convert_inference_perf(raw)
    assert "inference_perf" not in spec and len(spec["clients"]) == 12
    # The YAML cannot carry BLIS's normalized-exponential factory, so the converted spec runs
    # per-window generation instead (as BLIS's convert output does, blis-rng §8): 25 IATs per
    # client rescaled to the stage, the last (on the stage end) never emitted.
    again = generate_requests(spec)
    assert len(again) == 12 * 24 and again.arrival_us.max() < 40_000_000


@needs_reference
def test_c06_multi_turn_is_parsed_but_closed_loop_generation_is_refused():
    case = _case("C06")
    spec = load_spec(case / "workload.yaml")
    with pytest.raises(ConfigError, match=r"^inference_perf\.shared_prefix\.enable_multi_turn_chat: .*not implemented"):
        generate_requests(spec)
    rows = _trace(case)
    w = generate_workload(spec, sessions="first_round")
    first = [r for r in rows if r["round_index"] == "0"]
    assert len(w.requests) == len(first) == 20 and len(w.sessions) == 20
    assert sum(p.max_rounds for p in w.sessions) == len(rows) == 600
    assert {p.think_time_us for p in w.sessions} == {3_333_333}          # ⌊20/6 s⌋
    assert {r["client_id"] for r in first} == set(w.requests.client_id)
    fresh = w.requests.input_len - w.requests.prefix_len
    assert set(fresh) == {int(r["input_tokens"]) for r in first} == {350}
    assert set(w.requests.prefix_len) == {int(r["prefix_length"]) for r in first} == {256}
    assert set(w.requests.output_len) == {180}
    np.testing.assert_array_equal(w.requests.deadline_us, w.requests.arrival_us + SESSION_DEFAULT_TIMEOUT_US)
    assert set(w.requests.trace_columns["reason_ratio"]) == {r["reason_ratio"] for r in first} == {"0.01"}
    assert len(set(w.requests.session_id)) == 20 and (w.requests.round_index == 0).all()
    # BLIS's blueprint order: client by client (session ids as strings), not row order
    assert sorted(p.request_id for p in w.sessions) == list(range(20))


@needs_reference
def test_golden_experiment_request_and_token_totals():
    # latency-models §5.2/5.3: completed requests and token totals are RNG-independent.
    data = json.loads((REFERENCE / "blis" / "testdata" / "trained_physics_iter29.json").read_text())
    for exp in data["experiments"]:
        spec = expand_inference_perf(parse_spec(exp["workload"]))
        sp = exp["workload"]["inference_perf"]["shared_prefix"]
        rounds = sum(c.multi_turn.max_rounds for c in spec.clients)
        assert rounds == exp["expected"]["completed_requests"] == spec.num_requests
        assert rounds * (sp["system_prompt_len"] + sp["question_len"]) == exp["expected"]["total_input_tokens"]
        assert rounds * sp["output_len"] == exp["expected"]["total_output_tokens"]


# ---------------------------------------------------------------------- rate allocation


def test_per_phase_normalization_keeps_each_phase_at_the_aggregate_rate():
    phase = 100_000_000
    raw = _spec(_client(id="a1", rate_fraction=0.2, lifecycle={"windows": [{"start_us": 0, "end_us": phase}]}),
                _client(id="a2", rate_fraction=0.1, arrival={"process": "gamma", "cv": 2.0},
                        lifecycle={"windows": [{"start_us": 0, "end_us": phase}]}),
                _client(id="b", rate_fraction=0.7, arrival={"process": "weibull", "cv": 0.5},
                        lifecycle={"windows": [{"start_us": phase, "end_us": 2 * phase}]}),
                aggregate_rate=50.0, num_requests=0)
    requests = generate_requests(raw)
    for lo in (0, phase):
        in_phase = (requests.arrival_us >= lo) & (requests.arrival_us < lo + phase)
        expected = 50.0 * phase / 1e6
        assert abs(in_phase.sum() - expected) < 4 * 2 * math.sqrt(expected)   # ×2: a2 is bursty
    # Inside phase 1 the mix is 2:1 (each f over the co-active Σf = 0.3).
    a1, a2 = (requests.client_id == "a1").sum(), (requests.client_id == "a2").sum()
    assert abs(a1 / (a1 + a2) - 2 / 3) < 0.05
    assert requests.arrival_us.max() < 2 * phase   # generation stops at the last window end


def test_allocate_rates_overlap_rules():
    def c(f, *windows):
        return ClientSpec(id="x", rate_fraction=f,
                          lifecycle=LifecycleSpec(tuple(WindowSpec(*w) for w in windows)) if windows else None)
    # No lifecycle anywhere: plain normalization.
    assert allocate_rates(10, [c(1), c(3)]).tolist() == [2.5, 7.5]
    # A [0,10), B [10,20) touch but do not overlap; C is always on and overlaps both.
    rates = allocate_rates(12, [c(1, (0, 10)), c(1, (10, 20)), c(2)])
    assert rates.tolist() == pytest.approx([12 * 1 / 3, 12 * 1 / 3, 12 * 2 / 4])
    # Multi-window clients are co-active if any window overlaps.
    rates = allocate_rates(6, [c(1, (0, 10), (30, 40)), c(2, (35, 50)), c(3, (12, 20))])
    assert rates.tolist() == pytest.approx([6 / 3, 6 * 2 / 3, 6.0])


def test_per_window_generation_uses_trace_rate_and_window_overrides():
    windows = [{"start_us": 0, "end_us": 10_000_000, "trace_rate": 4.0},
               {"start_us": 20_000_000, "end_us": 30_000_000, "trace_rate": 2.5, "arrival": {"process": "constant"},
                "input_distribution": {"type": "constant", "params": {"value": 7}}}]
    raw = _spec(_client(id="w", lifecycle={"windows": windows}), aggregate_rate=0.0, num_requests=0)
    requests = generate_requests(raw)
    first, second = requests.arrival_us <= 10_000_000, requests.arrival_us >= 20_000_000
    # ⌈rate·duration⌉ IATs rescaled to the window; the last lands on its end and BLIS never
    # emits it (blis-rng §5.6)
    assert first.sum() == 39 and second.sum() == 24 and len(requests) == 63
    assert (requests.input_len[second] == 7).all() and (requests.input_len[first] != 7).any()
    t = requests.arrival_us[second]
    assert t[-1] < 30_000_000 and np.ptp(np.diff(t)) <= 1                       # constant, rescaled


# --------------------------------------------------------------------------- features


def test_prefix_groups_take_the_first_clients_length():
    raw = _spec(_client(id="a", prefix_group="sys", prefix_length=300, rate_fraction=0.5),
                _client(id="b", prefix_group="sys", prefix_length=999, rate_fraction=0.25),
                _client(id="c", prefix_group="other", rate_fraction=0.25))
    r = generate_requests(raw)
    names = np.array(r.prefix_group_names)[r.prefix_group]
    assert set(r.prefix_len[names == "sys"]) == {300} and set(r.prefix_len[names == "other"]) == {50}
    assert (r.input_len - r.prefix_len >= 10).all()


def test_timeouts_horizon_and_overrides():
    raw = _spec(_client(id="t", timeout=2_000_000, slo_target_us=5000, streaming=True), horizon=5_000_000,
                num_requests=0)
    r = generate_requests(raw)
    assert r.arrival_us.max() <= 5_000_000 and abs(len(r) - 100) < 40
    np.testing.assert_array_equal(r.deadline_us, r.arrival_us + 2_000_000)
    assert set(r.trace_columns["slo_target_us"]) == {"5000"} and set(r.trace_columns["streaming"]) == {"true"}
    r2 = generate_requests(raw, num_requests=30, timeout_s=-1, horizon_us=10**9)
    assert len(r2) == 30 and (r2.deadline_us == 0).all()
    with pytest.raises(ConfigError, match=r"^num_requests: 0 and no horizon"):
        generate_requests(_spec(_client(), num_requests=0))


def test_cohorts_expand_with_diurnal_spike_and_drain():
    hour = 3_600_000_000
    raw = _spec(aggregate_rate=10.0, num_requests=0, horizon=3 * hour, clients=[], cohorts=[
        {"id": "day", "population": 4, "rate_fraction": 1.0, "diurnal": {"peak_hour": 1, "peak_to_trough_ratio": 4},
         "prefix_group": "g", "prefix_sharing": "per_member", "input_distribution": G, "output_distribution": E},
        {"id": "burst", "population": 2, "spike": {"start_time_us": 60_000_000, "duration_us": 10_000_000,
                                                   "trace_rate": 30}, "input_distribution": G, "output_distribution": E},
        {"id": "end", "population": 1, "rate_fraction": 0.5, "drain": {"start_time_us": hour,
                                                                       "ramp_duration_us": 1_000_000_000},
         "input_distribution": G, "output_distribution": E}])
    spec = parse_spec(raw)
    members = expand_cohorts(spec)
    assert [c.id for _, c in members] == ["day-0", "day-1", "day-2", "day-3", "burst-0", "burst-1", "end-0"]
    day = members[0][1].lifecycle.windows
    assert len(day) == 24 and day[1].end_us - day[1].start_us == hour                     # peak hour fully on
    assert day[13].end_us - day[13].start_us == pytest.approx(hour / 4, abs=1)           # trough: 1/R
    assert {members[j][1].prefix_group for j in range(4)} == {"g-0", "g-1", "g-2", "g-3"}
    assert members[0][1].rate_fraction == 0.25
    drain = members[6][1].lifecycle.windows
    assert drain[0].end_us == hour and len(drain) == 11
    assert [w.end_us - w.start_us for w in drain[1:]] == [round(1e8 * (1 - k / 10)) for k in range(10)]
    r = generate_requests(raw)
    spike = np.char.startswith(r.client_id.astype(str), "burst")
    # aggregate_rate > 0: a spike window runs at 10·15/Σ (Σ = 4·0.25 + 2·15 + 0.5 over the windows
    # overlapping it), ⌈4.76·10⌉ = 48 IATs per member of which 47 are emitted (blis-rng §5.6)
    assert spike.sum() == 94
    assert r.arrival_us[spike].min() >= 60_000_000 and r.arrival_us[spike].max() <= 70_000_000
    end = r.client_id == "end-0"
    assert r.arrival_us[end].max() < hour + 1_000_000_000


def test_open_loop_sessions_pre_generate_every_round():
    mt = {"max_rounds": 4, "think_time_us": 50_000, "context_growth": "accumulate"}
    raw = _spec(_client(id="chat", prefix_group="sys", prefix_length=100, closed_loop=False,
                        reasoning={"multi_turn": mt,
                                   "reason_ratio_distribution": {"type": "constant", "params": {"value": 30}}}),
                aggregate_rate=1.0, num_requests=40)
    r = generate_requests(raw)
    assert len(r) == 40
    for sid in np.unique(r.session_id)[:5]:
        rows = np.flatnonzero(r.session_id == sid)
        rounds = r.round_index[rows]
        if len(rows) < 4:      # a session cut by num_requests keeps its earliest rounds
            assert rounds.tolist() == list(range(len(rows)))
            continue
        assert rounds.tolist() == [0, 1, 2, 3]
        arr, out, inp = r.arrival_us[rows], r.output_len[rows], r.input_len[rows]
        for k in range(1, 4):
            assert arr[k] == arr[0] + k * 50_000 + out[:k].sum()
            # accumulate: prefix + Σ previous (fresh input + output) + fresh input
            assert inp[k] > inp[k - 1] + out[k - 1]
        np.testing.assert_array_equal(r.deadline_us[rows], arr + SESSION_DEFAULT_TIMEOUT_US)
    assert set(r.trace_columns["reason_ratio"]) == {"0.3"}
    single = generate_requests(_spec(_client(closed_loop=False, reasoning={
        "multi_turn": {"max_rounds": 3, "single_session": True}}), num_requests=0))
    assert len(single) == 3 and len(set(single.session_id)) == 1


def test_closed_loop_clients_are_refused_or_planned():
    closed = _spec(_client(id="s", reasoning={"multi_turn": {"max_rounds": 5, "think_time_us": 1000}}))
    with pytest.raises(ConfigError, match=r"^clients\[0\]\.reasoning\.multi_turn: closed-loop sessions"):
        generate_requests(closed)
    w = generate_workload(closed, sessions="first_round", num_requests=20)
    # BLIS truncates to num_requests counting every round, then keeps round 0 (blis-rng §5.7, §6.1)
    assert len(w.requests) == 4 and len(w.sessions) == 4 and (w.requests.round_index == 0).all()
    assert {p.max_rounds for p in w.sessions} == {5} and sorted(p.request_id for p in w.sessions) == [0, 1, 2, 3]
    conc = _spec({"id": "users", "concurrency": 4, "think_time_us": 1000, "input_distribution": G,
                  "output_distribution": E}, aggregate_rate=0.0)
    with pytest.raises(ConfigError, match=r"^clients\[0\]\.concurrency: closed-loop users"):
        generate_requests(conc)
    w = generate_workload(conc, sessions="first_round")
    assert w.requests.arrival_us.tolist() == [0, 250, 500, 750]
    assert {p.max_rounds for p in w.sessions} == {0}


def test_multimodal_input_is_text_plus_parts(tmp_path):
    mm = {"text_distribution": {"type": "constant", "params": {"value": 40}},
          "image_distribution": {"type": "constant", "params": {"value": 500}},
          "image_count_distribution": {"type": "empirical", "params": {"0": 0.5, "2": 0.5}},
          "audio_distribution": {"type": "constant", "params": {"value": 7}}}
    r = generate_requests(_spec(_client(multimodal=mm, input_distribution=None), num_requests=200))
    images = r.trace_columns["image_tokens"].astype(int)
    # BLIS adds a modality only when both its count and its token distributions are set (§5.5)
    assert set(images) == {0, 1000} and set(r.trace_columns["audio_tokens"]) == {"0"}
    np.testing.assert_array_equal(r.input_len, 40 + images)


def test_empirical_file_is_read_relative_to_the_spec(tmp_path):
    (tmp_path / "pmf.json").write_text(json.dumps({"10": 1, "30": 3}))
    raw = _spec(_client(input_distribution={"type": "empirical", "file": "pmf.json"}))
    path = tmp_path / "w.yaml"
    path.write_text(dump_spec(raw))
    r = generate_requests(path)
    assert set(r.input_len) == {10, 30} and abs((r.input_len == 30).mean() - 0.75) < 0.08


def test_trace_round_trip_of_generated_requests(tmp_path):
    r = generate_requests(_spec(_client(id="a", prefix_group="p", prefix_length=64, streaming=True)))
    text = format_records(r)
    (tmp_path / "t.csv").write_text(text)
    back = requests_from_columns(read_columns(tmp_path / "t.csv"))
    for field in ("arrival_us", "input_len", "output_len", "prefix_len", "client_id"):
        np.testing.assert_array_equal(getattr(back, field), getattr(r, field))
    assert TraceHeader(workload_seed=11).workload_seed == 11


def test_v1_specs_are_upgraded():
    raw = _spec(_client(id="rt", slo_class="realtime", rate_fraction=0.5),
                _client(id="ia", slo_class="interactive", rate_fraction=0.5))
    del raw["version"]
    spec = parse_spec(raw)
    assert spec.version == "2" and [c.slo_class for c in spec.clients] == ["critical", "standard"]


# -------------------------------------------------------------------------- validation


@pytest.mark.parametrize("mutate, key", [
    (lambda s: s.update(colour="blue"), r"colour: unknown key"),
    (lambda s: s["clients"][1].update(arival={"process": "poisson"}), r"clients\[1\]\.arival: unknown key"),
    (lambda s: s["clients"][0]["input_distribution"]["params"].update(sd=1), r"clients\[0\]\.input_distribution\.params\.sd"),
    (lambda s: s["clients"][1].update(rate_fraction=-0.2), r"clients\[1\]\.rate_fraction: -0\.2 must be > 0"),
    (lambda s: s["clients"][2].update(arrival={"process": "weibull", "cv": 12}),
     r"clients\[2\]\.arrival\.cv: 12(\.0)? must be in \[0\.01, 10\.4\]"),
    (lambda s: s["clients"][0].update(lifecycle={"windows": [{"start_us": 10, "end_us": 10}]}),
     r"clients\[0\]\.lifecycle\.windows\[0\]\.end_us: 10 must be > start_us"),
    (lambda s: s["clients"][0].update(lifecycle={"windows": [{"start_us": 0, "end_us": 9},
                                                             {"start_us": 5, "end_us": 20}]}),
     r"clients\[0\]\.lifecycle\.windows\[1\]\.start_us"),
    (lambda s: [s["clients"][i].update(slo_class="critical") for i in (0, 2)], r"clients\[1\]\.slo_class: missing"),
    (lambda s: s["clients"][0].update(slo_class="urgent"), r"clients\[0\]\.slo_class: 'urgent'"),
    (lambda s: s["clients"][2].pop("rate_fraction"), r"clients\[2\]\.rate_fraction: missing"),
    (lambda s: s["clients"][0].pop("output_distribution"), r"clients\[0\]\.output_distribution: missing"),
    (lambda s: s["clients"][0].update(arrival={"process": "bursty"}), r"clients\[0\]\.arrival\.process: 'bursty'"),
    (lambda s: s["clients"][0].update(input_distribution={"type": "zipf"}), r"clients\[0\]\.input_distribution\.type"),
    (lambda s: s.update(aggregate_rate=0), r"clients\[0\]\.lifecycle: aggregate_rate is 0"),
    (lambda s: s.update(num_requests=-5), r"num_requests: -5 must be ≥ 0"),
    (lambda s: s.update(num_requests=2.5), r"num_requests: expected an integer"),
    (lambda s: s["clients"][0].update(streaming="yes"), r"clients\[0\]\.streaming: expected true or false"),
    (lambda s: s["clients"][0].update(concurrency=3), r"clients\[0\]\.rate_fraction: a concurrency client"),
    (lambda s: s["clients"][0].update(reasoning={"multi_turn": {"max_rounds": 0}}),
     r"clients\[0\]\.reasoning\.multi_turn\.max_rounds: 0 must be ≥ 1"),
    (lambda s: s["clients"][0].update(reasoning={"multi_turn": {"max_rounds": 2, "context_growth": "grow"}}),
     r"clients\[0\]\.reasoning\.multi_turn\.context_growth"),
    (lambda s: s.update(inference_perf={"stages": [], "shared_prefix": {}}), r"inference_perf\.stages: empty"),
    (lambda s: s.update(goodput_slo_targets={"critical": {"ttft": 1}}), r"goodput_slo_targets\.critical\.ttft: unknown"),
    (lambda s: s.update(cohorts=[{"id": "c", "population": 0}]), r"cohorts\[0\]\.population: 0 must be ≥ 1"),
    (lambda s: s.update(version="3"), r"version: '3' is not supported"),
])
def test_malformed_specs_raise_one_error_naming_the_key(mutate, key):
    raw = _spec(_client(id="a"), _client(id="b"), _client(id="c"))
    mutate(raw)
    with pytest.raises(ConfigError, match="^" + key):
        parse_spec(raw)


def test_yaml_level_errors(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("version: '2'\naggregate_rate: 1\naggregate_rate: 2\nclients: []\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'aggregate_rate'"):
        load_spec(path)
    with pytest.raises(ConfigError, match=r"cannot read"):
        load_spec(tmp_path / "missing.yaml")
    mix = _spec(_client(id="s", reasoning={"multi_turn": {"max_rounds": 2}}),
                {"id": "u", "concurrency": 2, "input_distribution": G, "output_distribution": E})
    with pytest.raises(ConfigError, match=r"^clients\[1\]\.concurrency: concurrency clients cannot be mixed"):
        parse_spec(mix)
    ip = {"version": "2", "clients": [_client()], "inference_perf": {
        "stages": [{"rate": 1, "duration": 1}], "shared_prefix": {
            "num_unique_system_prompts": 1, "num_users_per_system_prompt": 1, "system_prompt_len": 1,
            "question_len": 1, "output_len": 1}}}
    with pytest.raises(ConfigError, match=r"^clients: cannot be combined with inference_perf"):
        parse_spec(ip)


# ------------------------------------------------------------------------- determinism


def test_same_seed_is_byte_identical_and_seeds_differ():
    raw = _spec(_client(id="a", rate_fraction=0.6, arrival={"process": "gamma", "cv": 2.0}),
                _client(id="b", rate_fraction=0.4, arrival={"process": "weibull", "cv": 0.7},
                        input_distribution={"type": "lognormal", "params": {"mu": 5, "sigma": 1}}))
    a, b = generate_requests(raw), generate_requests(raw)
    c = generate_requests(raw, seed=12)
    for field in ("arrival_us", "input_len", "output_len", "deadline_us", "prefix_group", "priority"):
        assert getattr(a, field).tobytes() == getattr(b, field).tobytes()
    assert a.client_id.tolist() == b.client_id.tolist()
    for field in ("arrival_us", "input_len", "output_len"):
        assert getattr(a, field).tobytes() != getattr(c, field).tobytes()
    assert generate_requests(dict(raw, seed=12)).arrival_us.tobytes() == c.arrival_us.tobytes()
    # More requests do not change the earlier ones.
    longer = generate_requests(raw, num_requests=1500)
    for field in ("arrival_us", "input_len", "output_len", "client_id"):
        np.testing.assert_array_equal(getattr(longer, field)[:500], getattr(a, field))


# ----------------------------------------------------------------- convert and compose


def test_convert_preset_matches_the_preset_workload():
    spec = convert_preset("chatbot", rate=9, num_requests=600)
    assert spec["clients"][0]["arrival"] == {"process": "constant"}
    ours = generate_requests(spec)
    preset = generate_preset("chatbot", seed=42, rate=9, num_requests=600)
    np.testing.assert_array_equal(ours.arrival_us, preset.arrival_us)
    np.testing.assert_array_equal(ours.deadline_us, preset.deadline_us)
    assert ours.input_len.min() >= 2 and ours.input_len.max() <= 800
    assert abs(ours.input_len.mean() - preset.input_len.mean()) < 4 * 100 * math.sqrt(2 / 600)
    with pytest.raises(ConfigError, match=r"^--name: unknown preset"):
        convert_preset("chitchat")


@needs_reference
def test_compose_sums_rates_and_rescales_fractions():
    a, b = _case("C01") / "workload.yaml", _case("C03") / "workload.yaml"
    merged = compose([a, b])
    assert merged["aggregate_rate"] == 84.0 and merged["num_requests"] == 1500
    fractions = {c["id"]: c["rate_fraction"] for c in merged["clients"]}
    assert fractions["interactive"] == pytest.approx(0.3 * 44 / 84)
    assert fractions["assistant-a"] == pytest.approx(0.45 * 40 / 84)
    assert sum(fractions.values()) == pytest.approx(1.0)
    rates = {rc.spec.id: rc.rate for rc in resolve_clients(parse_spec(merged))}
    assert rates["chat"] == pytest.approx(0.5 * 44) and rates["unique"] == pytest.approx(0.25 * 40)
    assert merged["goodput_slo_targets"]["critical"] == {"ttft_ms": 200.0, "e2e_ms": 5000.0}
    # Fractions that do not sum to 1 keep their spec's rate too.
    odd = _spec(_client(id="x", rate_fraction=3.0), _client(id="y", rate_fraction=1.0), aggregate_rate=10.0)
    one = _spec(_client(id="z", rate_fraction=1.0), aggregate_rate=30.0)
    rates = {rc.spec.id: rc.rate for rc in resolve_clients(parse_spec(compose([odd, one])))}
    assert rates == pytest.approx({"x": 7.5, "y": 2.5, "z": 30.0})


def test_compose_absolute_rate_specs():
    window = {"windows": [{"start_us": 0, "end_us": 1_000_000, "trace_rate": 5.0}]}
    absolute = _spec(_client(id="w", lifecycle=window), aggregate_rate=0.0)
    merged = compose([absolute, dataclasses.replace(parse_spec(absolute))])
    assert "aggregate_rate" not in merged and [c["rate_fraction"] for c in merged["clients"]] == [1.0, 1.0]
    with pytest.raises(ConfigError, match=r"^compose: from\[0\] is an absolute-rate spec"):
        compose([absolute, _spec(_client())])
