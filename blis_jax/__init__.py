"""blis-jax: a vectorized batch-step simulator of LLM inference serving.

The public API (everything in `__all__`):

* configure a scenario in plain Python: `ScenarioConfig(deployment=Deployment(...),
  engine=EngineSettings(...), workload=SyntheticWorkload(...) | SpecWorkload(...) |
  TraceWorkload(...), cluster=ClusterConfig(...), horizon_us=..., seed=...,
  lora=LoraSettings(...), policy_config=...)`, validated on construction (`ConfigError` names the field); node pools
  and the instance lifecycle: `ClusterConfig(node_pools=(NodePool(...),),
  instance_lifecycle=InstanceLifecycle(loading_delay=Delay(mean, stddev)))`, or a BLIS
  policy bundle (`PolicyBundle`, `load_policy_bundle(path)`, or a YAML path); the autoscaler:
  `ClusterConfig(autoscaler=AutoscalerConfig(interval_us=..., analyzer=AnalyzerConfig(...)))`;
* `resolve(config) -> ResolvedScenario` (model, GPU, latency model, requests) and
  `simulate(config_or_resolved) -> SimulationResult` (`.metrics`, `.records`, `.report()`);
* `simulate_batch([...]) -> [SimulationResult]`: many single-instance scenarios as one
  batched, sharded call;
* `fixed_schedule_metrics(config, metrics)` / `metric_gradient(config, metric)`: metrics as
  differentiable JAX functions of the trained-physics coefficients, the simulated schedule
  held fixed.

JAX configuration. Importing `blis_jax` turns on `jax_enable_x64` for the whole process, before
any array can be created. This is deliberate: simulated time is int64 microseconds and latency
maths is float64 (float32 time is wrong after ~17 s of simulated time), and arrays a caller
builds for the engine (coefficients, say) must already be 64-bit when they are created. Code in
the same process that relies on JAX's 32-bit defaults should request its dtypes explicitly
(`jnp.float32`), or run blis-jax in its own process. Nothing else in JAX's configuration is
changed at import.

The names are loaded on first use (module `__getattr__`), so `import blis_jax` costs little
more than `import jax`.
"""

import importlib
from typing import TYPE_CHECKING

import jax as _jax

_jax.config.update("jax_enable_x64", True)

__version__ = "0.1.0"

# public name → module that defines it
_EXPORTS = {
    "ScenarioConfig": "blis_jax.scenario.config",
    "Deployment": "blis_jax.scenario.config",
    "EngineSettings": "blis_jax.scenario.config",
    "SyntheticWorkload": "blis_jax.scenario.config",
    "SpecWorkload": "blis_jax.scenario.config",
    "TraceWorkload": "blis_jax.scenario.config",
    "LoraSettings": "blis_jax.scenario.config",
    "ClusterConfig": "blis_jax.cluster.simulate",
    "NodePool": "blis_jax.cluster.node_pools",
    "InstanceLifecycle": "blis_jax.cluster.node_pools",
    "Delay": "blis_jax.cluster.node_pools",
    "AutoscalerConfig": "blis_jax.cluster.autoscaler",
    "AnalyzerConfig": "blis_jax.cluster.autoscaler",
    "PolicyBundle": "blis_jax.config.policy_bundle",
    "load_policy_bundle": "blis_jax.config.policy_bundle",
    "GaussianLength": "blis_jax.workload.distribution",
    "resolve": "blis_jax.scenario.resolve",
    "ResolvedScenario": "blis_jax.scenario.resolve",
    "ScenarioWarning": "blis_jax.scenario.resolve",
    "simulate": "blis_jax.scenario.simulate",
    "SimulationResult": "blis_jax.scenario.simulate",
    "simulate_batch": "blis_jax.scenario.batch",
    "fixed_schedule_metrics": "blis_jax.scenario.gradient",
    "FixedScheduleMetrics": "blis_jax.scenario.gradient",
    "metric_gradient": "blis_jax.scenario.gradient",
    "differentiable_metrics": "blis_jax.scenario.gradient",
    "ConfigError": "blis_jax.errors",
    "SimulationFailed": "blis_jax.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from blis_jax.cluster.autoscaler import AnalyzerConfig as AnalyzerConfig, AutoscalerConfig as AutoscalerConfig
    from blis_jax.cluster.node_pools import (
        Delay as Delay,
        InstanceLifecycle as InstanceLifecycle,
        NodePool as NodePool,
    )
    from blis_jax.cluster.simulate import ClusterConfig as ClusterConfig
    from blis_jax.config.policy_bundle import PolicyBundle as PolicyBundle, load_policy_bundle as load_policy_bundle
    from blis_jax.errors import ConfigError as ConfigError, SimulationFailed as SimulationFailed
    from blis_jax.scenario.batch import simulate_batch as simulate_batch
    from blis_jax.scenario.config import (
        Deployment as Deployment,
        EngineSettings as EngineSettings,
        LoraSettings as LoraSettings,
        ScenarioConfig as ScenarioConfig,
        SpecWorkload as SpecWorkload,
        SyntheticWorkload as SyntheticWorkload,
        TraceWorkload as TraceWorkload,
    )
    from blis_jax.scenario.gradient import (
        FixedScheduleMetrics as FixedScheduleMetrics,
        differentiable_metrics as differentiable_metrics,
        fixed_schedule_metrics as fixed_schedule_metrics,
        metric_gradient as metric_gradient,
    )
    from blis_jax.scenario.resolve import (
        ResolvedScenario as ResolvedScenario,
        ScenarioWarning as ScenarioWarning,
        resolve as resolve,
    )
    from blis_jax.scenario.simulate import SimulationResult as SimulationResult, simulate as simulate
    from blis_jax.workload.distribution import GaussianLength as GaussianLength


def __getattr__(attr: str):
    module = _EXPORTS.get(attr)
    if module is None:
        raise AttributeError(f"module 'blis_jax' has no attribute {attr!r}")
    value = getattr(importlib.import_module(module), attr)
    globals()[attr] = value   # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
