"""Autoscaler and lifecycle axes: policy-bundle keys swept as numbers.

    axes:
      autoscaler.analyzer.scale_up_threshold: [0.6, 0.8]
      autoscaler.scale_down_stabilization_window_us: [0, 30000000]
      instance_lifecycle.loading_delay.mean: [5, 30]       # seconds, as in the bundle
      node_pools[0].initial_nodes: [2, 4]

An axis key is the bundle key it sets (blis-infra §6; dashes accepted for underscores). The
scenario's own autoscaler, node pools and lifecycle (its `policy-config` bundle, or
`model-autoscaler-interval-us` for an autoscaler with default settings) are the base; each axis
value replaces one number of them, and the result is validated as the bundle would be. These
numbers are arrays of the cluster program, so the scenarios of such a grid run as one batched
program (`scaling_batch.py`). Structure is not an axis: the number of pools, their GPU types
and the instance count stay those of the base.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from blis_jax.cluster.autoscaler import AutoscalerConfig
from blis_jax.errors import ConfigError

# key → (section, path inside it, kind)
_FIXED = {
    "autoscaler.interval_us": ("autoscaler", ("interval_us",), float),
    "autoscaler.scale_up_stabilization_window_us": ("autoscaler", ("scale_up_stabilization_window_us",), float),
    "autoscaler.scale_down_stabilization_window_us": ("autoscaler", ("scale_down_stabilization_window_us",), float),
    "autoscaler.hpa_scrape_delay.mean": ("autoscaler", ("hpa_scrape_delay", "mean"), float),
    "autoscaler.hpa_scrape_delay.stddev": ("autoscaler", ("hpa_scrape_delay", "stddev"), float),
    "autoscaler.analyzer.kv_cache_threshold": ("autoscaler", ("analyzer", "kv_cache_threshold"), float),
    "autoscaler.analyzer.scale_up_threshold": ("autoscaler", ("analyzer", "scale_up_threshold"), float),
    "autoscaler.analyzer.scale_down_boundary": ("autoscaler", ("analyzer", "scale_down_boundary"), float),
    "autoscaler.analyzer.avg_input_tokens": ("autoscaler", ("analyzer", "avg_input_tokens"), float),
    "instance_lifecycle.loading_delay.mean": ("instance_lifecycle", ("loading_delay", "mean"), float),
    "instance_lifecycle.loading_delay.stddev": ("instance_lifecycle", ("loading_delay", "stddev"), float),
}
_POOL = re.compile(r"^node_pools\[(\d+)\]\.(initial_nodes|gpus_per_node)$")
KEYS = (*_FIXED, "node_pools[i].initial_nodes", "node_pools[i].gpus_per_node")


def canonical(key: Any) -> str | None:
    """The axis key `key` names (dashes read as underscores), else None."""
    if not isinstance(key, str):
        return None
    name = key.strip().replace("-", "_")
    return name if name in _FIXED or _POOL.match(name) else None


def is_scaling_axis(key: Any) -> bool:
    return canonical(key) is not None


def check_value(key: str, value: Any, where: str) -> float | int:
    """A number for axis `key`: an integer >= 1 for pool sizes, else a finite number >= 0 (the
    bundle's own checks run when the scenario is built)."""
    at = f"{where}.{key}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{at}: {value!r} must be a finite number")
    if _POOL.match(key):
        if not float(value).is_integer() or value < 1:
            raise ConfigError(f"{at}: {value!r} must be an integer >= 1")
        return int(value)
    if value < 0:
        raise ConfigError(f"{at}: {value!r} must be >= 0")
    return float(value)


def split(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run settings, scaling axis values) of a scenario's settings."""
    run = {k: v for k, v in settings.items() if not is_scaling_axis(k)}
    return run, {canonical(k): v for k, v in settings.items() if is_scaling_axis(k)}


def _replace_path(obj, path: tuple[str, ...], value):
    if len(path) == 1:
        return dataclasses.replace(obj, **{path[0]: value})
    return dataclasses.replace(obj, **{path[0]: _replace_path(getattr(obj, path[0]), path[1:], value)})


def apply(config, values: Mapping[str, Any], where: str, warn=None):
    """`config` (a ScenarioConfig) with its policy bundle applied and the axis `values` set in
    its cluster's autoscaler, instance lifecycle and node pools."""
    if not values:
        return config
    from blis_jax.scenario.policy import apply_policy_bundle

    try:
        config = apply_policy_bundle(config, warn)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    cluster = config.cluster
    autoscaler = cluster.autoscaler
    changes: dict[str, Any] = {}
    for key, value in values.items():
        pool = _POOL.match(key)
        if pool is not None:
            index, field = int(pool.group(1)), pool.group(2)
            pools = list(changes.get("node_pools", cluster.node_pools))
            if index >= len(pools):
                raise ConfigError(f"{where}.{key}: the scenario has {len(pools)} node pool(s) (indices 0.."
                                  f"{len(pools) - 1}); give node_pools in its policy-config")
            p = dataclasses.replace(pools[index], **{field: value})
            if field == "initial_nodes":  # nodes are never provisioned: max_nodes is validated only
                p = dataclasses.replace(p, max_nodes=max(p.max_nodes, value), min_nodes=min(p.min_nodes, value))
            pools[index] = p
            changes["node_pools"] = tuple(pools)
            continue
        section, path, _ = _FIXED[key]
        if section == "autoscaler":
            if autoscaler is None or autoscaler.interval_us <= 0:
                flag = cluster.model_autoscaler_interval_us
                if not flag and key != "autoscaler.interval_us":
                    raise ConfigError(f"{where}.{key}: the scenario has no autoscaler; give policy-config with an "
                                      "autoscaler section, or model-autoscaler-interval-us")
                autoscaler = AutoscalerConfig(interval_us=float(flag or 0))
            autoscaler = _replace_path(autoscaler, path, value)
            if key == "autoscaler.interval_us":  # the axis is the interval: the flag must not override it
                changes["model_autoscaler_interval_us"] = None
            changes["autoscaler"] = autoscaler
        else:
            lifecycle = changes.get("instance_lifecycle", cluster.instance_lifecycle)
            changes["instance_lifecycle"] = _replace_path(lifecycle, path, value)
    cluster = dataclasses.replace(cluster, **changes)
    try:
        cluster.validate()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return dataclasses.replace(config, cluster=cluster)
