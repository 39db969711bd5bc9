"""The autoscaler's pipeline stages against blis-infra §7's worked examples WE-10 to WE-14 and
WE-16 (figures from BLIS's tests, or derived there by hand from its rules)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.cluster import autoscaler as asc
from blis_jax.errors import ConfigError

A100_1, H100_2 = 0, 1
VARIANTS = asc.Variants.of([("A100", 1, 10.0), ("H100", 2, 20.0)])


def _params(k=0.8, u=0.8, d=0.4, a=512.0):
    return asc.AnalyzerParams.of(asc.AnalyzerConfig(k, u, d, a))


SLOTS = 4  # every example padded to 4 slots (empty slots neither routable nor loading): one compile
analyze = jax.jit(asc.analyze, static_argnums=3)
optimize = jax.jit(asc.optimize)
stabilize = jax.jit(asc.stabilize)


def _replicas(capacity, used, queue=None, *, variant=None, loading=None, pending=None):
    n = len(capacity)

    def pad(values, dtype):
        out = np.zeros(SLOTS, dtype)
        out[:n] = np.zeros(n) if values is None else values
        return jnp.asarray(out)

    loading = pad(loading, bool)
    return asc.Replicas(
        routable=(jnp.arange(SLOTS) < n) & ~loading, loading=loading, model=pad(None, np.int32),
        variant=pad(variant, np.int32), capacity_tokens=pad(capacity, np.int64), used_tokens=pad(used, np.int64),
        queue_depth=pad(queue, np.int64), pending_tokens=pad(pending, np.int64))


def _analyze(rep, params, models=1):
    an = analyze(rep, params, VARIANTS, models)
    return float(an.required[0]), float(an.spare[0]), an


# ------------------------------------------------------------------------------ WE-11 pending supply


def test_we11_pending_supply_counts_against_required_capacity():
    p = _params(k=1.0, u=0.8, d=0.3, a=100)
    one_and_loading = dict(loading=[False, True], pending=[0, 10_000])
    required, spare, an = _analyze(_replicas([10_000, 0], [18_000, 0], **one_and_loading), p)
    assert (required, spare) == (2500.0, 0.0) and float(an.supply[0].sum()) == 10_000   # 22 500 − 20 000
    assert _analyze(_replicas([10_000, 0], [9_000, 0], **one_and_loading), p)[:2] == (0.0, 0.0)   # suppressed
    assert _analyze(_replicas([10_000], [9_000]), p)[0] == 1250.0
    half = _params(k=0.5, u=0.8, d=0.3, a=100)
    assert _analyze(_replicas([10_000, 0], [4_500, 0], loading=[False, True], pending=[0, 1_000]), half)[0] == 125.0


def test_we11_spare_capacity_and_loading_only_models():
    p = _params(k=1.0, u=0.8, d=0.3, a=100)
    required, spare, an = _analyze(_replicas([10_000, 10_000, 0], [1_000, 1_000, 0], loading=[False, False, True],
                                             pending=[0, 0, 10_000]), p)
    assert required == 0 and spare == pytest.approx(20_000 - 2_000 / 0.3)
    assert float(an.supply[0].sum()) == 20_000                                        # pending excluded
    required, spare, an = _analyze(_replicas([0, 0], [0, 0], loading=[True, True], pending=[10_000, 10_000]), p)
    assert (required, spare, float(an.supply[0].sum())) == (0.0, 0.0, 0.0)           # no scale-up from zero


def test_zero_capacity_replicas_are_excluded():
    required, spare, an = _analyze(_replicas([0, 10_000, 10_000], [0, 9_000, 9_000], [0, 10, 10]), _params())
    assert an.zero_capacity.tolist() == [True, False, False, False] and int(an.count[0, A100_1]) == 2


# --------------------------------------------------------------------------- WE-12, WE-13 analyzer


def test_we12_n_minus_one_check_across_variants():
    rep = _replicas([10_000, 25_000], [2_000, 2_000], variant=[A100_1, H100_2])
    required, spare, an = _analyze(rep, _params(k=0.8, u=0.8, d=0.4))
    assert float(an.supply[0, A100_1] + an.supply[0, H100_2]) == 28_000
    assert (required, spare) == (0.0, 0.0)   # raw spare 18 000, but 28 000 − 20 000 ≤ 10 000


def test_we13_saturated_model_scales_up_by_the_ceiling():
    required, spare, an = _analyze(_replicas([10_000, 10_000], [9_000, 8_500], [10, 8]), _params())
    assert required == pytest.approx(17_395) and spare == 0
    dec = optimize(an, VARIANTS)
    assert (int(dec.delta[0]), int(dec.variant[0])) == (3, A100_1)     # ⌈17 395 / 8000⌉


@pytest.mark.parametrize("used, expected", [([500, 600, 400], -2), ([0, 0, 0], -3)])
def test_we13_idle_model_scales_down(used, expected):
    required, spare, an = _analyze(_replicas([10_000] * 3, used), _params())
    assert required == 0 and spare == 24_000 - sum(used) / 0.4
    assert int(optimize(an, VARIANTS).delta[0]) == expected


def test_we13_a_single_replica_never_has_spare_capacity():
    assert _analyze(_replicas([10_000], [0]), _params())[:2] == (0.0, 0.0)


# ------------------------------------------------------------------------------ WE-14 engine sizing


def _analysis(required, spare, supply, count, listed=None):
    supply = jnp.asarray(supply, jnp.float64).reshape(len(required), -1)
    count = jnp.asarray(count, jnp.int32).reshape(len(required), -1)
    return asc.Analysis(required=jnp.asarray(required, jnp.float64), spare=jnp.asarray(spare, jnp.float64),
                        supply=supply, count=count, listed=count > 0 if listed is None else jnp.asarray(listed),
                        zero_capacity=jnp.zeros(1, bool))


def _decide(*args, **kw):
    dec = optimize(_analysis(*args, **kw), VARIANTS)
    return [(int(d), int(v)) for d, v in zip(dec.delta, dec.variant) if d != 0]


def test_we14_variant_choice_and_two_models():
    assert _decide([25, 0], [0, 40], [[10, 20], [10, 20]], [[1, 1], [1, 1]]) == [(3, A100_1), (-1, H100_2)]
    assert _decide([0], [15], [[10, 0]], [[1, 0]]) == [(-1, A100_1)]   # H100 without replicas: A100


@pytest.mark.parametrize("required, spare, supply, count, expected", [
    (25, 0, 10, 1, 3), (0, 25, 30, 3, -2), (0, 100, 30, 3, -3), (0, 1, 10, 1, -1)])
def test_we14_exact_sizes(required, spare, supply, count, expected):
    assert _decide([required], [spare], [[supply, 0]], [[count, 0]]) == [(expected, A100_1)]


def test_we14_unsized_variants():
    # the cheapest listed variant has no supply: +1, though a pricier variant has replicas
    assert _decide([50], [0], [[0, 20]], [[0, 1]], listed=[[True, True]]) == [(1, A100_1)]
    assert _decide([0], [10], [[0, 0]], [[0, 0]]) == []                 # spare, but no replicas anywhere


# ------------------------------------------------------------------------------ WE-10 stabilization


def _actuations(signals, up_w, down_w, ticks=7, every=60_000_000):
    st, passed = asc.Stabilizer.empty(1), []
    for t in range(ticks):
        delta = signals(t)
        st, dec = stabilize(st, asc.Decisions(delta=jnp.asarray([delta], jnp.int32),
                                                  variant=jnp.zeros(1, jnp.int32)), t * every, up_w, down_w)
        if int(dec.delta[0]) != 0:
            passed.append((t * every // 1_000_000, int(dec.delta[0])))
    return passed


W = 120_000_000


def test_we10_stabilization_windows():
    assert len(_actuations(lambda t: 1, 0, 0)) == 7
    assert _actuations(lambda t: 1, W, 0) == [(120, 1), (300, 1)]
    assert _actuations(lambda t: -1, 0, W) == [(120, -1), (300, -1)]
    assert _actuations(lambda t: 0 if t == 1 else 1, W, 0) == [(240, 1)]
    assert _actuations(lambda t: 1 if t < 2 else -1, W, W) == [(240, -1)]


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("config, field", [
    (asc.AnalyzerConfig(scale_up_threshold=-0.1), "scale_up_threshold"),
    (asc.AnalyzerConfig(scale_down_boundary=-1), "scale_down_boundary"),
    (asc.AnalyzerConfig(avg_input_tokens=-100), "avg_input_tokens"),
    (asc.AnalyzerConfig(kv_cache_threshold=1.5), "kv_cache_threshold"),
    (asc.AnalyzerConfig(scale_up_threshold=0.5, scale_down_boundary=0.5), "scale_down_boundary"),
    (asc.AnalyzerConfig(scale_up_threshold=0.4, scale_down_boundary=0.8), "scale_down_boundary"),
    (asc.AnalyzerConfig(scale_down_boundary=0.9), "scale_down_boundary"),     # effective up 0.8
    (asc.AnalyzerConfig(scale_up_threshold=0.3), "scale_down_boundary"),      # effective down 0.4
    (asc.AnalyzerConfig(kv_cache_threshold=float("nan")), "kv_cache_threshold"),
])
def test_we20_analyzer_validation(config, field):
    with pytest.raises(ConfigError, match=field):
        config.effective()


def test_defaults_fill_zeros():
    assert asc.AnalyzerConfig().effective() == asc.AnalyzerConfig(0.8, 0.8, 0.4, 512.0)


# ------------------------------------------------------------------------------ WE-16 actuator


def _actuation(delta: int, states, slot_seq=None, pools=False):
    """Run one actuation of `delta` replicas of variant 0 on slots in `states` (startup slots
    named instance_<k>); returns (scaling state, lifecycle) after it."""
    from blis_jax.cluster import lifecycle as lc
    from blis_jax.cluster import scaling

    slots = len(states)
    names = [f"instance_{k}" for k in range(slots)]
    rank = np.empty(slots, np.int64)
    rank[sorted(range(slots), key=lambda k: names[k].encode())] = np.arange(slots)
    sp = scaling.ScalingParams(
        interval_us=jnp.int64(1), up_window_us=jnp.int64(0), down_window_us=jnp.int64(0), analyzer=_params(),
        variants=VARIANTS, variant_gpu_type=jnp.zeros(2, jnp.int32), variant_tp=jnp.ones(2, jnp.int32),
        scrape_delay_us=jnp.zeros(4, jnp.int64), loading_delay_us=jnp.zeros(4, jnp.int64),
        gpu_node=jnp.zeros(1, jnp.int32), gpu_type=jnp.full(1, -1, jnp.int32), startup_rank=jnp.asarray(rank),
        first_new_slot=jnp.int32(slots), unbounded=jnp.asarray(True))
    ss = scaling.init_state(1, slots, 2, 16, np.zeros(slots, np.int32))
    ss = dataclasses.replace(ss, pending_at=ss.pending_at.at[0].set(0),
                             pending_delta=ss.pending_delta.at[0, 0].set(delta),
                             slot_seq=jnp.asarray(slot_seq if slot_seq is not None else np.zeros(slots), jnp.int32))
    life = lc.make(states)
    ss, life = jax.jit(scaling.actuate, static_argnums=(5, 6))(
        ss, sp, life, jnp.zeros(slots, jnp.int32), jnp.zeros(slots, jnp.int64), 1, pools, jnp.int64(0),
        jnp.asarray(True))
    kinds = np.asarray(ss.log_kind[:int(ss.log_len)]).tolist()
    return np.asarray(life.state), kinds, np.asarray(ss.log_slot[:int(ss.log_len)]).tolist()


def test_we16_scale_down_drains_the_smallest_ids_in_byte_order():
    from blis_jax.cluster import lifecycle as lc
    from blis_jax.cluster import scaling

    active = [lc.ACTIVE] * 12
    state, kinds, slots = _actuation(-3, active)
    assert np.flatnonzero(state == lc.DRAINING).tolist() == [0, 1, 10]     # instance_10 before instance_2
    assert kinds == [scaling.LOG_DRAINING] * 3 and slots == [0, 1, 10]
    # an autoscaler-created instance (autoscale-… sorts before instance_…) goes first
    state, _, slots = _actuation(-1, active, slot_seq=[0] * 11 + [1])
    assert slots == [11]
    # a Draining instance is not a candidate; decision −2 with one Active: one drain, one warning
    state, kinds, slots = _actuation(-2, [lc.DRAINING, lc.ACTIVE, lc.LOADING] + [lc.ABSENT] * 9)
    assert state.tolist()[:3] == [lc.DRAINING, lc.DRAINING, lc.LOADING]
    assert kinds == [scaling.LOG_DRAINING, scaling.LOG_NO_ACTIVE]


def test_we16_scale_up_without_node_pools_fails_as_one_operation():
    from blis_jax.cluster import lifecycle as lc
    from blis_jax.cluster import scaling

    state, kinds, _ = _actuation(+2, [lc.ACTIVE, lc.ACTIVE] + [lc.ABSENT] * 10)
    assert state.tolist()[:2] == [lc.ACTIVE, lc.ACTIVE]
    assert kinds == [scaling.LOG_NO_PLACEMENT_MANAGER, scaling.LOG_APPLY_FAILED]
