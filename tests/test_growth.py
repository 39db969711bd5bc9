"""The one growth policy of the engine driver, the cluster driver and the sweep's batch runner:
only what overflowed grows, by 4 per rerun, up to 64-fold; then the code is reported."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from blis_jax.engine import results
from blis_jax.engine.growth import CAPACITY_OF, FACTOR, LIMIT, Growth, as_growth, run_growing


def test_only_the_overflowed_capacities_grow():
    g = Growth().after(results.WINDOW_FULL | results.ROWS_FULL)
    assert g == Growth(window=FACTOR, preempted_slots=FACTOR)
    assert g.after(results.WINDOW_FULL) == Growth(window=FACTOR ** 2, preempted_slots=FACTOR)


def test_nothing_to_grow_or_at_the_limit_stops():
    assert Growth().after(results.OK) is None
    assert Growth().after(results.ALLOC_OVERFLOW) is None   # growing cannot fix it
    assert Growth(window=LIMIT).after(results.WINDOW_FULL) is None
    assert Growth(window=LIMIT).after(results.ROWS_FULL) == Growth(window=LIMIT, preempted_slots=FACTOR)


def test_every_growable_bit_names_a_capacity():
    # OFFLOAD_FULL stops only runs with an offload chain (results.growable), outside GROWABLE so that
    # programs without one keep their jaxpr
    assert sum(CAPACITY_OF) == results.GROWABLE | results.OFFLOAD_FULL
    assert set(CAPACITY_OF.values()) == {f.name for f in dataclasses.fields(Growth)}


def test_join_and_uniform():
    assert Growth(window=4).join(Growth(free_ring=16)) == Growth(window=4, free_ring=16)
    assert as_growth(4) == Growth.uniform(4) and as_growth(Growth(run_log=4)) == Growth(run_log=4)


def test_run_growing_reruns_until_it_fits():
    codes = iter([results.WINDOW_FULL, results.WINDOW_FULL | results.INBOX_FULL, results.OK])
    seen = []

    def attempt(growth):
        seen.append(growth)
        return len(seen), next(codes)

    assert run_growing(attempt) == 3
    assert seen == [Growth(), Growth(window=4), Growth(window=16, inbox=4)]


def test_run_growing_reports_what_cannot_grow():
    seen = []

    def attempt(growth):
        seen.append(growth)
        return growth, results.WINDOW_FULL

    assert run_growing(attempt) == Growth(window=LIMIT)
    assert [g.window for g in seen] == [1, 4, 16, 64]


def test_choose_dims_grows_each_capacity_on_its_own():
    from blis_jax.engine.dims import choose_dims

    n = 50
    common = dict(input_len=np.full(n, 64), output_len=np.full(n, 8), prefix_group=np.full(n, -1),
                  prefix_len=np.zeros(n, int), max_num_seqs=256, max_num_batched_tokens=256, total_kv_blocks=400,
                  block_size=16, scheduler="priority-fcfs", batch_start=16)
    base = choose_dims(**common)
    for name in ("preempted_slots", "free_ring", "wait_slots", "window", "run_log", "inbox", "batch_slots"):
        grown = choose_dims(**common, growth=Growth(**{name: 4}))
        changed = {f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(grown, f.name)}
        # the running batch's width also sizes the per-step allocation and the preempted slots
        assert name in changed and changed <= {name, "alloc_blocks", "preempted_slots"}, (name, changed)
    assert choose_dims(**common, growth=4) == choose_dims(**common, growth=Growth.uniform(4))


@pytest.mark.slow
def test_engine_reruns_an_overflowed_window_to_the_same_result(monkeypatch):
    """A run whose in-flight window is made too small overflows, is rerun with only the window
    grown, and gives what a run with room from the start gives."""
    from blis_jax.engine import simulate as sim
    from engine_helpers import latency_model, params_from, random_scenario

    requests = random_scenario(3, n=60, rate_rps=80.0)
    settings = dict(max_num_seqs=4, max_num_batched_tokens=512, total_kv_blocks=2000)
    params, model = params_from(settings), latency_model()
    plain = sim.simulate_instance(requests, params, model)
    original, seen = sim.choose_dims, []

    def cramped(**kwargs):
        dims = original(**kwargs)
        seen.append(kwargs["growth"])
        return dims if kwargs["growth"].window > 1 else dataclasses.replace(dims, window=4)

    monkeypatch.setattr(sim, "choose_dims", cramped)
    grown = sim.simulate_instance(requests, params, model)
    assert seen == [Growth(), Growth(window=4)]
    assert grown.result == results.OK
    for field in ("status", "ttft_us", "e2e_us", "itl_sum_us", "output_tokens"):
        np.testing.assert_array_equal(getattr(grown, field), getattr(plain, field), err_msg=field)
