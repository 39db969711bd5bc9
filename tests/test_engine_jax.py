"""JAX properties of the engine: jit == eager, vmap == loop of single runs, no retrace when
only numbers change.

All runs use one program shape (`engine_helpers.small_dims`), shared with the invariants
tests, so the whole file compiles `jit(run_to_end)`, `jit(vmap(run_to_end))` and (unless the
invariants tests already did) `start` / `advance` once each.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import (
    latency_model,
    natural_dims,
    params_from,
    raise_dims,
    random_scenario,
    small_dims,
)

from blis_jax.engine import output as so
from blis_jax.engine import simulate as sim
from blis_jax.latency import with_coefficients

DIMS = small_dims()


def _dims_for(requests, settings):
    """The shared program shape; fails if a scenario outgrows it."""
    d = raise_dims(natural_dims(requests, settings), DIMS)
    assert d == DIMS, f"scenario needs larger dims than the shared shape: {d}"
    return d


@functools.partial(jax.jit, static_argnums=0)
def run_jit(dims, params, req, model):
    return sim.run_to_end(dims, params, req, model)


def _tree_index(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _tree_stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


# ----------------------------------------------------------------------------- jit == eager


def test_jit_equals_no_jit():
    """`run_to_end` traced and compiled == the same function executed op by op. Tiny case (8
    requests, ~25 events; eager execution costs ~0.5 s per event): KV pressure, so the exact
    phase-1 pass, preemptions and prefix re-hits run, and a timeout."""
    requests = random_scenario(3, n=8, rate_rps=300.0, input_range=(16, 90), output_range=(2, 6),
                               deadline_frac=0.25, deadline_range_us=(10_000, 40_000), block_multiple_frac=0.5)
    settings = {"max_num_seqs": 8, "max_num_batched_tokens": 128, "total_kv_blocks": 10}
    dims = _dims_for(requests, settings)
    params, req, model = params_from(settings), sim.request_arrays(requests, dims), latency_model()
    jitted = run_jit(dims, params, req, model)
    with jax.disable_jit():
        eager = sim.run_to_end(dims, params, req, model)
    chex.assert_trees_all_equal(jax.device_get(jitted), jax.device_get(eager))
    out = sim.to_output(jitted, dims, params, requests, int(jitted.result))
    assert out.result == so.RESULT_OK and out.completed_mask().sum() + out.timed_out[0] == len(requests)
    assert out.preemption_count[0] > 0 and out.kv_hits[0] > 0 and out.timed_out[0] > 0, "tiny case too easy"


# ----------------------------------------------------------------------------- vmap == loop

VMAP_LANES = 8


def _vmap_lane(k: int):
    """Scenario k of the batch: rates, lengths, KV blocks, batch limits, horizon, and latency
    coefficients all differ between lanes; the program shape does not."""
    rng = np.random.default_rng(100 + k)
    requests = random_scenario(200 + k, n=int(rng.integers(20, 41)), rate_rps=float(rng.uniform(10, 80)),
                               input_range=(16, int(rng.integers(100, 500))), output_range=(1, int(rng.integers(5, 40))),
                               deadline_frac=0.3 if k % 3 == 0 else 0.0, deadline_range_us=(50_000, 1_000_000),
                               num_groups=2 if k % 2 else 0, num_priorities=1)
    settings = {"max_num_seqs": int(rng.integers(4, 65)), "max_num_batched_tokens": int(rng.integers(256, 1025)),
                "long_prefill_token_threshold": int(rng.choice([0, 64])),
                "total_kv_blocks": int(rng.choice([40, 80, 500, 4000])),
                "horizon_us": int(rng.choice([2_000_000, 50_000_000]))}
    base = latency_model()
    alpha = np.asarray(base.alpha) * rng.uniform(0.5, 2.0, base.alpha.shape[0])
    alpha[3] = rng.uniform(0.0, 1.5)   # blis-jax's first-token lag varies between lanes too
    model = with_coefficients(base, alpha=alpha,
                              beta=np.asarray(base.beta) * rng.uniform(0.7, 1.4, base.beta.shape[0]))
    return requests, settings, model


@pytest.fixture(scope="module")
def lanes():
    return [_vmap_lane(k) for k in range(VMAP_LANES)]


def test_vmap_equals_single_runs(lanes):
    chex.clear_trace_counter()

    @chex.assert_max_traces(n=1)
    def run_one(params, req, model):
        return sim.run_to_end(DIMS, params, req, model)

    batched_run = jax.jit(jax.vmap(run_one))
    inputs = [(params_from(s), sim.request_arrays(r, _dims_for(r, s)), m) for r, s, m in lanes]
    batched = jax.device_get(batched_run(*(_tree_stack(x) for x in zip(*inputs))))
    singles = [jax.device_get(run_jit(DIMS, *x)) for x in inputs]
    for k, single in enumerate(singles):
        chex.assert_trees_all_equal(_tree_index(batched, k), single, custom_message=f"lane {k}")
        assert int(single.result) == 0, f"lane {k}: result {int(single.result)}"
    # the lanes really differ (and some exercise preemption / timeouts)
    outs = [sim.to_output(s, DIMS, inputs[k][0], lanes[k][0], 0) for k, s in enumerate(singles)]
    assert len({int(o.sim_end_us[0]) for o in outs}) == VMAP_LANES
    assert sum(int(o.preemption_count[0]) for o in outs) > 0
    assert sum(int(o.timed_out[0]) for o in outs) > 0
    # a second batch with other numbers reuses the compiled program (assert_max_traces n=1)
    reordered = [inputs[(k + 3) % VMAP_LANES] for k in range(VMAP_LANES)]
    again = jax.device_get(batched_run(*(_tree_stack(x) for x in zip(*reordered))))
    chex.assert_trees_all_equal(_tree_index(again, 0), singles[3])


# ----------------------------------------------------------------------------- no retrace


def test_no_retrace_when_only_numbers_change(monkeypatch):
    """The jitted `start` and `advance` compile once per program shape: total_kv_blocks,
    max_num_seqs within its bucket, the token budget and chunk threshold, the horizon, latency
    coefficients and the request values (same count) are all data."""
    base_requests = random_scenario(31, n=60, rate_rps=150.0, input_range=(16, 400), output_range=(1, 40))
    base = {"max_num_seqs": 48, "max_num_batched_tokens": 1024, "total_kv_blocks": 3000}
    model = latency_model()

    def run(requests, settings, m):
        dims = _dims_for(requests, settings)
        params = params_from(settings)
        req = sim.request_arrays(requests, dims)
        state = sim.advance(dims, sim.start(dims, params, req, m), params, req, m, jnp.int64(10**9))
        return sim.to_output(state, dims, params, requests, int(state.result))

    reference = run(base_requests, base, model)  # compiles here unless an earlier test did
    sizes = (sim.start._cache_size(), sim.advance._cache_size())
    chex.clear_trace_counter()
    # from now on, tracing the engine's event body or its initial state is an error
    monkeypatch.setattr(sim, "_body", chex.assert_max_traces(sim._body, n=0))
    monkeypatch.setattr(sim, "init_state", chex.assert_max_traces(sim.init_state, n=0))

    variants = {
        "total_kv_blocks": (base_requests, dict(base, total_kv_blocks=60), model),
        "max_num_seqs": (base_requests, dict(base, max_num_seqs=33), model),
        "max_num_batched_tokens": (base_requests, dict(base, max_num_batched_tokens=700), model),
        "long_prefill_threshold": (base_requests, dict(base, long_prefill_token_threshold=32), model),
        "horizon": (base_requests, dict(base, horizon_us=300_000), model),
        "coefficients": (base_requests, base, with_coefficients(model, alpha=np.asarray(model.alpha) * 1.5,
                                                                beta=np.asarray(model.beta) * 0.8)),
        "request_values": (random_scenario(32, n=60, rate_rps=90.0, input_range=(16, 600), output_range=(1, 30),
                                           deadline_frac=0.5, num_groups=2), base, model),
    }
    for what, (requests, settings, m) in variants.items():
        try:
            out = run(requests, settings, m)
        except AssertionError as e:
            raise AssertionError(f"{what}: the engine was traced again") from e
        assert (sim.start._cache_size(), sim.advance._cache_size()) == sizes, f"{what}: recompiled"
        assert out.result == so.RESULT_OK, f"{what}: result code {out.result}"
        changed = not np.array_equal(out.e2e_us, reference.e2e_us) or out.sim_end_us[0] != reference.sim_end_us[0]
        assert changed, f"{what}: the change had no effect, so the test proves nothing"

    # sanity of the detector: a new program shape does trace (and is caught)
    bigger = dataclasses.replace(DIMS, kv_blocks=2 * DIMS.kv_blocks)
    with pytest.raises(AssertionError, match="traced > 0 times"):
        sim.start(bigger, params_from(base), sim.request_arrays(base_requests, bigger), model)


def test_driver_does_not_recompile_when_only_numbers_change(monkeypatch):
    """`simulate_instance` (the host driver of run and replay, with its own start and chunk
    programs): other KV blocks, prefill threshold, horizon, coefficients and request values in
    the same buckets reuse its compiled programs and trace nothing new."""
    requests = random_scenario(41, n=60, rate_rps=150.0, input_range=(16, 400), output_range=(1, 40))
    base = {"max_num_seqs": 48, "max_num_batched_tokens": 1024, "total_kv_blocks": 3000}
    model = latency_model()
    reference = sim.simulate_instance(requests, params_from(base), model)
    compiled = sim.compiled_programs()
    assert compiled >= 2, "the driver compiled no program of its own"
    chex.clear_trace_counter()
    monkeypatch.setattr(sim, "_body", chex.assert_max_traces(sim._body, n=0))
    variants = [
        (requests, dict(base, total_kv_blocks=2100, long_prefill_token_threshold=32), model),
        (requests, dict(base, horizon_us=300_000), model),
        (requests, base, with_coefficients(model, alpha=np.asarray(model.alpha) * 1.5)),
        (random_scenario(42, n=60, rate_rps=90.0, input_range=(16, 300), output_range=(1, 30)), base, model),
    ]
    for i, (reqs, settings, m) in enumerate(variants):
        out = sim.simulate_instance(reqs, params_from(settings), m)
        assert sim.compiled_programs() == compiled, f"variant {i}: recompiled"
        assert out.result == so.RESULT_OK
        assert not np.array_equal(out.e2e_us, reference.e2e_us), f"variant {i} changed nothing"
