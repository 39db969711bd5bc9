"""Simulate a scenario: `simulate(ScenarioConfig(...))` → `SimulationResult`.

The engine behind it is chosen by the scenario: the single-instance engine (one instance,
always-admit, no admission or routing latency, no gateway queue), its closed-loop variant when
the workload has sessions, else the cluster loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path

from blis_jax.errors import ConfigError, SimulationFailed
from blis_jax.scenario.config import ScenarioConfig, TraceWorkload
from blis_jax.naming import name
from blis_jax.scenario.resolve import ResolvedScenario, Warn, _python_warning, resolve

Progress = Callable[[int, int, int], None]   # (finished requests, total requests, simulated µs)


@dataclasses.dataclass(frozen=True, eq=False)
class SimulationResult:
    """One simulation's outcome: the requests that existed (closed-loop rounds included, in
    arrival order), the engine's per-request output (`SimOutput`) and, for PD clusters, what
    each instance served (`views`)."""

    scenario: ResolvedScenario
    requests: object          # RequestSet aligned with `output`
    output: object            # SimOutput
    views: object | None = None

    @functools.cached_property
    def metrics(self) -> Mapping:
        """BLIS's MetricsOutput block for the whole cluster (`=== Simulation Metrics ===`),
        with the goodput fields when the workload sets SLO targets."""
        from blis_jax.metrics import metrics_output

        return metrics_output(self.output, self.requests, goodput_targets=self.scenario.goodput_targets)

    def instance_metrics(self, instance: int) -> Mapping:
        """The MetricsOutput block of one instance."""
        from blis_jax.metrics import metrics_output

        view, rows = self.output, self.requests
        if self.views is not None:
            view = self.views.outputs[instance]
            rows = (self.views.requests[instance] if self.views.requests else None) or self.requests
        return metrics_output(view, rows, instance)

    @property
    def records(self) -> list[dict]:
        """Per-request records, as in the `--metrics-path` file."""
        from blis_jax.metrics import request_records

        return request_records(self.output, self.requests)

    def report(self) -> str:
        """The text `blis-jax run` prints: the metrics blocks and the sections that apply."""
        from blis_jax.output import format_pd_section, pd_summary, render_stdout

        extra = {}
        if self.views is not None:
            extra = dict(instance_outputs=self.views.outputs, instance_requests=self.views.requests,
                         extra_sections=(format_pd_section(pd_summary(self.output, self.views)),))
        return render_stdout(self.output, self.requests, scheduler=self.scenario.scheduler,
                             goodput_targets=self.scenario.goodput_targets,
                             per_instance_blocks=self.scenario.cluster.num_instances > 1, **extra)

    def write_metrics(self, path: str | Path) -> None:
        """The aggregate JSON with `cache_hit_rate` and per-request records (`--metrics-path`)."""
        from blis_jax.output import write_metrics_file

        write_metrics_file(path, self.output, self.requests, self.scenario.goodput_targets)

    def write_results(self, path: str | Path) -> None:
        """Per-request results of completed requests (`--results-path`)."""
        from blis_jax.output import write_results_file

        write_results_file(path, self.output, self.requests)

    def write_trace(self, prefix: str | Path):
        """The simulated requests as a TraceV2 (`<prefix>.yaml`, `<prefix>.csv`)."""
        from blis_jax.output import pd_trace_outcomes
        from blis_jax.workload.tracev2 import write_trace

        outcomes = self.output if self.views is None else pd_trace_outcomes(self.output, self.views)
        return write_trace(prefix, self.scenario.header, self.requests, outcomes)


def _warm_up_note(resolved) -> str:
    """What else makes a scenario a cluster one: a warm-up runs in the cluster loop only."""
    if resolved.cluster is None or not resolved.cluster.warm_up_request_count:
        return ""
    return f" (a warm-up, {name('cluster.warm_up_request_count')} > 0, runs in the cluster loop only: drop it)"


def simulate(scenario: ScenarioConfig | ResolvedScenario, *, progress: Progress | None = None,
             events_per_chunk: int | None = None, warn: Warn | None = None) -> SimulationResult:
    """Simulate a scenario (a `ScenarioConfig` is resolved first; `warn` as in `resolve`).
    `progress(finished, total, simulated_us)` is called between chunks of `events_per_chunk`
    engine events. Raises `ConfigError` for bad input, `SimulationFailed` when the engine
    could not finish."""
    from blis_jax.cluster.simulate import simulate_cluster_views, unservable_models
    from blis_jax.engine import results as result_codes
    from blis_jax.engine.simulate import simulate_instance, simulate_sessions

    resolved = resolve(scenario, warn=warn) if isinstance(scenario, ScenarioConfig) else scenario
    if resolved.requests is None:
        raise ConfigError("simulate: the scenario has no requests (resolve a ScenarioConfig with a workload)")
    settings: dict = dict(block_size=resolved.block_size, scheduler=resolved.scheduler,
                          preemption_policy=resolved.preemption_policy)
    if progress is not None:
        settings["progress"] = progress
    if events_per_chunk is not None:
        settings["events_per_chunk"] = events_per_chunk
    if resolved.lora is not None:
        settings["lora"] = resolved.lora
    if resolved.cpu_tier is not None:
        if resolved.sessions is not None:
            raise ConfigError(f"{name('deployment.kv_cpu_blocks')}: the CPU KV tier is simulated without "
                              "closed-loop sessions for now; drop it or the sessions")
        settings["cpu_tier"] = resolved.cpu_tier
    if resolved.offload is not None:
        if resolved.sessions is not None:
            raise ConfigError(f"{_offload_source(resolved)}: the multi-tier KV offload chain is simulated without "
                              "closed-loop sessions for now; drop the sessions or the offload configuration")
        # the chain's jitter draws come from the run seed's kv-offload stream (blis-rng §10.3)
        settings.update(offload=resolved.offload, seed=resolved.cluster.seed)
    params, model, requests, views = resolved.params, resolved.latency_model, resolved.requests, None
    if resolved.sessions is not None:
        served = resolved.cluster.served_model
        if unservable_models(requests, served):
            raise ConfigError(f"{name('workload.spec')}: closed-loop sessions tagged with a model other than {served!r} "
                              f"(the instances' model, {name('deployment.model')} lower-cased) would be rejected at "
                              "routing, which the session engine does not simulate; tag them with that model or none")
        if not resolved.single_instance:
            raise ConfigError(f"{name('workload.spec')}: closed-loop sessions run on one instance with always-admit "
                              f"for now; use {name('cluster.num_instances')} 1 and {name('cluster.admission_policy')} "
                              f"always-admit, without {name('cluster.admission_latency_us')}, "
                              f"{name('cluster.routing_latency_us')} or {name('cluster.flow_control')}"
                              + _warm_up_note(resolved))
        requests, out = simulate_sessions(requests, resolved.sessions, params, model, **settings)
    elif resolved.single_instance:
        out = simulate_instance(requests, params, model, **settings)
    else:
        out, views = simulate_cluster_views(requests, params, model, resolved.cluster,
                                            kv_bytes_per_token=resolved.kv_bytes_per_token,
                                            prefill_pool=resolved.prefill_pool, decode_pool=resolved.decode_pool,
                                            startup=resolved.startup, hardware=resolved.hardware,
                                            **settings)
    if out.result != result_codes.OK:
        raise SimulationFailed(f"the engine stopped early ({result_codes.fix(out.result)}); its outputs would be "
                               "incomplete, so none are given")
    _warn_routing_rejections(out, requests, warn)
    _warn_cpu_reload_failures(out, warn)
    return SimulationResult(scenario=resolved, requests=requests, output=out, views=views)


def _offload_source(resolved) -> str:
    """Where the offload chain came from: the flag / field, or a replayed trace header's block."""
    config = resolved.config
    if isinstance(config.workload, TraceWorkload) and config.deployment.kv_offload_config is None:
        return f"{name('workload.header')} {config.workload.header}: kv_offload"
    return name("deployment.kv_offload_config")


def _warn_routing_rejections(out, requests, warn: Warn | None) -> None:
    """BLIS warns once per request rejected at routing (no routable instance); one line here,
    with the count and the first and last request ids."""
    import numpy as np

    from blis_jax.engine.status import ROUTING_REJECTED

    rows = np.flatnonzero(out.status == ROUTING_REJECTED)
    if len(rows) == 0:
        return
    ids = [f"request_{int(requests.request_id[r])}" for r in rows]
    shown = ", ".join(ids) if len(ids) <= 4 else f"{', '.join(ids[:3])}, ..., {ids[-1]}"
    (warn or _python_warning)(f"{len(ids)} request(s) rejected at routing: no routable instance served their model "
                              f"when they arrived (instances Loading or Draining, or another model): {shown}")


def _warn_cpu_reload_failures(out, warn: Warn | None) -> None:
    """The CPU KV tier's known difference from BLIS (engine/cpu_tier.py): said, not given silently."""
    if out.cpu_reload_failures is None or not out.cpu_reload_failures.any():
        return
    (warn or _python_warning)(f"{int(out.cpu_reload_failures.sum())} allocation(s) failed after reloading blocks from "
                              "the CPU tier; BLIS keeps the reloaded prefix held by the waiting request and blis-jax "
                              "does not, so figures under this KV pressure differ from BLIS's (preemptions, TTFT)")
