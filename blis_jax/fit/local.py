"""Request-local fixed-schedule latencies: the fitting driver's default model.

`schedule.predict_latencies` chains step start times through each busy period: step k starts
when step k−1 ends, so a change δ of every step's duration delays step k by k·δ, counted from
the start of the busy period. That is the right shift for the *steps*, but not for a request's
TTFT: requests arrive at fixed times, and when steps get longer a request simply joins the step
in progress at its enqueue. Under sustained load (one busy period of 10⁵ steps) the chained
model's TTFT sensitivity to a per-step coefficient grows with the busy period; measured on a
150-request workload at 8 req/s, +10 % weight loading moved the simulated mean TTFT by +2.2 ms
while the chained model predicted +21.6 ms (the local model below: +2.0 ms).

Here each request's wait is local to its own window: with enq = arrival + α₀ and k₀ the step in
progress at enqueue (the last step starting before enq),

    TTFT = α₀ + ρ·d_{k₀} + gaps + Σ_{k₀ < k ≤ f} d_k + α₂ + α₃·d_f,      ρ = (t_{k₀} + d_{k₀} − enq) / d_{k₀}

(ρ = 0 when the instance was idle at enqueue; ρ·d is the residual of the step in progress, which
scales with the step; idle gaps stay fixed). Decode and E2E are as in `predict_latencies`:
E2E = TTFT + Σ_{decode steps} (d_k + α₂) + α₁. Everything is anchored on the simulated values, so
the result equals the engine's TTFT and E2E at the simulated coefficients, and it is affine in
(α, β): a first-order model whose errors the fitting loop's re-simulation corrects.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from blis_jax.fit.schedule import ScheduleTrace, first_token_lag


def request_windows(trace: ScheduleTrace) -> tuple[np.ndarray, np.ndarray]:
    """(k₀ [N], ρ [N]) per completed request: the step in progress at enqueue (−1: none) and
    the fraction of it still to run (0 when the instance was idle at enqueue)."""
    start, dur = trace.start_us, trace.duration_us
    enq = trace.arrival_us + trace.alpha_us_sim[0]
    k0 = np.searchsorted(start, enq, side="left") - 1          # last step starting before enq
    k0 = np.minimum(k0, trace.first_step - 1)                  # never at or after the first-token step
    safe = np.maximum(k0, 0)
    residual = np.where(k0 >= 0, start[safe] + dur[safe] - enq, 0)
    rho = np.where((k0 >= 0) & (residual > 0), residual / np.maximum(dur[safe], 1), 0.0)
    return k0.astype(np.int64), np.clip(rho, 0.0, 1.0)


def predict_latencies_local(trace: ScheduleTrace, alpha: Float[Array, " 4"], beta: Float[Array, " 11"],
                            windows: tuple[np.ndarray, np.ndarray] | None = None):
    """(TTFT µs [N], E2E µs [N]) of the completed requests, differentiable (affine) in alpha, beta."""
    k0, rho = request_windows(trace) if windows is None else windows
    delta_d = jnp.asarray(trace.basis) @ (beta - trace.beta_sim)        # Δ step duration
    delta_a = alpha - trace.alpha_sim
    f = jnp.asarray(trace.first_step)
    start = jnp.asarray(trace.start_us, jnp.float64)
    dur = jnp.asarray(trace.duration_us, jnp.float64)
    ttft_sim = start[f] + dur[f] + trace.alpha_us_sim[2] - jnp.asarray(trace.arrival_us, jnp.float64)
    cum = jnp.concatenate([jnp.zeros(1), jnp.cumsum(delta_d)])          # cum[k] = Σ_{j<k} Δd_j
    k0j = jnp.asarray(k0)
    window = cum[f + 1] - cum[k0j + 1] + jnp.asarray(rho) * jnp.where(k0j >= 0, delta_d[jnp.maximum(k0j, 0)], 0.0)
    lag = first_token_lag(trace, alpha, dur[f] + delta_d[f])
    ttft = ttft_sim + delta_a[0] + window + delta_a[2] + lag
    a = jnp.asarray(trace.alpha_us_sim, jnp.float64) + delta_a[:3]
    per_step = dur + delta_d + a[2]
    cum_step = jnp.concatenate([jnp.zeros(1), jnp.cumsum(per_step)])
    run_sum = cum_step[jnp.asarray(trace.run_last) + 1] - cum_step[jnp.asarray(trace.run_first)]
    decode = jax.ops.segment_sum(run_sum, jnp.asarray(trace.run_request), num_segments=trace.num_requests)
    return ttft, ttft + decode + a[1]
