"""The step trace and the fixed-schedule latency model (fit/schedule.py).

At the coefficients that produced the schedule, the prediction must equal the engine's own
TTFT and E2E for every completed request, to the microsecond — under queueing, chunked
prefill, KV pressure with preemption, and closed-loop sessions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import dims_floor, latency_model, params_from, random_scenario
from test_sessions import _chain_inputs

from blis_jax.engine import simulate as sim
from blis_jax.fit.schedule import predict_latencies, schedule_trace

SCENARIOS = {
    "idle_gaps": (dict(n=60, rate_rps=4.0, input_range=(16, 900), output_range=(1, 80), burst_frac=0.3),
                  {"max_num_seqs": 16, "max_num_batched_tokens": 512, "total_kv_blocks": 3000}),
    "kv_pressure": (dict(n=120, rate_rps=80.0, input_range=(200, 900), output_range=(20, 120)),
                    {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "total_kv_blocks": 120}),
}


TRACE_FLOOR = {("fcfs", "fcfs"): sim.choose_dims(
    input_len=np.full(120, 900), output_len=np.full(120, 120), prefix_group=np.full(120, -1),
    prefix_len=np.zeros(120, np.int64), max_num_seqs=32, max_num_batched_tokens=1024, total_kv_blocks=3000,
    block_size=16, step_log=16_384, trace_steps=True)}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_prediction_is_exact_at_the_simulated_coefficients(name):
    shape, settings = SCENARIOS[name]
    requests = random_scenario(31, **shape)
    model = latency_model()
    with dims_floor(TRACE_FLOOR):   # both scenarios share one compiled shape
        final, out, trace = sim.simulate_traced(requests, None, params_from(settings), model)
    if name == "kv_pressure":
        assert int(out.preemption_count[0]) > 0
    st = schedule_trace(final, out, trace, model)
    ttft, e2e = predict_latencies(st, model.alpha, model.beta)
    done = out.completed_mask()
    assert st.num_requests == int(done.sum()) > 0
    np.testing.assert_array_equal(np.asarray(ttft), out.ttft_us[done].astype(np.float64))
    np.testing.assert_array_equal(np.asarray(e2e), out.e2e_us[done].astype(np.float64))
    if name == "idle_gaps":
        assert (~st.busy).sum() > 1     # idle wake-ups happened (the α₀-shifted segment starts)


def test_sessions_trace_is_exact_and_gradients_match_finite_differences():
    requests, links, params = _chain_inputs(output=(30, 5, 60, 12), sessions=3)
    model = latency_model()
    final, out, trace = sim.simulate_traced(requests, links, params, model)
    st = schedule_trace(final, out, trace, model)
    ttft, e2e = predict_latencies(st, model.alpha, model.beta)
    done = out.completed_mask()
    np.testing.assert_array_equal(np.asarray(e2e), out.e2e_us[done].astype(np.float64))

    def mean_e2e(alpha, beta):
        return jnp.mean(predict_latencies(st, alpha, beta)[1])

    g_alpha, g_beta = jax.grad(mean_e2e, argnums=(0, 1))(model.alpha, model.beta)
    for k in (2, 4, 6):   # weight loading, per layer, per step
        h = 1e-3 * float(model.beta[k])
        up, down = model.beta.at[k].add(h), model.beta.at[k].add(-h)
        fd = (mean_e2e(model.alpha, up) - mean_e2e(model.alpha, down)) / (2 * h)
        assert float(g_beta[k]) == pytest.approx(float(fd), rel=1e-6)
    # each α enters linearly: α1 once per request, α2 once per output token
    assert float(g_alpha[1]) == pytest.approx(1.0)
    assert float(g_alpha[2]) == pytest.approx(float(final.output_len[done].mean()))
