"""Decode runs (engine/coast.py): running the plain decode steps after a step as one event
changes nothing in the output.

Each scenario runs twice on the same program shape, once with decode runs off
(`coast_steps=1`: one loop iteration per step) and once with them on, and every `SimOutput`
field must be identical: per-request TTFT / E2E / ITL / scheduling delay / status, the ITL
step log and decode runs, and every counter (preemptions, KV hits and misses, timeouts, drops,
length caps, end time). The scenarios stress what can end a run early: small KV caches
(preemption, allocation order of the LRU free list, prefix re-hits of freed blocks), prefix
groups, deadlines (timeouts of waiting and running requests), max_model_len (drops at enqueue), chunked
prefill, zero-length outputs, bursts, a horizon, priority scheduling, and the roofline model
(whose step times are evaluated step by step). Every scenario must also actually coast.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import latency_model, random_scenario

from blis_jax.engine import batch
from blis_jax.engine import output as so
from blis_jax.engine import simulate as sim
from blis_jax.engine.params import make_engine_params

SCENARIOS = {
    "kv_pressure_prefix_deadlines": (
        {"seed": 31, "n": 180, "rate_rps": 25.0, "input_range": (16, 300), "output_range": (1, 120),
         "deadline_frac": 0.3, "deadline_range_us": (50_000, 4_000_000), "num_groups": 3, "block_multiple_frac": 0.3,
         "zero_output_frac": 0.05, "burst_frac": 0.1},
        {"max_num_seqs": 16, "max_num_batched_tokens": 256, "total_kv_blocks": 120}, "trained-physics", "fcfs"),
    "light_load_long_outputs": (
        {"seed": 32, "n": 60, "rate_rps": 2.0, "input_range": (16, 200), "output_range": (100, 400)},
        {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "total_kv_blocks": 3000}, "trained-physics", "fcfs"),
    "max_model_len_chunked_horizon": (
        {"seed": 33, "n": 150, "rate_rps": 12.0, "input_range": (16, 500), "output_range": (20, 300)},
        {"max_num_seqs": 8, "max_num_batched_tokens": 128, "total_kv_blocks": 800, "max_model_len": 400,
         "long_prefill_token_threshold": 64, "horizon_us": 9_000_000}, "trained-physics", "fcfs"),
    "priority_roofline": (
        {"seed": 34, "n": 150, "rate_rps": 80.0, "input_range": (16, 300), "output_range": (5, 150),
         "num_priorities": 3, "num_groups": 2},
        {"max_num_seqs": 12, "max_num_batched_tokens": 512, "total_kv_blocks": 60}, "roofline", "priority-fcfs"),
}


def run(requests, settings: dict, model, scheduler: str, coast_steps: int) -> tuple[so.SimOutput, int]:
    """simulate_instance with decode runs of at most `coast_steps` steps; (output, coasted steps)."""
    original = sim.choose_dims
    seen = []

    def choose(**kwargs):
        return dataclasses.replace(original(**kwargs), coast_steps=coast_steps)

    params = make_engine_params(
        max_num_seqs=settings["max_num_seqs"], max_num_batched_tokens=settings["max_num_batched_tokens"],
        long_prefill_token_threshold=settings.get("long_prefill_token_threshold", 0),
        max_model_len=settings.get("max_model_len", 0), total_kv_blocks=settings["total_kv_blocks"],
        horizon_us=settings.get("horizon_us"))
    to_output = sim.to_output

    def capture(state, *args, **kwargs):
        seen.append(int(state.coasted_steps))
        return to_output(state, *args, **kwargs)

    with mock.patch.object(sim, "choose_dims", choose), mock.patch.object(sim, "to_output", capture):
        out = sim.simulate_instance(requests, params, model, scheduler=scheduler,
                                    preemption_policy="priority" if scheduler != "fcfs" else "fcfs")
    return out, seen[-1]


def assert_same_output(stepped: so.SimOutput, coasted: so.SimOutput) -> None:
    for field in so.SimOutput.__dataclass_fields__:
        a, b = np.asarray(getattr(stepped, field)), np.asarray(getattr(coasted, field))
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), f"SimOutput.{field}"


def stepped_and_coasted(case):
    """A scenario table entry run step by step and with decode runs: (the run's inputs, stepped
    output, coasted output, steps coasted)."""
    kwargs, settings, kind, scheduler = case
    inputs = (random_scenario(**kwargs), settings, latency_model(kind=kind), scheduler)
    stepped, none = run(*inputs, coast_steps=1)
    assert none == 0
    coasted, some = run(*inputs, coast_steps=64)
    return inputs, stepped, coasted, some


# Each scenario compiles two programs (runs off and on): slow. Every parity test of the default
# run already runs with decode runs on against BLIS's own results.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_decode_runs_change_nothing(name):
    _, stepped, coasted, some = stepped_and_coasted(SCENARIOS[name])
    assert some > 0
    assert_same_output(stepped, coasted)
    # the scenario exercises what it is meant to
    completed = np.sum(stepped.status == so.COMPLETED)
    assert completed > 0
    if name == "kv_pressure_prefix_deadlines":
        assert stepped.preemption_count.sum() > 0 and stepped.timed_out.sum() > 0 and stepped.kv_hits.sum() > 0
    if name == "max_model_len_chunked_horizon":
        assert np.any(stepped.status == so.DROPPED) and np.any(stepped.status == so.RUNNING)
    if name == "priority_roofline":
        assert stepped.preemption_count.sum() > 0


# Heavy KV pressure with long prompts: the wait queue's head often needs more free blocks than
# there are, so decode runs go on while it waits (batch.head_stays_blocked). Prefix groups make
# evictions shorten its cached prefix mid-run; the chunk cap and the token budget bound its chunk.
BLOCKED_HEAD = {
    "fcfs_prefix_chunked": (
        {"seed": 41, "n": 120, "rate_rps": 30.0, "input_range": (100, 700), "output_range": (20, 300),
         "num_groups": 3, "prefix_range": (64, 400), "block_multiple_frac": 0.3, "deadline_frac": 0.1,
         "deadline_range_us": (500_000, 6_000_000)},
        {"max_num_seqs": 16, "max_num_batched_tokens": 512, "total_kv_blocks": 90,
         "long_prefill_token_threshold": 256}, "trained-physics", "fcfs"),
    "priority_prefix": (
        {"seed": 42, "n": 120, "rate_rps": 40.0, "input_range": (100, 600), "output_range": (20, 250),
         "num_groups": 2, "prefix_range": (64, 300), "num_priorities": 3},
        {"max_num_seqs": 12, "max_num_batched_tokens": 1024, "total_kv_blocks": 70}, "trained-physics",
         "priority-fcfs"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BLOCKED_HEAD))
def test_runs_past_a_blocked_head_change_nothing(name):
    inputs, stepped, coasted, with_rule = stepped_and_coasted(BLOCKED_HEAD[name])
    jax.clear_caches()   # the same dims must trace again, without the rule (and the rule back after)
    try:
        with mock.patch.object(batch, "head_stays_blocked", lambda *a, **k: jnp.asarray(False)):
            _, without = run(*inputs, coast_steps=64)
    finally:
        jax.clear_caches()
    assert with_rule > without, (with_rule, without)   # the rule is exercised
    assert_same_output(stepped, coasted)
    assert stepped.preemption_count.sum() > 0 and stepped.kv_hits.sum() > 0
