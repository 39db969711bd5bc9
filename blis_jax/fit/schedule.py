"""Differentiable latencies with the schedule held fixed (the fitting approximation).

A simulation decides *which* requests run in which step; the coefficients decide *how long*
each step takes. Holding the schedule of one simulation fixed, every latency is a smooth
function of the coefficients:

* step k lasts d_k = d_k,sim + (β − β_sim) · basis_k (trained-physics is linear in β in its
  10/11-beta modes; anchoring at the simulated, µs-truncated duration keeps the prediction
  exact at the simulated coefficients — truncation would otherwise drift by up to 1 µs per
  step over a busy period of 10⁵ steps);
* step k starts when step k−1 ends if the instance was busy, else when the request that woke
  it was enqueued (arrival + α₀): t_k = t_{k−1} + d_{k−1}, or t_k(simulated) + (α₀ − α₀,sim);
* TTFT_i = t_{f_i} + d_{f_i} + α₂ − arrival_i, with f_i the step of i's first token;
* E2E_i = TTFT_i + Σ_{decode steps of i} (d_k + α₂) + α₁;
* each α enters as its simulated (truncated) value plus (α − α_sim).

This is exact at the coefficients that produced the schedule (up to the µs truncation) and a
first-order model near them: arrivals that depend on completions (closed-loop sessions) and
batch composition are frozen. The fitting loop re-simulates every few optimizer steps, so the
schedule follows the coefficients. Forward-mode through the engine loop itself is not usable:
time there is integer µs, whose derivative is zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTrace:
    """One simulation's schedule (numpy), for `predict_latencies`."""

    start_us: np.ndarray       # int64 [S] step start times as simulated
    duration_us: np.ndarray    # int64 [S] step durations as simulated (truncated)
    basis: np.ndarray          # float64 [S, 11] latency basis per step
    busy: np.ndarray           # bool [S] the step started when the previous one ended
    arrival_us: np.ndarray     # int64 [N] completed requests
    first_step: np.ndarray     # int64 [N] step of the first token
    run_request: np.ndarray    # int64 [K] decode runs: request index into the arrays above
    run_first: np.ndarray      # int64 [K]
    run_last: np.ndarray       # int64 [K]
    alpha_sim: np.ndarray      # float64 [4] coefficients the schedule was simulated with
    beta_sim: np.ndarray       # float64 [11]
    alpha_us_sim: np.ndarray   # int64 [3] the engine's truncated α terms (α₀, α₁, α₂)
    lag_us_sim: np.ndarray     # int64 [N] the engine's first-token lag trunc(α₃·d_first) per request

    @property
    def num_requests(self) -> int:
        return int(self.arrival_us.shape[0])


def schedule_trace(requests, out, trace, model) -> ScheduleTrace:
    """From `simulate_traced`'s (requests, outputs, trace) and the latency model simulated."""
    from blis_jax import latency

    start, duration, basis, first_step = trace
    done = np.flatnonzero(out.completed_mask() & (np.asarray(first_step) >= 0))
    index = np.full(len(requests), -1, np.int64)
    index[done] = np.arange(done.shape[0])
    runs = out.itl_runs[index[out.itl_runs[:, 0]] >= 0]
    busy = np.zeros(start.shape[0], bool)
    busy[1:] = start[1:] == start[:-1] + duration[:-1]
    first = np.asarray(first_step)[done]
    return ScheduleTrace(start_us=np.asarray(start, np.int64), duration_us=np.asarray(duration, np.int64),
                         basis=np.asarray(basis, np.float64), busy=busy,
                         arrival_us=np.asarray(requests.arrival_us)[done], first_step=first,
                         run_request=index[runs[:, 0]], run_first=runs[:, 1], run_last=runs[:, 2],
                         alpha_sim=np.asarray(model.alpha, np.float64), beta_sim=np.asarray(model.beta, np.float64),
                         alpha_us_sim=np.array([int(latency.queueing_time_us(model, 0)),
                                                int(latency.post_decode_time_us(model)),
                                                int(latency.output_token_time_us(model))], np.int64),
                         lag_us_sim=np.asarray(latency.first_token_lag_us(model, np.asarray(duration)[first]), np.int64))


def first_token_lag(trace: ScheduleTrace, alpha, d_first):
    """The first-token lag α₃·d_f at coefficients `alpha` and first-token step durations
    `d_first` [N], anchored on the engine's truncated value at the simulated ones."""
    dur_first = jnp.asarray(trace.duration_us[trace.first_step], jnp.float64)
    return jnp.asarray(trace.lag_us_sim, jnp.float64) + alpha[3] * d_first - trace.alpha_sim[3] * dur_first


def predict_latencies(trace: ScheduleTrace, alpha: Float[Array, " 4"], beta: Float[Array, " 11"]):
    """(TTFT µs [N], E2E µs [N]) of the completed requests, differentiable in alpha and beta."""
    basis = jnp.asarray(trace.basis)
    d = jnp.asarray(trace.duration_us, jnp.float64) + basis @ (beta - trace.beta_sim)
    a = jnp.asarray(trace.alpha_us_sim, jnp.float64) + (alpha[:3] - trace.alpha_sim[:3])
    start_sim = jnp.asarray(trace.start_us, jnp.float64)
    busy = jnp.asarray(trace.busy)
    # segmented running sum: a segment starts at each idle wake-up (fixed time, shifted by α₀)
    seg = jnp.cumsum(~busy) - 1
    seg_first = jnp.flatnonzero(~busy, size=int((~trace.busy).sum()))
    wake = start_sim[seg_first] + (alpha[0] - trace.alpha_sim[0])
    cum = jnp.concatenate([jnp.zeros(1), jnp.cumsum(d)])          # cum[k] = Σ_{j<k} d_j
    t = wake[seg] + cum[jnp.arange(d.shape[0])] - cum[seg_first[seg]]
    f = jnp.asarray(trace.first_step)
    ttft = t[f] + d[f] + a[2] + first_token_lag(trace, alpha, d[f]) - jnp.asarray(trace.arrival_us, jnp.float64)
    per_step = d + a[2]
    cum_step = jnp.concatenate([jnp.zeros(1), jnp.cumsum(per_step)])
    run_sum = cum_step[jnp.asarray(trace.run_last) + 1] - cum_step[jnp.asarray(trace.run_first)]
    decode = jax.ops.segment_sum(run_sum, jnp.asarray(trace.run_request), num_segments=trace.num_requests)
    return ttft, ttft + decode + a[1]
