"""`blis-jax sensitivity` (blis_jax/fit/sensitivity.py): forward-mode derivatives of a run's
metrics on the fixed schedule, checked against central differences of whole re-simulations.

Every simulation here has one shape (Llama-3.1-8B, H100, trained-physics; ≤ 256 requests of
the same lengths; KV blocks and max-num-seqs chosen so that +5 % stays in their buckets), so
one compiled engine program serves the whole file.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest

from blis_jax.cli import main
from blis_jax.errors import ConfigError
from blis_jax.fit import sensitivity as S
from blis_jax.scenario import Deployment, EngineSettings, ScenarioConfig, SpecWorkload, SyntheticWorkload, resolve
from blis_jax.workload.distribution import OUTPUT_DEFAULT, PROMPT_DEFAULT, GaussianLength

SHAPE = ["--prompt-tokens", "512", "--prompt-tokens-stdev", "256", "--output-tokens", "64",
         "--output-tokens-stdev", "32", "--total-kv-blocks", "3800", "--max-num-seqs", "60"]
# The whole-run step: 5 % of each β (α by whole µs, as the engine truncates α to µs). Each step
# time is truncated to µs too; 5 % moves the metrics by far more than that noise (measured: the
# same agreement at 3 % and 10 % in the smooth case).
STEP = 0.05
COEFFS = ("alpha0", "alpha1", "alpha2", "beta0", "beta2", "beta4", "beta6", "beta9")   # b1a, b3, b5, b7, b2b


def _config(num_requests: int, rate: float, **deployment) -> ScenarioConfig:
    """The scenario of `blis-jax sensitivity` with SHAPE's flags, --num-requests and --rate."""
    return ScenarioConfig(
        deployment=Deployment(total_kv_blocks=3800, **deployment), engine=EngineSettings(max_num_seqs=60),
        workload=SyntheticWorkload(
            rate=rate, num_requests=num_requests,
            prompt=GaussianLength(mean=512.0, std=256.0, min=PROMPT_DEFAULT.min, max=PROMPT_DEFAULT.max),
            output=GaussianLength(mean=64.0, std=32.0, min=OUTPUT_DEFAULT.min, max=OUTPUT_DEFAULT.max)))


def _resolve(num_requests: int, rate: float, **deployment):
    return resolve(_config(num_requests, rate, **deployment))


@pytest.fixture(scope="module")
def smooth():
    """200 requests at 0.8 req/s: every request arrives at an idle instance (its E2E is
    ~0.47 s), so there is no queueing and the schedule barely moves with the coefficients."""
    run = _resolve(200, 0.8)
    base = S.simulate(run)
    table = S.sensitivities(run, S.METRICS, COEFFS, check=True, step=STEP, base=base)
    return base, table


# The smooth run checks (31 s, with whole-run central differences for every coefficient) are
# `-m slow`; the default suite keeps forward mode against whole runs for the first-token lag.
@pytest.mark.slow
def test_fixed_schedule_model_reproduces_the_run(smooth):
    base, table = smooth
    assert base.metrics["completed_requests"] == 200
    # no metric differs from the simulated one at the simulated θ (a note on tied order
    # statistics of a percentile is only about which one-sided derivative is reported)
    assert [n for n in table.notes if "share the simulated value" not in n] == []
    assert table.metric_values["ttft_mean"] == base.metrics["ttft_mean_ms"]
    # each α enters linearly (ms per µs): α0 once per TTFT, α1 once per E2E, α2 once per ITL sample
    expected = {("ttft_mean", "alpha0"): 1e-3, ("ttft_mean", "alpha1"): 0.0, ("e2e_mean", "alpha0"): 1e-3,
                ("e2e_mean", "alpha1"): 1e-3, ("itl_mean", "alpha0"): 0.0, ("itl_mean", "alpha2"): 1e-3}
    for (metric, name), value in expected.items():
        assert table.entry(metric, name).derivative == pytest.approx(value, abs=1e-15), (metric, name)
    e2e = table.entry("e2e_mean", "alpha2")       # once for the first token and once per ITL sample
    assert e2e.derivative == pytest.approx(1e-3 * (1 + base.out.num_itl[base.out.completed_mask()].mean()))


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["ttft_mean", "e2e_mean", "itl_mean"])
def test_means_match_whole_run_differences_in_the_smooth_case(smooth, metric):
    # measured largest relative difference: TTFT 0.10 % (b7), E2E 0.06 % (b2b), ITL 0.06 % (b2b)
    _, table = smooth
    for name in COEFFS:
        e = table.entry(metric, name)
        assert e.method == S.METHOD_FORWARD_MODE and e.check_method == S.METHOD_CENTRAL
        if e.derivative == 0.0:   # e.g. α0 on ITL; decode KV (b2b) on TTFT: no prefill shares a step here
            assert e.check == 0.0, (metric, name)
            continue
        assert e.rel_diff < 0.05, (metric, name, e.derivative, e.check)


def test_first_token_lag_derivative_matches_whole_runs():
    # blis-jax's α₃ (first-token lag 0.5 steps): TTFT and E2E move by the mean first-token step
    # per unit, ITL not at all; whole-run central differences agree (the schedule does not move)
    from blis_jax.config import load_coefficients

    iter29 = load_coefficients()
    run = _resolve(200, 0.8, alpha=(*iter29.alpha, 0.5), beta=tuple(iter29.beta))
    table = S.sensitivities(run, ("ttft_mean", "e2e_mean", "itl_mean"), ("alpha3",), check=True, step=STEP)
    ttft, e2e, itl = (table.entry(m, "alpha3") for m in ("ttft_mean", "e2e_mean", "itl_mean"))
    assert ttft.check_method == S.METHOD_CENTRAL and ttft.derivative > 1.0   # ms per unit: about a step
    assert ttft.rel_diff < 0.01 and e2e.rel_diff < 0.01
    assert e2e.derivative == pytest.approx(ttft.derivative, rel=1e-12)
    assert itl.derivative == 0.0 and itl.check == 0.0


@pytest.mark.slow  # more whole-run differences; `pytest -m slow`
@pytest.mark.parametrize("metric", [
    # With BLIS's Go-stream workload (this stop) the b3 derivative of p99 TTFT is 4.17 forward-mode
    # against 5.84 by whole-run central difference (29 %): not yet explained (the README's
    # sawtooth of a TTFT whose request finds a step in progress is the first suspect).
    pytest.param("ttft_p99", marks=pytest.mark.xfail(strict=True, reason="b3: forward-mode 4.17 vs whole-run 5.84 "
                                                                          "on the Go-stream workload; unexplained")),
    "e2e_p99", "throughput"])
def test_single_sample_metrics_match_for_the_leading_coefficients(smooth, metric):
    # p99 and the end of the run hang on one or two requests; checked for α0, α2, b3
    _, table = smooth
    for name in ("alpha0", "alpha2", "beta2"):
        e = table.entry(metric, name)
        if e.derivative == 0.0:
            assert e.check == 0.0
        else:
            assert e.rel_diff < 0.05, (metric, name, e.derivative, e.check)


@pytest.mark.slow  # more whole-run differences; `pytest -m slow`
def test_e2e_and_itl_under_overlap(smooth):
    # 1.5 req/s: 16 % of the arrivals find a step in progress. E2E and ITL still follow the
    # fixed-schedule derivative (measured ≤ 1.1 % for these); TTFT of those arrivals does not
    # (a changed coefficient also moves which arrivals wait), see the module docstring.
    run = _resolve(200, 1.5)
    # beta9 (b2b) left out: its elasticity here is 0.006, so the whole-run difference is dominated
    # by µs truncation (5.1 % off on this stop's Go-stream workload, ≤ 1.1 % on the earlier one)
    wrt = ("alpha2", "beta2", "beta4")
    table = S.sensitivities(run, ("e2e_mean", "itl_mean"), wrt, check=True, step=STEP)
    for e in table.entries:
        assert e.rel_diff < 0.05, (e.metric, e.input, e.derivative, e.check)


def test_percentile_weights_follow_blis_interpolation():
    v = np.array([5.0, 1.0, 4.0, 2.0, 3.0])
    idx, w, tied = S._percentile_weights(v, 90.0)     # rank 3.6 between 4 and 5
    assert float(w @ v[idx]) == pytest.approx(4.6) and tied == 0
    _, _, tied = S._percentile_weights(np.array([1.0, 2.0, 2.0, 2.0]), 50.0)
    assert tied == 3


def test_metric_and_input_names():
    assert S.parse_metrics("ttft_mean,E2E_P99_ms,throughput") == ("ttft_mean", "e2e_p99", "throughput")
    assert S.parse_wrt("alpha,b3,rate,max-num-seqs,kv-blocks", 11) == (
        "alpha0", "alpha1", "alpha2", "beta2", "rate", "max_num_seqs", "total_kv_blocks")
    assert S.parse_wrt("alpha3", 11) == ("alpha3",)   # blis-jax's first-token lag: by name
    assert len(S.parse_wrt(None, 10)) == 13
    for text, message in (("ttft_mean,foo", r"--metrics: unknown metric 'foo'"),
                          ("itl_p99", r"ITL percentiles are not offered"),
                          ("e2e_mean,e2e_mean_ms", r"e2e_mean is listed twice")):
        with pytest.raises(ConfigError, match=message):
            S.parse_metrics(text)
    for text, message in (("b99", r"--wrt: unknown input 'b99'.*or a setting: rate"),
                          ("alpha4", r"--wrt: unknown input 'alpha4'"),
                          ("alpha,alpha0", r"alpha0 is listed twice"),
                          ("bEP", r"'bEP' is beta slot 10, but the latency model has 10 betas")):
        with pytest.raises(ConfigError, match=message):
            S.parse_wrt(text, 10)


def test_settings_are_varied_by_resolving_the_config_again():
    # no simulation: the varied scenarios as `blis-jax run` would resolve the changed flags
    config = _config(20, 0.8)
    base = resolve(config)
    assert S.base_settings(base) == {"total_kv_blocks": 3800, "max_num_seqs": 60, "max_num_batched_tokens": 2048,
                                     "rate": 0.8}
    vary = S.vary_config(config)
    faster = vary("rate", 1.6)
    assert faster.config.workload.rate == 1.6 and len(faster.requests) == 20
    assert np.diff(faster.requests.arrival_us).mean() == pytest.approx(np.diff(base.requests.arrival_us).mean() / 2,
                                                                       rel=1e-5)
    assert (vary("max_num_seqs", 63).max_num_seqs, vary("total_kv_blocks", 3990).total_kv_blocks) == (63, 3990)
    assert int(S.vary_params(base)("max_num_batched_tokens", 2150).params.max_num_batched_tokens) == 2150
    with pytest.raises(ConfigError, match=r"--wrt rate: the workload has no workload\.rate to vary"):
        S.vary_config(config.replace(workload=SpecWorkload(spec={"version": "2"})))("rate", 1.0)


# ------------------------------------------------------------------ the CLI


def _run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_writes_the_table_and_json(tmp_path):
    output, metrics = tmp_path / "sens.json", tmp_path / "metrics.json"
    code, out, err = _run_cli(["sensitivity", *SHAPE, "--num-requests", "130", "--rate", "1",
                               "--wrt", "alpha0,b3,rate,max-num-seqs", "--check", "--output", str(output),
                               "--metrics-path", str(metrics)])
    assert code == 0, err
    base = json.loads(metrics.read_text())           # the base run's metrics, as `run` writes them
    assert base["completed_requests"] == 130
    assert re.search(r"^ttft_mean \(ms\) +[\d.]+ +alpha0 ", out, re.M)
    assert "one-sided FD (+3)" in out and "central FD" in out and "rel diff" in out
    doc = json.loads(output.read_text())
    assert set(doc) == {"scenario", "metrics", "inputs", "fd_step", "checked", "sensitivities", "notes"}
    assert list(doc["metrics"]) == list(S.DEFAULT_METRICS)
    assert list(doc["inputs"]) == ["alpha0", "beta2", "rate", "max_num_seqs"]
    assert doc["scenario"]["requests"] == 130 and doc["checked"] is True
    assert doc["metrics"]["ttft_mean"]["value"] == base["ttft_mean_ms"]
    assert len(doc["sensitivities"]) == len(S.DEFAULT_METRICS) * 4
    entry = doc["sensitivities"][0]
    assert set(entry) == {"metric", "input", "derivative", "elasticity", "method", "step", "check"}
    assert (entry["metric"], entry["input"], entry["method"]) == ("ttft_mean", "alpha0", S.METHOD_FORWARD_MODE)
    assert set(entry["check"]) == {"derivative", "step", "method", "rel_diff"}
    rate = next(e for e in doc["sensitivities"] if e["input"] == "rate" and e["metric"] == "throughput")
    # tokens/s grows with the rate of a stable instance about one for one (elasticity ~1)
    assert rate["method"] == S.METHOD_CENTRAL and "check" not in rate and 0.8 < rate["elasticity"] < 1.2
    seqs = next(e for e in doc["sensitivities"] if e["input"] == "max_num_seqs")
    assert seqs["method"] == S.METHOD_ONE_SIDED and seqs["step"] == 3.0


@pytest.mark.parametrize("extra, message", [
    (["--metrics", "ttft_mean,bogus"], r"--metrics: unknown metric 'bogus'"),
    (["--wrt", "beta99"], r"--wrt: unknown input 'beta99'"),
    (["--fd-step", "2"], r"--fd-step 2: must be a fraction in \(0, 1\)"),
    (["--num-instances", "2"], r"--num-instances 2"),
    (["--latency-model", "roofline"], r"--wrt: coefficients \(alpha0, alpha1, alpha2\) can be differentiated "
                                      r"for trained-physics with 10 or 11 betas only"),
])
def test_cli_errors_name_the_flag(extra, message):
    code, out, err = _run_cli(["sensitivity", "--num-requests", "5", *extra])
    assert (code, out) == (2, "")
    assert err.startswith("blis-jax sensitivity: error: ") and err.count("\n") == 1
    assert re.search(message, err), err
