"""Autoscaler and lifecycle sweep axes (sweep/scaling_axes.py), the instance timeline
(cluster/timeline.py) and its plot (sweep/instance_plot.py): fast unit tests, nothing compiled
but a few tiny array functions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster import timeline
from blis_jax.cluster.autoscaler import AutoscalerConfig
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.errors import ConfigError
from blis_jax.scenario import ScenarioConfig
from blis_jax.sweep import instance_plot, scaling_axes
from blis_jax.sweep.grid import parse_grid
from blis_jax.sweep.table import SweepTable

A, L, D, T = lc.ACTIVE, lc.LOADING, lc.DRAINING, lc.TERMINATED


def pooled(autoscaler=AutoscalerConfig(interval_us=1_000_000), flag=None) -> ScenarioConfig:
    pool = NodePool(name="p", gpu_type="H100", gpus_per_node=2, gpu_memory_gib=80.0, initial_nodes=1, max_nodes=1)
    return ScenarioConfig(cluster=ClusterConfig(
        num_instances=1, node_pools=(pool,), autoscaler=autoscaler, model_autoscaler_interval_us=flag,
        instance_lifecycle=InstanceLifecycle(loading_delay=Delay(mean=3.0))))


def test_axis_keys_are_bundle_keys_with_dashes_or_underscores():
    grid = parse_grid({"base": {"autoscaler.analyzer.scale-down-boundary": 0.2},
                       "axes": {"autoscaler.analyzer.scale-up-threshold": [0.5, 0.9],
                                "node_pools[0].initial-nodes": [1, 3]}})
    assert grid.axes == ("autoscaler.analyzer.scale_up_threshold", "node_pools[0].initial_nodes")
    specs = grid.scenarios()
    assert len(specs) == 4
    assert specs[3].settings == {"autoscaler.analyzer.scale_down_boundary": 0.2,
                                 "autoscaler.analyzer.scale_up_threshold": 0.9, "node_pools[0].initial_nodes": 3}
    assert isinstance(specs[3].settings["node_pools[0].initial_nodes"], int)


@pytest.mark.parametrize("axes, fragment", [
    ({"autoscaler.analyzer.scale_up_threshold": ["high"]}, "must be a finite number"),
    ({"autoscaler.interval_us": [-1]}, "must be >= 0"),
    ({"node_pools[0].gpus_per_node": [1.5]}, "must be an integer >= 1"),
    ({"node_pools[0].initial_nodes": [0]}, "must be an integer >= 1"),
    ({"autoscaler.analyzer.scale_up_threshold": [0.5, 0.5]}, "duplicate value"),
])
def test_bad_axis_values_name_the_axis(axes, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        parse_grid({"axes": axes}, source="g.yaml")
    assert next(iter(axes)) in str(e.value)


def test_apply_sets_each_number_and_validates_as_the_bundle():
    values = {"autoscaler.analyzer.scale_up_threshold": 0.7, "autoscaler.scale_down_stabilization_window_us": 5e6,
              "autoscaler.hpa_scrape_delay.mean": 0.25, "instance_lifecycle.loading_delay.stddev": 1.5,
              "node_pools[0].initial_nodes": 4, "node_pools[0].gpus_per_node": 8}
    c = scaling_axes.apply(pooled(), values, "s").cluster
    assert c.autoscaler.analyzer.scale_up_threshold == 0.7
    assert c.autoscaler.analyzer.scale_down_boundary == 0.0  # untouched: BLIS's default fills it
    assert c.autoscaler.scale_down_stabilization_window_us == 5e6
    assert c.autoscaler.hpa_scrape_delay == Delay(mean=0.25)
    assert c.autoscaler.interval_us == 1_000_000
    assert c.instance_lifecycle.loading_delay == Delay(mean=3.0, stddev=1.5)
    pool = c.node_pools[0]
    assert (pool.initial_nodes, pool.max_nodes, pool.gpus_per_node) == (4, 4, 8)
    # the bundle's own rule: the scale-down boundary must stay below the scale-up threshold
    with pytest.raises(ConfigError, match="scale_down_boundary"):
        scaling_axes.apply(pooled(), {"autoscaler.analyzer.scale_up_threshold": 0.3}, "s")


def test_apply_keeps_the_flag_interval_and_refuses_what_is_not_there():
    # --model-autoscaler-interval-us alone: an autoscaler with default settings, now with the axis value
    config = pooled(autoscaler=None, flag=2e6)
    c = scaling_axes.apply(config, {"autoscaler.analyzer.kv_cache_threshold": 0.5}, "s").cluster
    assert c.effective_autoscaler().interval_us == 2e6 and c.effective_autoscaler().analyzer.kv_cache_threshold == 0.5
    # the interval axis replaces the flag's value
    c = scaling_axes.apply(pooled(flag=2e6), {"autoscaler.interval_us": 5e5}, "s").cluster
    assert c.effective_autoscaler().interval_us == 5e5
    with pytest.raises(ConfigError, match="no autoscaler"):
        scaling_axes.apply(pooled(autoscaler=None), {"autoscaler.analyzer.kv_cache_threshold": 0.5}, "s")
    with pytest.raises(ConfigError, match=r"1 node pool\(s\)"):
        scaling_axes.apply(pooled(), {"node_pools[1].initial_nodes": 2}, "s")


def test_timeline_records_each_state_entry_once():
    entered = timeline.initial(jnp.asarray([A, L, lc.ABSENT]))
    assert entered.tolist() == [[-1, -1, -1, -1, 0, -1, -1], [-1, -1, 0, -1, -1, -1, -1], [-1] * 7]
    entered = timeline.record(entered, jnp.asarray([A, L, lc.ABSENT]), jnp.asarray([A, A, L]), 7)
    entered = timeline.record(entered, jnp.asarray([A, A, L]), jnp.asarray([D, A, L]), jnp.asarray([9, 9, 9]))
    assert entered.tolist() == [[-1, -1, -1, -1, 0, 9, -1], [-1, -1, 0, -1, 7, -1, -1], [-1, -1, 7, -1, -1, -1, -1]]


def test_counts_are_step_functions_of_the_entries():
    never = -1
    entered = np.full((3, timeline.NUM_STATES), never)
    entered[0, [A, D, T]] = [0, 40, 55]       # startup instance: drained at 40, gone at 55
    entered[1, [L, A]] = [0, 10]               # loading until 10
    entered[2, [L, A, D]] = [20, 30, 50]       # the autoscaler's: placed at 20
    c = timeline.counts(entered, end_us=60)
    assert c["time_us"].tolist() == [0, 10, 20, 30, 40, 50, 55, 60]
    assert c["routable"].tolist() == [1, 2, 2, 3, 2, 1, 1, 1]
    assert c["loading"].tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    assert c["draining"].tolist() == [0, 0, 0, 0, 1, 2, 1, 1]
    assert c["terminated"].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]


def test_instance_plot_is_written_only_for_autoscaled_scenarios(tmp_path):
    entered = np.full((2, timeline.NUM_STATES), -1)
    entered[0, A], entered[1, [L, A]] = 0, [1_000_000, 2_000_000]
    counts = timeline.counts(entered, 3_000_000)
    rows = ({"scenario": 0, "x": 1, "result": "ok"}, {"scenario": 1, "x": 2, "result": "ok"})
    assert instance_plot.write_sweep_instance_counts(SweepTable(axes=("x",), rows=rows), tmp_path) == []
    table = SweepTable(axes=("x",), rows=rows, timelines={1: counts})
    (path,) = instance_plot.write_sweep_instance_counts(table, tmp_path)
    assert path.name == "instance_counts.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
