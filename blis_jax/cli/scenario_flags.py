"""`run`/`replay` flags → `ScenarioConfig`, and the table that names each configuration field by
its flag (from the scenario settings table), so that an error raised by the library still names
what the user typed."""

from __future__ import annotations

import argparse
import math

from blis_jax.cluster.gateway import FlowControlConfig
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.errors import ConfigError
from blis_jax.scenario import (
    Deployment,
    EngineSettings,
    LoraSettings,
    ScenarioConfig,
    SpecWorkload,
    SyntheticWorkload,
    TraceWorkload,
)
from blis_jax.scenario.config import DEFAULT_NUM_REQUESTS
from blis_jax.scenario.settings import SETTINGS
from blis_jax.workload.distribution import DEFAULT_TIMEOUT_S, OUTPUT_DEFAULT, PROMPT_DEFAULT, GaussianLength

_FLOW_CONTROL_FIELDS = ("saturation_detector", "dispatch_order", "fairness_policy", "slo_targets",
                        "max_gateway_queue_depth", "per_band_capacity", "queue_shedding", "usage_limit_threshold",
                        "max_concurrency", "in_flight_eviction")
_CLUSTER_FIELDS = ("num_instances", "routing_policy", "routing_scorers", "admission_policy", "token_bucket_capacity",
                   "token_bucket_refill_rate", "tier_shed_threshold", "tier_shed_min_priority",
                   "queue_depth_threshold", "kv_cache_util_threshold", "prefill_instances", "decode_instances",
                   "prefill_decode_instances", "pd_decider", "pd_prefix_threshold", "pd_transfer_bandwidth",
                   "pd_transfer_base_latency", "pd_transfer_contention", "prefill_routing_scorers",
                   "decode_routing_scorers", "encode_instances", "encode_decider", "drain_policy")


# Configuration field path → the flag that sets it (`blis_jax.naming`): the scenario settings
# table (run's flags, `blis_jax.scenario.settings`), plus the workload section and replay's trace.
FLAG_OF_FIELD: dict[str, str] = {
    **{s.named_field: f"--{s.key}" for s in SETTINGS if s.names_field},
    "workload": "--workload",
    "workload.header": "--trace-header",
    "workload.data": "--trace-data",
}


def given_fields(args: argparse.Namespace) -> frozenset[str]:
    """The configuration fields of the flags typed on the command line (`main` records them as
    `args.given_flags`): a policy bundle never overrides them."""
    from blis_jax.scenario.settings import settings_by_key

    table = settings_by_key()
    return frozenset(table[flag].field for flag in getattr(args, "given_flags", ()) if flag in table)


def parse_coefficients(flag: str, text: str) -> tuple[float, ...]:
    """A comma-separated list of finite numbers; the error names the flag and position."""
    values = []
    for i, part in enumerate(text.split(",")):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"{flag}: value {i + 1} ({part!r}) is not a number; give a "
                              "comma-separated list such as 15563.2,777.35,45.91") from None
        if not math.isfinite(value):
            raise ConfigError(f"{flag}: value {i + 1} is {part}; coefficients must be finite numbers")
        values.append(value)
    return tuple(values)


def scenario_config(args: argparse.Namespace, *, seed_given: bool) -> ScenarioConfig:
    """The `ScenarioConfig` of `run`'s or `replay`'s flags (call inside `naming(FLAG_OF_FIELD)`).
    `seed_given`: --seed was typed (otherwise a workload spec's own seed wins, as in BLIS)."""
    return ScenarioConfig(deployment=deployment(args), engine=engine_settings(args), workload=workload(args),
                          cluster=cluster(args), horizon_us=args.horizon,
                          seed=int(args.seed) if seed_given else None, policy_config=args.policy_config,
                          lora=lora(args))


def lora(args: argparse.Namespace) -> LoraSettings:
    return LoraSettings(config=args.lora_config, adapter_capacity=args.lora_adapter_capacity,
                        load_base_latency_us=args.lora_load_base_latency_us,
                        load_bandwidth_bytes_us=args.lora_load_bandwidth_bytes_us,
                        footprint_bytes_per_rank=args.lora_footprint_bytes_per_rank,
                        scorer_weight=args.lora_scorer_weight)


def deployment(args: argparse.Namespace) -> Deployment:
    alpha = None if args.alpha_coeffs is None else parse_coefficients("--alpha-coeffs", args.alpha_coeffs)
    beta = None if args.beta_coeffs is None else parse_coefficients("--beta-coeffs", args.beta_coeffs)
    return Deployment(
        model=args.model, hardware=args.hardware, tp=args.tp, latency_model=args.latency_model or "trained-physics",
        alpha=alpha, beta=beta, coefficients=args.coefficients, total_kv_blocks=args.total_kv_blocks,
        block_size=args.block_size_in_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        kv_cpu_blocks=args.kv_cpu_blocks, kv_offload_threshold=args.kv_offload_threshold,
        kv_transfer_bandwidth=args.kv_transfer_bandwidth, kv_transfer_base_latency=args.kv_transfer_base_latency,
        kv_offload_config=args.kv_offload_config, defaults_filepath=args.defaults_filepath,
        prefill_hardware=args.prefill_hardware, prefill_tp=args.prefill_tp,
        prefill_max_model_len=args.prefill_max_model_len, decode_hardware=args.decode_hardware,
        decode_tp=args.decode_tp, decode_max_model_len=args.decode_max_model_len,
        prefill_latency_model=args.prefill_latency_model, decode_latency_model=args.decode_latency_model)


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          scheduler=args.scheduler, preemption_policy=args.preemption_policy)


def workload(args: argparse.Namespace):
    if getattr(args, "trace_header", None) is not None:   # replay
        return TraceWorkload(header=args.trace_header, data=args.trace_data)
    if args.workload_spec:
        return SpecWorkload(spec=args.workload_spec, num_requests=args.num_requests, timeout_s=args.timeout)
    return SyntheticWorkload(
        kind=args.workload, rate=args.rate,
        num_requests=DEFAULT_NUM_REQUESTS if args.num_requests is None else args.num_requests,
        timeout_s=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
        prefix_tokens=args.prefix_tokens, prompt=_length(args, "prompt", PROMPT_DEFAULT),
        output=_length(args, "output", OUTPUT_DEFAULT))


def _length(args: argparse.Namespace, kind: str, default: GaussianLength) -> GaussianLength | None:
    mean, std, lo, hi = (getattr(args, f"{kind}_tokens{suffix}") for suffix in ("", "_stdev", "_min", "_max"))
    if mean is None and std is None and lo is None and hi is None:
        return None
    return GaussianLength(mean=default.mean if mean is None else mean, std=default.std if std is None else std,
                          min=default.min if lo is None else lo, max=default.max if hi is None else hi)


def cluster(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        **{field: getattr(args, field) for field in _CLUSTER_FIELDS},
        snapshot_refresh_interval_us=args.snapshot_refresh_interval, cache_signal_delay_us=args.cache_signal_delay,
        admission_latency_us=args.admission_latency, routing_latency_us=args.routing_latency,
        flow_control=_flow_control(args), model_autoscaler_interval_us=args.model_autoscaler_interval_us,
        warm_up_request_count=args.warm_up_requests, warm_up_ttft_factor=args.warm_up_ttft_factor)


def _flow_control(args: argparse.Namespace) -> FlowControlConfig | None:
    config = FlowControlConfig(**{field: getattr(args, field) for field in _FLOW_CONTROL_FIELDS},
                               request_ttl_us=args.request_ttl, dispatch_tick_interval_us=args.dispatch_tick_interval)
    if not args.flow_control:
        if config != FlowControlConfig():
            raise ConfigError("the gateway-queue flags (--saturation-detector, --dispatch-order, ...) need "
                              "--flow-control")
        return None
    return config
