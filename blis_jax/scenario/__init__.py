"""Scenarios: configuration (plain values) → resolved scenario → simulation result."""

from blis_jax.scenario.config import (
    Deployment,
    EngineSettings,
    LoraSettings,
    ScenarioConfig,
    SpecWorkload,
    SyntheticWorkload,
    TraceWorkload,
)
from blis_jax.naming import name, naming
from blis_jax.scenario.resolve import ResolvedScenario, ScenarioWarning, resolve, resolve_deployment
from blis_jax.scenario.simulate import SimulationResult, simulate

__all__ = [
    "Deployment", "EngineSettings", "LoraSettings", "ResolvedScenario", "ScenarioConfig", "ScenarioWarning", "SimulationResult",
    "SpecWorkload", "SyntheticWorkload", "TraceWorkload", "name", "naming", "resolve", "resolve_deployment",
    "simulate",
]
