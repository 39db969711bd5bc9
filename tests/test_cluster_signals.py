"""Stale routing signals (blis-features §3.6): lazy per-instance snapshot refresh, cache-signal
freezing for all instances together, live in-flight counts."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.cluster import signals as sg
from blis_jax.errors import ConfigError

I = 4


@pytest.fixture(autouse=True)
def _strict_dtypes():
    # Implicit dtype promotion inside the cluster code would be a silent int/float mix-up.
    with jax.numpy_dtype_promotion("strict"):
        yield


def live_signals(qd, bs=None, kvu=None) -> sg.InstanceSignals:
    qd = np.asarray(qd, np.int64)
    n = qd.shape[0]
    zi = jnp.zeros(n, jnp.int64)
    return sg.InstanceSignals(
        queue_depth=jnp.asarray(qd),
        batch_size=zi if bs is None else jnp.asarray(bs, jnp.int64),
        kv_utilization=jnp.zeros(n, jnp.float64) if kvu is None else jnp.asarray(kvu, jnp.float64),
        free_kv_blocks=zi + 7, kv_tokens_in_use=zi + 3, kv_tokens_capacity=zi + 9,
        cache_hit_rate=jnp.full(n, 0.25), preemption_count=zi + 2,
    )


def qd_of(snapshot):
    return np.asarray(snapshot.signals.queue_depth).tolist()


def test_first_interval_sees_empty_instances():
    # Cache starts all-zero with last_refresh 0: a query before 50 ms does not re-read.
    snap = sg.init_snapshot(I, 50_000)
    for t in (0, 1, 49_999):
        snap = sg.refresh(snap, live_signals([5, 6, 7, 8]), t)
        assert qd_of(snap) == [0, 0, 0, 0]
        assert np.asarray(snap.last_refresh).tolist() == [0] * I
    chex.assert_trees_all_equal(snap.signals, sg.zero_signals(I))


def test_lazy_refresh_on_query_not_on_a_grid():
    snap = sg.init_snapshot(I, 50_000)
    # 70 ms: 70 ms since t=0 >= 50 ms -> re-read, stamped 70 ms (not 50 ms).
    snap = sg.refresh(snap, live_signals([1, 1, 1, 1]), 70_000)
    assert qd_of(snap) == [1, 1, 1, 1]
    assert np.asarray(snap.last_refresh).tolist() == [70_000] * I
    # 100 ms: a grid refresh would fire here; the lazy rule sees only 30 ms -> stale.
    snap = sg.refresh(snap, live_signals([2, 2, 2, 2]), 100_000)
    assert qd_of(snap) == [1, 1, 1, 1]
    # 119.999 ms: 49.999 ms since the read -> still stale; 120 ms: exactly the interval -> read.
    snap = sg.refresh(snap, live_signals([3, 3, 3, 3]), 119_999)
    assert qd_of(snap) == [1, 1, 1, 1]
    snap = sg.refresh(snap, live_signals([4, 4, 4, 4]), 120_000)
    assert qd_of(snap) == [4, 4, 4, 4]
    assert np.asarray(snap.last_refresh).tolist() == [120_000] * I


def test_all_fields_refresh_together():
    snap = sg.refresh(sg.init_snapshot(I, 10), live_signals([1, 2, 3, 4], bs=[5, 6, 7, 8], kvu=[0.1] * 4), 10)
    chex.assert_trees_all_equal(snap.signals, live_signals([1, 2, 3, 4], bs=[5, 6, 7, 8], kvu=[0.1] * 4))


def test_zero_interval_is_live():
    snap = sg.init_snapshot(I, 0)
    for t, qd in ((0, [1, 0, 0, 0]), (0, [2, 0, 0, 0]), (5, [3, 1, 4, 1])):
        snap = sg.refresh(snap, live_signals(qd), t)
        assert qd_of(snap) == qd


def test_only_queried_instances_are_read():
    # Non-routable instances are not in the RouterState, so their cache and stamp stay.
    snap = sg.init_snapshot(I, 50_000)
    queried = jnp.asarray([True, False, True, False])
    snap = sg.refresh(snap, live_signals([1, 2, 3, 4]), 60_000, queried)
    assert qd_of(snap) == [1, 0, 3, 0]
    assert np.asarray(snap.last_refresh).tolist() == [60_000, 0, 60_000, 0]
    # Instance 1 is queried at 80 ms: due (80 ms since 0); instance 0 is not (20 ms since 60).
    snap = sg.refresh(snap, live_signals([9, 9, 9, 9]), 80_000, jnp.ones(I, bool))
    assert qd_of(snap) == [1, 9, 3, 9]
    assert np.asarray(snap.last_refresh).tolist() == [60_000, 80_000, 60_000, 80_000]


def test_router_state_in_flight_is_live_and_effective_load():
    snap = sg.init_snapshot(I, 50_000)
    snap = sg.refresh(snap, live_signals([5, 5, 5, 5]), 10)  # stale: still zero
    rs = sg.router_state(snap, jnp.asarray([0, 3, 1, 2]), jnp.ones(I, bool))
    # In-flight is router-owned and never cached, so it shows while QD/BS are still stale.
    assert np.asarray(sg.effective_load(rs)).tolist() == [0, 3, 1, 2]
    snap = sg.refresh(snap, live_signals([1, 2, 3, 4], bs=[10, 0, 0, 1]), 50_000)
    rs = sg.router_state(snap, jnp.asarray([0, 3, 1, 2]), jnp.ones(I, bool))
    assert np.asarray(sg.effective_load(rs)).tolist() == [11, 5, 4, 7]


def test_cache_signal_frozen_then_refreshed_together():
    empty = {"keys": jnp.full((I, 3), -1, jnp.int64)}
    cs = sg.init_cache_signal(empty, 50_000)
    live = {"keys": jnp.arange(I * 3, dtype=jnp.int64).reshape(I, 3)}
    cs = sg.refresh_cache_signal(cs, live, 49_999)
    chex.assert_trees_all_equal(cs.frozen, empty)  # frozen at construction (empty caches)
    cs = sg.refresh_cache_signal(cs, live, 50_000)
    chex.assert_trees_all_equal(cs.frozen, live)  # every instance re-frozen at once
    assert int(cs.last_us) == 50_000
    later = {"keys": live["keys"] + 100}
    cs = sg.refresh_cache_signal(cs, later, 99_999)
    chex.assert_trees_all_equal(cs.frozen, live)
    cs = sg.refresh_cache_signal(cs, later, 100_000)
    chex.assert_trees_all_equal(cs.frozen, later)


def test_cache_signal_zero_delay_is_live():
    cs = sg.init_cache_signal(jnp.zeros(I, jnp.int64), 0)
    for t, v in ((0, 1), (0, 2), (3, 5)):
        cs = sg.refresh_cache_signal(cs, jnp.full(I, v, jnp.int64), t)
        assert np.asarray(cs.frozen).tolist() == [v] * I


@pytest.mark.parametrize("bad", [-1, 1.5, True, "50"])
def test_bad_intervals_raise(bad):
    with pytest.raises(ConfigError, match="--snapshot-refresh-interval"):
        sg.init_snapshot(I, bad)
    with pytest.raises(ConfigError, match="--cache-signal-delay"):
        sg.init_cache_signal(jnp.zeros(I), bad)


def _query_sequence(snap, qds, times):
    for qd, t in zip(qds, times):
        snap = sg.refresh(snap, live_signals(qd), t)
    return snap


def test_jit_matches_eager_and_no_retrace():
    rng = np.random.default_rng(0)
    times = np.cumsum(rng.integers(0, 40_000, 30))
    qds = rng.integers(0, 50, (30, I))
    eager = _query_sequence(sg.init_snapshot(I, 50_000), qds, times)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(snap, live, t):
        return sg.refresh(snap, live, t)

    snap = sg.init_snapshot(I, 50_000)
    for qd, t in zip(qds, times):
        snap = step(snap, live_signals(qd), jnp.asarray(t, jnp.int64))
    chex.assert_trees_all_equal(snap, eager)
    # A different interval is a new value, not a new program.
    step(sg.init_snapshot(I, 7), live_signals(qds[0]), jnp.asarray(1, jnp.int64))


def test_vmap_over_scenarios_matches_loop():
    # Three clusters with different intervals, refreshed at different times.
    intervals = [0, 25, 100]
    snaps = [sg.init_snapshot(I, iv) for iv in intervals]
    lives = [live_signals([k, k + 1, k + 2, k + 3]) for k in range(3)]
    times = [jnp.asarray(t, jnp.int64) for t in (10, 30, 60)]
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
    batched = jax.vmap(sg.refresh)(stack(snaps), stack(lives), jnp.stack(times))
    looped = stack([sg.refresh(s, lv, t) for s, lv, t in zip(snaps, lives, times)])
    chex.assert_trees_all_equal(batched, looped)
    # Interval 0 and 25 (30 >= 25) refresh; interval 100 at t=60 does not.
    assert np.asarray(batched.signals.queue_depth[:, 0]).tolist() == [0, 1, 0]
