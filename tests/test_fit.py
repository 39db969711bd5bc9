"""`blis-jax fit` (blis_jax/fit/): the observed file and BLIS's loss, the fixed-schedule
gradients, the inner optimizer, synthetic recovery through real simulations, and the CLI.

Every simulation here uses one small workload shape (120 requests, constant arrivals, the same
longest request) so that one compiled engine program serves the whole file.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_data import REFERENCE, needs

from blis_jax.cli import main
from blis_jax.config import load_coefficients
from blis_jax.engine.simulate import simulate_traced
from blis_jax.errors import ConfigError
from blis_jax.fit import fit as F
from blis_jax.fit.local import predict_latencies_local
from blis_jax.fit.observed import (
    load_observed,
    loss_terms,
    parse_observed,
    prediction_loss,
)
from blis_jax.fit.schedule import schedule_trace
from blis_jax.latency import with_coefficients
from blis_jax.scenario import Deployment, ScenarioConfig, resolve_deployment

OBSERVED = REFERENCE / "observed" / "trainval15.json"
needs_observed = needs(OBSERVED, "observed trainval15.json")

# ------------------------------------------------------------------ synthetic experiments


def _client(cid, fraction, prompt, output):
    return {"id": cid, "rate_fraction": fraction, "arrival": {"process": "constant"},
            "input_distribution": {"type": "constant", "params": {"value": prompt}},
            "output_distribution": {"type": "constant", "params": {"value": output}}}


def _experiment(exp_id, model, tp, seed, clients, ttft=1.0, e2e=1.0):
    workload = {"version": "2", "seed": seed, "aggregate_rate": 1.0, "num_requests": 120, "clients": clients}
    return {"id": exp_id, "config": {"model": model, "hardware": "H100", "tp": tp, "max_num_seqs": 32,
                                     "max_num_batched_tokens": 512, "total_kv_blocks": 4000, "workload": workload},
            "observed": {"ttft_mean_ms": ttft, "e2e_mean_ms": e2e}}


# Two experiments with different signatures: long prompts (TTFT carries α0 and prefill compute)
# on Yi-34B/TP2, and long outputs (E2E carries weight loading) on Llama-3.1-8B, where requests
# overlap and are batched. The 5 % long-prompt client gives both the same longest request.
SYNTHETIC = [
    _experiment("long-prompt", "01-ai/Yi-34B", 2, 5, [_client("p", 1.0, 1800, 40)]),
    _experiment("long-output", "meta-llama/Llama-3.1-8B-Instruct", 1, 6,
                [_client("o", 0.95, 200, 200), _client("p", 0.05, 1800, 40)]),
]
FREE = ("alpha0", "b1a", "b3")
TRUE_FACTORS = (1.1, 2.5, 0.9)   # b1a × 2.5 makes prefill compute a visible share of TTFT


@pytest.fixture(scope="module")
def start():
    theta, num_betas = F.start_vector(load_coefficients())
    return theta, num_betas


@pytest.fixture(scope="module")
def truth(start):
    theta, num_betas = start
    free = F.parse_params(",".join(FREE), theta, num_betas)
    true = theta.copy()
    true[free] *= TRUE_FACTORS
    return true, free


@pytest.fixture(scope="module")
def synthetic(start, truth):
    """(prepared experiments with observed = simulated means at the true coefficients, data dict)."""
    theta, num_betas = start
    true, _ = truth
    exps = F.prepare(parse_observed({"experiments": SYNTHETIC}).experiments, theta, num_betas)
    ev, _ = F.evaluate(exps, true, F.Simulator(), with_trace=False)
    data = {"experiments": copy.deepcopy(SYNTHETIC)}
    for e, t, x in zip(data["experiments"], ev.ttft_ms, ev.e2e_ms):
        e["observed"] = {"ttft_mean_ms": float(t), "e2e_mean_ms": float(x)}
    observed = parse_observed(data)
    return [dataclasses.replace(p, obs=o) for p, o in zip(exps, observed.experiments)], data


# ------------------------------------------------------------------ observed file and loss


@needs_observed
def test_loss_of_blis_predictions_reproduces_the_published_figures():
    observed = load_observed(OBSERVED)
    assert len(observed.experiments) == 15
    # README: trained-physics 23.49 + 13.12 = 36.62 %, roofline 561.80 + 53.26 = 615.06 %
    tp = prediction_loss(observed.experiments, "blis_trained_physics")
    assert tp["ttft_rmse"] == pytest.approx(23.49, abs=0.005)
    assert tp["e2e_rmse"] == pytest.approx(13.12, abs=0.005)
    assert tp["loss"] == pytest.approx(36.62, abs=0.005)
    roofline = prediction_loss(observed.experiments, "blis_roofline")
    assert roofline["loss"] == pytest.approx(615.06, abs=0.005)
    assert observed.sha256 == hashlib.sha256(OBSERVED.read_bytes()).hexdigest()


def test_loss_formula_on_hand_computed_values():
    # APEs 10 and 20 % on TTFT: sqrt((100 + 400) / 2) = 15.811; E2E APEs 0 and 5: sqrt(25 / 2)
    ttft_rmse, e2e_rmse, loss = loss_terms([11.0, 12.0], [100.0, 210.0], [10.0, 10.0], [100.0, 200.0])
    assert float(ttft_rmse) == pytest.approx(math.sqrt(250.0))
    assert float(e2e_rmse) == pytest.approx(math.sqrt(12.5))
    assert float(loss) == pytest.approx(math.sqrt(250.0) + math.sqrt(12.5))
    # a perfect fit: loss 0 with a finite (zero) gradient, not NaN
    g = jax.grad(lambda p: loss_terms(p, p, jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0]))[2])(jnp.array([1.0, 2.0]))
    assert np.isfinite(np.asarray(g)).all()


def _one(**over):
    exp = copy.deepcopy(SYNTHETIC[0])
    for path, value in over.items():
        *keys, last = path.split("__")
        node = exp
        for k in keys:
            node = node[k]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return {"experiments": [exp]}


@pytest.mark.parametrize("data, field", [
    (_one(observed__ttft_mean_ms=KeyError), r"experiments\[0\]\.observed\.ttft_mean_ms is missing"),
    (_one(observed__e2e_mean_ms=-3.0), r"experiments\[0\]\.observed\.e2e_mean_ms = -3\.0 must be"),
    (_one(config__tp=0), r"experiments\[0\]\.config\.tp = 0 must be an integer >= 1"),
    (_one(config__model=""), r"experiments\[0\]\.config\.model"),
    (_one(config__workload=[1]), r"experiments\[0\]\.config\.workload must be a mapping"),
    ({"experiments": []}, r"experiments must be a non-empty list"),
    ({"experiments": [SYNTHETIC[0], SYNTHETIC[0]]}, r"experiments\[1\]\.id = 'long-prompt' repeats experiments\[0\]"),
])
def test_bad_observed_data_names_the_field(data, field):
    with pytest.raises(ConfigError, match=field):
        parse_observed(data, "obs.json")


def test_prepare_resolves_the_experiment_config_with_the_start_coefficients(start):
    theta, nb = start
    [p] = F.prepare(parse_observed({"experiments": [SYNTHETIC[0]]}).experiments, theta, nb)
    s = p.scenario
    assert (s.model_id, s.hardware, s.tp, s.total_kv_blocks, s.max_num_seqs, s.max_num_batched_tokens) == \
        ("01-ai/Yi-34B", "H100", 2, 4000, 32, 512)
    assert len(s.requests) == 120 and s.sessions is None and s.config.seed is None   # the spec's own seed
    alpha, beta = F.split(theta, nb)
    np.testing.assert_array_equal(np.asarray(s.latency_model.alpha), [*alpha, 0.0])
    np.testing.assert_array_equal(np.asarray(s.latency_model.beta)[:nb], beta)
    with pytest.raises(ConfigError, match=r"^observed experiment long-prompt: unknown GPU 'H999'"):
        F.prepare(parse_observed(_one(config__hardware="H999")).experiments, theta, nb)


def test_observed_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--observed .*nope\.json: file does not exist"):
        load_observed(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"not valid JSON"):
        load_observed(bad)


# ------------------------------------------------------------------ names and bounds


def test_coefficient_names(start):
    theta, nb = start
    # slice-index names and BLIS names address the same slots: beta2 = b3 (weight loading)
    assert F.parse_params("beta2", theta, nb) == F.parse_params("b3", theta, nb) == [F.NUM_ALPHA + 2]
    assert F.parse_params("alpha2,BEP,b7", theta, nb) == [2, F.NUM_ALPHA + 6, F.NUM_ALPHA + 10]
    # "all": BLIS's coefficients of the mode; the first-token lag only when named or used by the start
    assert F.parse_params("all", theta, nb) == [k for k in range(F.NUM_COEFFS) if k != F.LAG]
    assert F.parse_params("alpha3,b3", theta, nb) == [F.LAG, F.NUM_ALPHA + 2]
    lagged = theta.copy()
    lagged[F.LAG] = 1.0
    assert F.parse_params("all", lagged, nb) == list(range(F.NUM_COEFFS))
    # default: the non-zero coefficients (iter29 has b2a = b1b = 0)
    assert F.parse_params(None, theta, nb) == [k for k in range(F.NUM_COEFFS) if k not in (F.LAG, F.NUM_ALPHA + 1, F.NUM_ALPHA + 8)]
    with pytest.raises(ConfigError, match=r"--params: unknown coefficient 'b99'"):
        F.parse_params("b3,b99", theta, nb)
    with pytest.raises(ConfigError, match=r"beta2 is listed twice"):
        F.parse_params("b3,beta2", theta, nb)
    with pytest.raises(ConfigError, match=r"'bEP' is beta slot 10, but the start coefficients have 10 betas"):
        F.parse_params("bEP", theta, 10)
    b3 = F.NUM_ALPHA + 2
    lo, hi = F.parse_bounds("b3=0.5:3,alpha0=:20000", [0, b3], nb)
    assert (lo[b3], hi[b3], lo[0], hi[0]) == (0.5, 3.0, 0.0, 20000.0)
    for text, message in (("b3=2:1", "upper bound must exceed"), ("b3=-1:", "lower bound must be"),
                          ("b3", "not NAME=LO:HI"), ("b6=0:1", "beta5 is not fitted"), ("b3=x:2", "'x' is not")):
        with pytest.raises(ConfigError, match=message):
            F.parse_bounds(text, [b3], nb)


def test_inner_fit_solves_a_linear_problem_within_its_box():
    # Means affine in θ with a known solution θ*: adam must land on θ* when it is inside the box,
    # and on the box edge (never outside) when the box excludes it.
    rng = np.random.default_rng(3)
    theta0 = np.zeros(F.NUM_COEFFS)
    theta0[[0, 5, 9]] = [1000.0, 1.0, 100.0]
    jac = np.zeros((3, 2, F.NUM_COEFFS))
    jac[:, :, [0, 5, 9]] = rng.uniform(0.2, 1.0, (3, 2, 3)) / np.array([1000.0, 1.0, 100.0])
    target = theta0.copy()
    target[[0, 5, 9]] *= [1.3, 0.8, 1.1]
    means0 = np.full((3, 2), 5.0)
    obs = means0 + np.einsum("epk,k->ep", jac, target - theta0)
    lin = F.Linearization(theta0=theta0, means0=means0, jac=jac, obs=obs, pred0=means0,
                          cross=np.zeros((3, 2, F.NUM_BETA)))
    free = [0, 5, 9]
    lo, hi = F.trust_box(theta0, free, np.zeros(F.NUM_COEFFS), np.full(F.NUM_COEFFS, np.inf), 1.0)
    theta, loss = F.inner_fit(lin, free, lo, hi, steps=2000, lr=0.05)
    np.testing.assert_allclose(theta[free], target[free], rtol=1e-4)
    assert loss < 1e-3
    lo, hi = F.trust_box(theta0, free, np.zeros(F.NUM_COEFFS), np.full(F.NUM_COEFFS, np.inf), 0.1)   # e^0.1 < 1.3
    theta, _ = F.inner_fit(lin, free, lo, hi, steps=2000, lr=0.05)
    assert np.all(theta[free] >= lo) and np.all(theta[free] <= hi)
    assert theta[0] == pytest.approx(hi[0], rel=1e-3)


# ------------------------------------------------------------------ fixed-schedule latencies


@pytest.fixture(scope="module")
def traced(synthetic, start):
    """(outputs, ScheduleTrace) of each synthetic experiment at the start coefficients."""
    theta, _ = start
    runs = []
    for p in synthetic[0]:
        sc = p.scenario
        model = with_coefficients(sc.latency_model, alpha=theta[:F.NUM_ALPHA], beta=theta[F.NUM_ALPHA:F.NUM_ALPHA + sc.latency_model.num_betas])
        final, out, trace = simulate_traced(sc.requests, sc.sessions, sc.params, model)
        runs.append((out, schedule_trace(final, out, trace, model)))
    return runs


def test_local_model_is_exact_and_tracks_resimulation_better_than_chaining(synthetic, start, traced):
    theta, _ = start
    p = synthetic[0][1]                                    # long-output: requests overlap
    out, trace = traced[1]
    ttft, e2e = predict_latencies_local(trace, jnp.asarray(theta[:F.NUM_ALPHA]), jnp.asarray(theta[F.NUM_ALPHA:]))
    done = out.completed_mask()
    assert done.sum() == 120
    np.testing.assert_array_equal(np.asarray(ttft), out.ttft_us[done].astype(np.float64))
    np.testing.assert_array_equal(np.asarray(e2e), out.e2e_us[done].astype(np.float64))
    # +10 % weight loading: the re-simulated mean TTFT change vs each fixed-schedule model
    # (measured: simulated +0.69 ms, local +0.93, chained +4954: a whole-run busy period)
    bumped = theta.copy()
    bumped[F.NUM_ALPHA + 2] *= 1.1
    sim = F.simulate(p, bumped, with_trace=False).ttft_mean_ms - F.simulate(p, theta, with_trace=False).ttft_mean_ms
    args = (jnp.asarray(bumped[:F.NUM_ALPHA]), jnp.asarray(bumped[F.NUM_ALPHA:]))
    base = (jnp.asarray(theta[:F.NUM_ALPHA]), jnp.asarray(theta[F.NUM_ALPHA:]))
    local = float(F.trace_means_ms(trace, *args)[0] - F.trace_means_ms(trace, *base)[0])
    chained = float(F.trace_means_ms(trace, *args, "chained")[0] - F.trace_means_ms(trace, *base, "chained")[0])
    assert sim > 0
    assert abs(local - sim) < 0.5 * sim
    assert abs(chained - sim) > 3 * abs(local - sim)


def test_first_token_lag_delays_ttft_and_e2e_only(synthetic, start, traced):
    # α₃ > 0: each request's first token (and so its E2E) reaches the client trunc(α₃·d_f) µs
    # later, d_f the duration of its first-token step; the schedule itself does not change.
    theta, _ = start
    p = synthetic[0][1]
    out, trace = traced[1]
    lagged = theta.copy()
    lagged[F.LAG] = 0.7
    sc = p.scenario
    model = with_coefficients(sc.latency_model, alpha=lagged[:F.NUM_ALPHA],
                              beta=lagged[F.NUM_ALPHA:F.NUM_ALPHA + sc.latency_model.num_betas])
    final, out_lag, steps = simulate_traced(sc.requests, sc.sessions, sc.params, model)
    lag_trace = schedule_trace(final, out_lag, steps, model)
    np.testing.assert_array_equal(lag_trace.start_us, trace.start_us)
    np.testing.assert_array_equal(lag_trace.duration_us, trace.duration_us)
    done = out.completed_mask()
    lag = np.trunc(0.7 * trace.duration_us[trace.first_step]).astype(np.int64)
    assert lag.min() > 0
    np.testing.assert_array_equal(lag_trace.lag_us_sim, lag)
    np.testing.assert_array_equal(out_lag.ttft_us[done], out.ttft_us[done] + lag)
    np.testing.assert_array_equal(out_lag.e2e_us[done], out.e2e_us[done] + lag)
    # the fixed-schedule models reproduce it exactly from the unlagged schedule's trace
    for model_name in F.SCHEDULE_MODELS:
        ttft, e2e = F.latency_predictor(model_name)(trace, jnp.asarray(lagged[:F.NUM_ALPHA]),
                                                     jnp.asarray(lagged[F.NUM_ALPHA:]))
        np.testing.assert_allclose(np.asarray(ttft), out_lag.ttft_us[done], rtol=0, atol=1.0)
        np.testing.assert_allclose(np.asarray(e2e), out_lag.e2e_us[done], rtol=0, atol=1.0)


def test_linearization_is_exact_with_the_first_token_lag(start, traced):
    # means(θ) = means₀ + J·Δθ + Δα₃·(cross·Δβ): exact for the fixed-schedule model, far from θ₀
    theta, _ = start
    _, trace = traced[1]
    base = theta.copy()
    base[F.LAG] = 0.5
    means0, jac, cross = F.linearize(trace, base)
    lin = F.Linearization(theta0=base, means0=means0[None], jac=jac[None], obs=means0[None], pred0=means0[None],
                          cross=cross[None])
    rng = np.random.default_rng(0)
    for _ in range(3):
        th = base * rng.uniform(0.5, 1.5, base.shape)
        exact = F.trace_means_ms(trace, jnp.asarray(th[:F.NUM_ALPHA]), jnp.asarray(th[F.NUM_ALPHA:]))
        np.testing.assert_allclose(np.asarray(lin.means(jnp.asarray(th)))[0], np.asarray(exact), rtol=1e-9)
    assert np.abs(cross).max() > 0   # the cross term is there (α₃·d_f with d_f affine in β)


@pytest.mark.parametrize("schedule_model", F.SCHEDULE_MODELS)
def test_loss_gradient_matches_central_differences(synthetic, start, traced, schedule_model):
    theta, _ = start
    exps = synthetic[0]
    traces = [trace for _, trace in traced]
    obs = np.array([[p.obs.ttft_mean_ms, p.obs.e2e_mean_ms] for p in exps])

    @jax.jit
    def loss(th):
        m = jnp.stack([F.trace_means_ms(t, th[:F.NUM_ALPHA], th[F.NUM_ALPHA:], schedule_model) for t in traces])
        return loss_terms(m[:, 0], m[:, 1], obs[:, 0], obs[:, 1])[2]

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(theta)))
    def at(k, step):
        th = theta.copy()
        th[k] += step
        return float(loss(jnp.asarray(th)))

    for k in (0, 2, F.NUM_ALPHA + 0, F.NUM_ALPHA + 2, F.NUM_ALPHA + 6, F.NUM_ALPHA + 9):
        # fourth-order central difference with a step that moves the loss by ~1e-3 %: the
        # chained model makes the loss strongly curved along β (+1e-4 on β2 moves mean TTFT by
        # ~5 ms), and µs times of ~1e8 limit how small a step can be
        assert grad[k] != 0.0
        h = 1e-3 / abs(grad[k])
        fd = (-at(k, 2 * h) + 8 * at(k, h) - 8 * at(k, -h) + at(k, -2 * h)) / (12 * h)
        assert grad[k] == pytest.approx(fd, rel=1e-5), F.coefficient_name(k)


# ------------------------------------------------------------------ recovery and the CLI


def test_fit_recovers_known_coefficients_from_a_perturbed_start(synthetic, start, truth):
    exps, _ = synthetic
    theta, _ = start
    true, free = truth
    lo, hi = F.parse_bounds(None, free, 11)
    settings = F.FitSettings(free=tuple(free), lo=lo, hi=hi, outer=4, steps=1000, trust=1.0)
    result = F.fit(exps, theta, settings, F.Simulator())
    assert result.start.loss > 10.0                       # the start is visibly wrong
    np.testing.assert_allclose(result.theta[free], true[free], rtol=0.01)
    untouched = [k for k in range(F.NUM_COEFFS) if k not in free]
    np.testing.assert_array_equal(result.theta[untouched], theta[untouched])
    # the reported loss is that of a real simulation at the reported coefficients
    fresh = [F.simulate(p, result.theta, with_trace=False) for p in exps]
    ev = F.evaluation(result.theta, exps, [r.ttft_mean_ms for r in fresh], [r.e2e_mean_ms for r in fresh])
    assert ev.loss == result.best.loss < 0.5
    accepted = [h["loss_pct"] for h in result.history if h["accepted"]]
    assert accepted == sorted(accepted, reverse=True) and accepted[-1] == result.best.loss


def _run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_fit_writes_a_loadable_coefficient_file_and_a_report(synthetic, tmp_path):
    _, data = synthetic
    observed = tmp_path / "observed.json"
    observed.write_text(json.dumps(data))
    output, report = tmp_path / "fitted.yaml", tmp_path / "report"
    # bEP (MoE dispatch) has no effect on dense models: named, but it must stay exactly as started
    code, out, err = _run_cli(["fit", "--observed", str(observed), "--params", "alpha0,b1a,b3,bEP", "--trust", "1",
                               "--outer", "2", "--output", str(output), "--report", str(report)])
    assert code == 0, err
    assert "outer 1/2: simulated loss" in err and "outer 1/2" not in out      # progress on stderr only
    assert "beta10 (bEP) has no effect" in err
    coeffs = load_coefficients(output)
    assert coeffs.beta[10] == load_coefficients().beta[10]
    prov = coeffs.provenance
    assert prov["observed"]["sha256"] == hashlib.sha256(observed.read_bytes()).hexdigest()
    assert prov["loss"]["simulated_pct"] < prov["loss"]["start_pct"]
    assert set(prov["loss"]["per_experiment"]) == {"long-prompt", "long-output"}
    assert prov["command"].startswith("blis-jax fit --observed") and prov["blis_jax_version"]
    assert len(coeffs.alpha) == 3 and len(coeffs.beta) == 11   # no first-token lag: BLIS's layout
    # a Deployment with the file (`run --coefficients`) resolves it into the latency model
    scenario = resolve_deployment(ScenarioConfig(deployment=Deployment(coefficients=output)), horizon_us=None)
    np.testing.assert_array_equal(np.asarray(scenario.latency_model.alpha), list(coeffs.alpha) + [0.0])
    rep = json.loads((report / "report.json").read_text())
    assert [e["id"] for e in rep["experiments"]] == ["long-prompt", "long-output"]
    assert rep["loss"]["fitted"]["loss_pct"] == prov["loss"]["simulated_pct"]
    assert (report / "predicted_vs_observed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| long-output |" in (report / "report.md").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--params", "alpha0,b99"], r"--params: unknown coefficient 'b99'"),
    (["--bounds", "b3=1:0", "--params", "b3"], r"--bounds: 'b3=1:0': the upper bound must exceed"),
    (["--experiments", "long-prompt,zzz"], r"--experiments: unknown experiment id 'zzz'"),
    (["--outer", "-1"], r"--outer -1: must be >= 0"),
    (["--params", "b3", "--bounds", "b3=2:3"], r"--bounds: the start value of beta2 \(1.36253\) is outside"),
    (["--output", "/nonexistent-dir/x.yaml"], r"--output /nonexistent-dir/x\.yaml: directory"),
    (["--cv", "lomo", "--experiments", "long-prompt"], r"--cv lomo: needs at least 2 groups"),
    (["--cv", "lomo", "--cv-jobs", "0"], r"--cv-jobs 0: must be >= 1"),
    (["--cv-jobs", "2"], r"--cv-jobs 2: runs cross-validation folds in parallel; give --cv"),
])
def test_cli_errors_are_one_clear_line(tmp_path, extra, message):
    observed = tmp_path / "observed.json"
    observed.write_text(json.dumps({"experiments": SYNTHETIC}))
    code, _, err = _run_cli(["fit", "--observed", str(observed), *extra])
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("blis-jax fit: error: ")
    assert re.search(message, err), err


@pytest.mark.slow
def test_cv_folds_in_worker_processes_give_the_same_figures(synthetic, tmp_path):
    """--cv-jobs 2 runs the two leave-one-model-out folds in spawned workers (each preparing the
    experiments again) while the main fit runs here: every fold's coefficients and held-out means
    equal the in-process run's, and so do the tables."""
    _, data = synthetic
    observed = tmp_path / "observed.json"
    observed.write_text(json.dumps(data))
    runs = {}
    for jobs in ("1", "2"):
        report = tmp_path / f"report-{jobs}"
        code, out, err = _run_cli(["fit", "--observed", str(observed), "--params", "alpha0,b1a,b3", "--outer", "1",
                                   "--steps", "100", "--cv", "lomo", "--cv-jobs", jobs, "--report", str(report)])
        assert code == 0, err
        runs[jobs] = (out, json.loads((report / "report.json").read_text()))
    (out1, rep1), (out2, rep2) = runs["1"], runs["2"]
    assert rep1["cv"]["folds"] and rep1["cv"] == rep2["cv"]
    assert rep1["coefficients"] == rep2["coefficients"]
    def without_wall_time(out: str) -> str:
        return re.sub(r" in [0-9.]+ s\b", " in - s", out)

    assert without_wall_time(out1).replace("report-1", "report-2") == without_wall_time(out2)
    assert "cross-validation (lomo)" in out1


def _failing_rebuild():
    raise ValueError("no experiments in this worker")


@pytest.mark.slow
def test_cv_workers_end_on_a_fold_error_or_a_stop(synthetic, start):
    """A worker's error reaches the caller (the other folds' workers are ended, not awaited), and
    so does a stop request (the main fit failed)."""
    import threading

    exps, _ = synthetic
    theta, num_betas = start
    free = F.parse_params("alpha0", theta, num_betas)
    lo, hi = F.parse_bounds(None, free, num_betas)
    settings = F.FitSettings(free=tuple(free), lo=lo, hi=hi, outer=1, steps=10, patience=1)
    with pytest.raises(ValueError, match="no experiments in this worker"):
        F.cross_validate(exps, theta, settings, "lomo", F.Simulator(), jobs=2, rebuild=_failing_rebuild)
    stop = threading.Event()
    stop.set()
    with pytest.raises(RuntimeError, match="the main fit failed"):
        F.cross_validate(exps, theta, settings, "lomo", F.Simulator(), jobs=2, rebuild=_failing_rebuild, stop=stop)


def test_cli_missing_observed_file(tmp_path):
    code, out, err = _run_cli(["fit", "--observed", str(tmp_path / "missing.json")])
    assert (code, out) == (2, "")
    assert err.startswith("blis-jax fit: error: --observed ") and "does not exist" in err and err.count("\n") == 1


def test_trust_radius_halves_on_rejection_and_recovers_on_good_agreement():
    # rejected (no better): halved
    assert F.next_radius(0.5, 0.5, 40.0, 30.0, 41.0) == 0.25
    assert F.next_radius(0.5, 0.5, 40.0, 30.0, 40.0) == 0.25
    # accepted, 3/4 or more of the predicted 10 points realised: doubled, never above --trust
    assert F.next_radius(0.125, 0.5, 40.0, 30.0, 32.5) == 0.25
    assert F.next_radius(0.25, 0.5, 40.0, 30.0, 29.0) == 0.5
    assert F.next_radius(0.5, 0.5, 40.0, 30.0, 30.0) == 0.5
    # accepted but below 3/4 of the prediction, or the model predicted no gain: unchanged
    assert F.next_radius(0.125, 0.5, 40.0, 30.0, 33.0) == 0.125
    assert F.next_radius(0.125, 0.5, 40.0, 41.0, 39.0) == 0.125
