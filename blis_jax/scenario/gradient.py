"""Metrics as differentiable functions of the trained-physics coefficients, schedule held fixed.

    f = bj.fixed_schedule_metrics(config, ["ttft_mean_ms", "e2e_mean_ms"])
    f(alpha, beta)                      # a JAX function: jax.grad / jax.jacfwd / jax.jit it
    value, d_alpha, d_beta = bj.metric_gradient(config, "ttft_mean_ms")

What is held fixed. The scenario is simulated once, at its own coefficients, recording its
schedule: which requests run in which step. The function then moves every step's duration
(linear in β) and every α term, with that schedule frozen, and recomputes each request's TTFT
and E2E in its own window (`blis_jax.fit.local`, the model `blis-jax fit` and
`blis-jax sensitivity` use). At the simulated coefficients it equals the simulated metrics
(up to the engine's µs truncation); away from them it is the first-order, *direct* effect of
the coefficients. What a re-simulation would add — a different batch composition, arrivals that
find the instance busy or idle, closed-loop rounds arriving earlier or later — is left out, so
the derivative is not that of a whole re-simulation (`blis-jax sensitivity --check` measures the
two side by side). Integer-µs simulation time has no useful derivative itself, which is why
the engine loop is not differentiated directly.

Needs the trained-physics latency model in a mode that is linear in β (10 or 11 betas) and a
single-instance scenario.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.naming import name
from blis_jax.scenario.config import ScenarioConfig
from blis_jax.scenario.resolve import ResolvedScenario, Warn, resolve

NUM_ALPHA = 4   # α₀ queueing, α₁ post-decode, α₂ per output token, α₃ first-token lag
NUM_BETA = 11   # trained-physics step basis (a 10-beta model has its 11th slot at 0)


def _short_names() -> dict[str, str]:
    """SimulationResult.metrics key → sensitivity's metric name (e.g. ttft_mean_ms → ttft_mean)."""
    from blis_jax.fit.sensitivity import METRICS

    return {key: short for short, (key, _) in METRICS.items()}


def differentiable_metrics() -> tuple[str, ...]:
    """The `SimulationResult.metrics` keys `fixed_schedule_metrics` can differentiate."""
    return tuple(_short_names())


@dataclasses.dataclass(frozen=True, eq=False)
class FixedScheduleMetrics:
    """`self(alpha, beta)` → the metrics [M] (as in `SimulationResult.metrics`: ms,
    tokens/s) of the simulated schedule at coefficients `alpha` [4], `beta` [11]: a pure JAX
    function (differentiate, jit or vmap it). `alpha`, `beta` are the coefficients the
    schedule was simulated with, `values` the simulated metrics (the function's value there),
    `notes` what the model holds fixed beyond the schedule (empty when nothing)."""

    metrics: tuple[str, ...]
    function: Callable
    alpha: np.ndarray
    beta: np.ndarray
    values: np.ndarray
    notes: tuple[str, ...]

    def __call__(self, alpha, beta):
        import jax.numpy as jnp

        return self.function(jnp.concatenate([jnp.asarray(alpha, jnp.float64), jnp.asarray(beta, jnp.float64)]))


def fixed_schedule_metrics(scenario: ScenarioConfig | ResolvedScenario,
                           metrics: Sequence[str] = ("ttft_mean_ms",), *,
                           warn: Warn | None = None) -> FixedScheduleMetrics:
    """Simulate `scenario` once (its schedule recorded) and return its `metrics` as a
    differentiable function of the trained-physics coefficients with that schedule fixed (see
    the module docstring for what that leaves out). Metric names are `SimulationResult.metrics`
    keys: TTFT/E2E mean and p90/p95/p99 (`ttft_mean_ms`, `e2e_p99_ms`, ...), `itl_mean_ms`,
    `tokens_per_sec`. Raises `ConfigError` for another metric, a cluster scenario, or a latency
    model that is not linear in its coefficients."""
    from blis_jax.fit import sensitivity

    short = _short_names()
    if isinstance(metrics, str):
        metrics = (metrics,)
    for m in metrics:
        if m not in short:
            raise ConfigError(f"metric {m!r}: can be differentiated for {', '.join(short)}")
    resolved = resolve(scenario, warn=warn) if isinstance(scenario, ScenarioConfig) else scenario
    if resolved.requests is None:
        raise ConfigError("fixed_schedule_metrics: the scenario has no requests (resolve a ScenarioConfig with a "
                          "workload)")
    if not resolved.single_instance:
        raise ConfigError("fixed_schedule_metrics: the schedule model covers single-instance scenarios; use "
                          "cluster.num_instances 1 and cluster.admission_policy always-admit")
    if resolved.lora is not None:
        raise ConfigError(f"{name('lora.config')}: the schedule model does not include the LoRA step overhead yet; "
                          "drop the LoRA configuration to differentiate")
    if resolved.cpu_tier is not None:
        raise ConfigError(f"{name('deployment.kv_cpu_blocks')}: the schedule model does not include the CPU KV tier; "
                          "drop it to differentiate")
    if resolved.offload is not None:
        raise ConfigError(f"{name('deployment.kv_offload_config')}: the schedule model does not include the "
                          "multi-tier KV offload chain; drop it to differentiate")
    model = resolved.latency_model
    if model.kind != "trained-physics" or model.num_betas < 10:
        why = ("roofline is not linear in coefficients" if model.kind != "trained-physics"
               else f"{model.num_betas} betas select the max-form mode, which is not linear in beta")
        raise ConfigError(f"deployment.latency_model: coefficients can be differentiated for trained-physics with "
                          f"10 or 11 betas only ({why})")
    sim = sensitivity.simulate(resolved)
    names = [short[m] for m in metrics]
    function, notes = sensitivity.schedule_metrics(sim, names)
    if resolved.sessions is not None and resolved.sessions.num_sessions:
        notes.append("closed-loop sessions: later rounds arrive when earlier ones complete; those arrival times "
                     "are held fixed")
    theta = sensitivity.theta_of(resolved)
    return FixedScheduleMetrics(metrics=tuple(metrics), function=function, alpha=theta[:NUM_ALPHA].copy(),
                                beta=theta[NUM_ALPHA:].copy(), values=sensitivity.metric_values(sim, names),
                                notes=tuple(notes))


def metric_gradient(scenario: ScenarioConfig | ResolvedScenario, metric: str = "ttft_mean_ms", *,
                    warn: Warn | None = None) -> tuple[float, np.ndarray, np.ndarray]:
    """(value, d value/d alpha [4], d value/d beta [11]) of one metric at the scenario's own
    coefficients, with the simulated schedule held fixed (`fixed_schedule_metrics`). `value`
    is the metric of the fixed-schedule model at those coefficients, which equals the
    simulated one (`simulate(scenario).metrics[metric]`)."""
    import jax
    import jax.numpy as jnp

    f = fixed_schedule_metrics(scenario, (metric,), warn=warn)
    scalar = lambda a, b: f(a, b)[0]  # noqa: E731
    value, (d_alpha, d_beta) = jax.jit(jax.value_and_grad(scalar, argnums=(0, 1)))(jnp.asarray(f.alpha),
                                                                                  jnp.asarray(f.beta))
    return float(value), np.asarray(d_alpha), np.asarray(d_beta)
