"""Simulate many single-instance scenarios as one batched call: `simulate_batch(configs)`.

Each scenario becomes a lane of the sweep's batch runner (`blis_jax.sweep.batch.run_lanes`):
lanes that share a compiled program (same latency-model structure, block size, scheduler and
preemption policy) run together at one shape covering all of them, vmapped on an accelerator
and sharded over the devices (on CPU each device runs its lanes one after another, which
XLA:CPU runs faster than a vmap; `max_batch` asks for a vmap there too). A larger shape never
changes what is simulated, so every result equals the one `simulate` gives for the same
scenario; a lane that overflows its buffers is rerun at grown ones, as `simulate` does.
"""

from __future__ import annotations

from collections.abc import Sequence

from blis_jax.errors import ConfigError, SimulationFailed
from blis_jax.scenario.config import ScenarioConfig
from blis_jax.scenario.resolve import ResolvedScenario, Warn, resolve
from blis_jax.scenario.simulate import SimulationResult


def _lane(index: int, scenario: ResolvedScenario):
    from blis_jax.sweep.lane import InstanceLane, SessionLane

    if scenario.requests is None:
        raise ConfigError(f"simulate_batch: scenario {index} has no requests (resolve a ScenarioConfig with a "
                          "workload)")
    if not scenario.single_instance:
        raise ConfigError(f"simulate_batch: scenario {index} is a cluster (cluster.num_instances "
                          f"{scenario.cluster.num_instances}, admission {scenario.cluster.admission_policy!r}); "
                          "batches run single-instance scenarios for now: simulate it with `simulate`, or "
                          "use `blis-jax sweep` for cluster grids")
    if scenario.lora is not None:
        raise ConfigError(f"simulate_batch: scenario {index} has LoRA adapters, which batches do not simulate yet; "
                          "simulate it with `simulate`")
    if scenario.cpu_tier is not None:
        raise ConfigError(f"simulate_batch: scenario {index} has a CPU KV tier, which batches do not simulate yet; "
                          "simulate it with `simulate`")
    if scenario.offload is not None:
        raise ConfigError(f"simulate_batch: scenario {index} has a multi-tier KV offload chain, which batches do not "
                          "simulate yet; simulate it with `simulate`")
    settings = dict(requests=scenario.requests, params=scenario.params, model=scenario.latency_model,
                    block_size=scenario.block_size, scheduler=scenario.scheduler,
                    preemption_policy=scenario.preemption_policy)
    if scenario.sessions is not None:
        return SessionLane(links=scenario.sessions, **settings)
    return InstanceLane(**settings)


def simulate_batch(scenarios: Sequence[ScenarioConfig | ResolvedScenario], *, max_batch: int | None = None,
                   devices: Sequence | None = None, warn: Warn | None = None) -> list[SimulationResult]:
    """Simulate every scenario in one batched, sharded call; returns one `SimulationResult`
    per scenario, in order, each equal to `simulate(scenario)`.

    Scenarios may differ in anything (workload, rate, engine settings, coefficients, seed);
    those with the same latency-model structure and static engine options share one compiled
    program. `max_batch` caps the lanes vmapped together (and asks for a vmap on CPU too);
    `devices` (default: all local devices) are the devices the lanes are sharded over; `warn`
    is passed to `resolve`. Cluster scenarios are refused with a `ConfigError` (simulate them
    one by one with `simulate`). Raises `SimulationFailed` when a scenario's engine could not
    finish."""
    from blis_jax.engine import results as result_codes
    from blis_jax.sweep.batch import run_lanes
    from blis_jax.sweep.lane import SessionLane

    resolved = [resolve(s, warn=warn) if isinstance(s, ScenarioConfig) else s for s in scenarios]
    lanes = [_lane(i, s) for i, s in enumerate(resolved)]
    if not lanes:
        return []
    outputs = run_lanes(lanes, lambda _, result: result, max_batch=max_batch, devices=devices)
    results = []
    for i, (scenario, lane, output) in enumerate(zip(resolved, lanes, outputs)):
        requests, out = output if isinstance(lane, SessionLane) else (scenario.requests, output)
        if out.result != result_codes.OK:
            raise SimulationFailed(f"simulate_batch: scenario {i}: the engine stopped early "
                                   f"({result_codes.describe(out.result)})")
        results.append(SimulationResult(scenario=scenario, requests=requests, output=out))
    return results
