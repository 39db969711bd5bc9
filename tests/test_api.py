"""The public API: `import blis_jax` (exports, JAX configuration, lazy loading), batches equal
single simulations, and the fixed-schedule gradient equals its central finite difference."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blis_jax as bj

ROOT = Path(__file__).resolve().parents[1]

REQUIRED = ("ScenarioConfig", "Deployment", "EngineSettings", "SyntheticWorkload", "SpecWorkload", "TraceWorkload",
            "ClusterConfig", "resolve", "simulate", "SimulationResult", "ResolvedScenario", "ConfigError",
            "SimulationFailed", "simulate_batch", "fixed_schedule_metrics", "metric_gradient", "__version__")


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=120).stdout


def test_public_names_resolve_and_are_documented():
    assert set(REQUIRED) <= set(bj.__all__)
    for attr in bj.__all__:
        value = getattr(bj, attr)
        if attr != "__version__":
            assert value.__doc__, f"blis_jax.{attr} has no docstring"
    assert set(bj.__all__) <= set(dir(bj))
    with pytest.raises(AttributeError):
        bj.no_such_name  # noqa: B018


def test_import_turns_on_x64_and_nothing_else_loads_eagerly():
    """The documented decision (package docstring, README): importing blis_jax enables
    jax_enable_x64 for the process; the API modules load on first use."""
    out = _python("import jax, sys; before = jax.config.jax_enable_x64; import blis_jax; "
                  "print(before, jax.config.jax_enable_x64, 'blis_jax.scenario.simulate' in sys.modules); "
                  "blis_jax.ScenarioConfig; print('blis_jax.scenario.config' in sys.modules)")
    assert out.split() == ["False", "True", "False", "True"]


def _configs():
    """8 small single-instance scenarios differing in rate, max-num-seqs, size and seed."""
    rows = [(2.0, 8, 1), (5.0, 8, 2), (10.0, 16, 3), (20.0, 16, 4), (2.0, 256, 5), (5.0, 32, 6), (10.0, 4, 7),
            (30.0, 64, 8)]
    return [bj.ScenarioConfig(engine=bj.EngineSettings(max_num_seqs=mns),
                              workload=bj.SyntheticWorkload(rate=rate, num_requests=20 + 3 * i), seed=seed)
            for i, (rate, mns, seed) in enumerate(rows)]


@pytest.mark.slow  # ~4 min on 2 shared cores: 8 single simulations compile their own shapes
def test_batch_of_eight_equals_eight_single_simulations():
    configs = _configs()
    batch = bj.simulate_batch(configs)
    assert len(batch) == 8
    for i, (config, result) in enumerate(zip(configs, batch)):
        single = bj.simulate(config)
        assert dict(result.metrics) == dict(single.metrics), i
        assert result.records == single.records, i
        assert result.metrics["completed_requests"] == 20 + 3 * i


def test_batch_refuses_a_cluster_and_accepts_nothing():
    assert bj.simulate_batch([]) == []
    cluster = bj.ScenarioConfig(cluster=bj.ClusterConfig(num_instances=2),
                                workload=bj.SyntheticWorkload(num_requests=5))
    with pytest.raises(bj.ConfigError, match="cluster"):
        bj.simulate_batch([cluster])


@pytest.fixture(scope="module")
def schedule():
    config = bj.ScenarioConfig(workload=bj.SyntheticWorkload(rate=10.0, num_requests=30), seed=3)
    return config, bj.fixed_schedule_metrics(config, ["ttft_mean_ms", "e2e_mean_ms", "itl_mean_ms"])


@pytest.mark.slow  # one traced simulation and one plain one: ~1 min on 2 shared cores
def test_fixed_schedule_value_is_the_simulated_metric(schedule):
    config, f = schedule
    simulated = bj.simulate(config).metrics
    at_start = np.asarray(f(f.alpha, f.beta))
    for k, metric in enumerate(f.metrics):
        assert at_start[k] == pytest.approx(simulated[metric], rel=1e-9, abs=1e-9), metric
        assert f.values[k] == simulated[metric]


@pytest.mark.slow  # shares the traced simulation above, plus the one metric_gradient runs
def test_gradient_equals_central_difference(schedule):
    config, f = schedule
    theta0 = np.concatenate([f.alpha, f.beta])
    fn = jax.jit(lambda t: f(t[:4], t[4:]))
    jac = np.asarray(jax.jacfwd(fn)(jnp.asarray(theta0)))
    value, d_alpha, d_beta = bj.metric_gradient(config, "ttft_mean_ms")   # re-simulates: the same schedule
    assert value == pytest.approx(f.values[0], rel=1e-9)
    assert d_alpha.shape == (4,) and d_beta.shape == (11,)
    np.testing.assert_allclose(np.concatenate([d_alpha, d_beta]), jac[0], rtol=1e-12, atol=1e-15)
    assert d_alpha[0] != 0 and d_beta[2] > 0   # queueing and weight loading lengthen TTFT
    for k in range(theta0.shape[0]):
        h = 1e-3 * max(abs(theta0[k]), 1.0)
        up, down = theta0.copy(), theta0.copy()
        up[k] += h
        down[k] -= h
        fd = (np.asarray(fn(jnp.asarray(up))) - np.asarray(fn(jnp.asarray(down)))) / (2 * h)
        np.testing.assert_allclose(jac[:, k], fd, rtol=1e-6, atol=1e-9 * np.max(np.abs(jac)), err_msg=str(k))


def test_gradient_refuses_what_it_cannot_differentiate():
    with pytest.raises(bj.ConfigError, match="metric 'preemption_count'"):
        bj.fixed_schedule_metrics(bj.ScenarioConfig(), ["preemption_count"])
    roofline = bj.ScenarioConfig(deployment=bj.Deployment(latency_model="roofline"),
                                 workload=bj.SyntheticWorkload(num_requests=5))
    with pytest.raises(bj.ConfigError, match="roofline"):
        bj.metric_gradient(roofline)
