"""Scenario settings by name: `blis-jax run`'s flag names (without dashes) → `ScenarioConfig`.

One table (`SETTINGS`) lists every setting a `run` command line can give a scenario: its key
(the flag name, e.g. ``max-num-seqs``, with BLIS's aliases such as ``max-num-running-reqs``),
the `ScenarioConfig` field it sets, its type and choices. A sweep grid names its settings this
way (`blis_jax.sweep`), the CLI names fields by it (`cli.scenario_flags.FLAG_OF_FIELD`), and
`apply_settings` builds a configuration from such a mapping directly, with `run`'s precedence
(a workload spec replaces the synthetic workload; unset lengths take the defaults). A test
keeps this table and the `run` parser in agreement. Outputs and logging are not settings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

from blis_jax.cluster.gateway import FlowControlConfig
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.errors import ConfigError
from blis_jax.io_safety import clip, short
from blis_jax.naming import naming
from blis_jax.scenario.config import (
    LATENCY_MODELS,
    SYNTHETIC_KINDS,
    Deployment,
    EngineSettings,
    LoraSettings,
    ScenarioConfig,
    SpecWorkload,
    SyntheticWorkload,
)
from blis_jax.workload.distribution import OUTPUT_DEFAULT, PROMPT_DEFAULT, GaussianLength

NUMBERS = tuple  # the kind of a list-of-numbers setting (coefficients): a YAML list or a comma string
LENGTHS = {"workload.prompt": PROMPT_DEFAULT, "workload.output": OUTPUT_DEFAULT}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One scenario setting: `key` (run flag without dashes) sets the configuration `field`."""

    key: str
    field: str    # path in ScenarioConfig; a length's part is a fourth step (workload.prompt.std)
    kind: type    # int, float, str, bool (a switch: true gives the flag) or NUMBERS
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def named_field(self) -> str:
        """The field path errors name (a length's part is named by its length)."""
        head, _, _ = self.field.rpartition(".")
        return head if head in LENGTHS else self.field

    @property
    def names_field(self) -> bool:
        """Whether errors about `named_field` name this setting (a length: its mean's key)."""
        return self.named_field == self.field or self.field.endswith(".mean")

    @property
    def default(self) -> Any:
        """The value a scenario has when the setting is not given (None: unset / derived)."""
        head, _, last = self.field.rpartition(".")
        if head in LENGTHS:
            return getattr(LENGTHS[head], last)
        if head == "cluster.flow_control":
            return getattr(FlowControlConfig(), last)
        special = {"seed": ScenarioConfig().effective_seed, "cluster.flow_control": False, "workload.spec": None}
        if self.field in special:
            return special[self.field]
        value: Any = ScenarioConfig()
        for part in self.field.split("."):
            value = getattr(value, part)
        return value


def _s(key: str, field: str, kind: type, choices=None, aliases: tuple[str, ...] = ()) -> Setting:
    return Setting(key=key, field=field, kind=kind, choices=tuple(choices) if choices else None, aliases=aliases)


def _cluster_choices():
    from blis_jax.cluster.admission import ADMISSION_POLICIES
    from blis_jax.cluster.encode import ENCODE_DECIDERS
    from blis_jax.cluster.gateway import DISPATCH_ORDERS, FAIRNESS_POLICIES, SATURATION_DETECTORS
    from blis_jax.cluster.pd import PD_DECIDERS
    from blis_jax.cluster.routing import ROUTING_POLICIES

    return (ADMISSION_POLICIES, ROUTING_POLICIES, SATURATION_DETECTORS, DISPATCH_ORDERS, FAIRNESS_POLICIES,
            PD_DECIDERS, ENCODE_DECIDERS)


def _table() -> tuple[Setting, ...]:
    from blis_jax.engine.dims import PREEMPTION_POLICIES, SCHEDULERS
    from blis_jax.cluster.drain import DRAIN_POLICIES

    admission, routing, saturation, dispatch, fairness, pd, encode = _cluster_choices()
    lengths = [_s(f"{kind}-tokens{suffix}", f"workload.{kind}.{part}", typ)
               for kind in ("prompt", "output")
               for suffix, part, typ in (("", "mean", float), ("-stdev", "std", float), ("-min", "min", int),
                                         ("-max", "max", int))]
    pools = [_s(f"{pool}-{name}", f"deployment.{pool}_{name.replace('-', '_')}", typ)
             for pool in ("prefill", "decode")
             for name, typ in (("hardware", str), ("tp", int), ("max-model-len", int), ("latency-model", str))]
    return (
        # workload (run only)
        _s("workload", "workload.kind", str, SYNTHETIC_KINDS),
        _s("rate", "workload.rate", float),
        _s("workload-spec", "workload.spec", str),
        _s("num-requests", "workload.num_requests", int),
        _s("timeout", "workload.timeout_s", float),
        _s("prefix-tokens", "workload.prefix_tokens", int),
        *lengths,
        # simulation
        _s("seed", "seed", int),
        _s("horizon", "horizon_us", int),
        # cluster: admission and routing
        _s("num-instances", "cluster.num_instances", int),
        _s("admission-policy", "cluster.admission_policy", str, admission),
        _s("token-bucket-capacity", "cluster.token_bucket_capacity", float),
        _s("token-bucket-refill-rate", "cluster.token_bucket_refill_rate", float),
        _s("tier-shed-threshold", "cluster.tier_shed_threshold", int),
        _s("tier-shed-min-priority", "cluster.tier_shed_min_priority", int),
        _s("queue-depth-threshold", "cluster.queue_depth_threshold", float),
        _s("kv-cache-util-threshold", "cluster.kv_cache_util_threshold", float),
        _s("admission-latency", "cluster.admission_latency_us", int),
        _s("routing-latency", "cluster.routing_latency_us", int),
        _s("routing-policy", "cluster.routing_policy", str, routing),
        _s("routing-scorers", "cluster.routing_scorers", str),
        _s("snapshot-refresh-interval", "cluster.snapshot_refresh_interval_us", int),
        _s("cache-signal-delay", "cluster.cache_signal_delay_us", int),
        _s("policy-config", "policy_config", str),
        _s("model-autoscaler-interval-us", "cluster.model_autoscaler_interval_us", float),
        _s("warm-up-requests", "cluster.warm_up_request_count", int),   # blis-jax extensions (BLIS library features)
        _s("warm-up-ttft-factor", "cluster.warm_up_ttft_factor", float),
        _s("drain-policy", "cluster.drain_policy", str, DRAIN_POLICIES),
        # cluster: flow control
        _s("flow-control", "cluster.flow_control", bool),
        _s("saturation-detector", "cluster.flow_control.saturation_detector", str, saturation),
        _s("dispatch-order", "cluster.flow_control.dispatch_order", str, dispatch),
        _s("fairness-policy", "cluster.flow_control.fairness_policy", str, fairness),
        _s("slo-targets", "cluster.flow_control.slo_targets", str),
        _s("max-gateway-queue-depth", "cluster.flow_control.max_gateway_queue_depth", int),
        _s("per-band-capacity", "cluster.flow_control.per_band_capacity", int),
        _s("queue-shedding", "cluster.flow_control.queue_shedding", bool),
        _s("usage-limit-threshold", "cluster.flow_control.usage_limit_threshold", float),
        _s("max-concurrency", "cluster.flow_control.max_concurrency", float),
        _s("request-ttl", "cluster.flow_control.request_ttl_us", int),
        _s("dispatch-tick-interval", "cluster.flow_control.dispatch_tick_interval_us", int),
        _s("in-flight-eviction", "cluster.flow_control.in_flight_eviction", bool),
        # cluster: prefill/decode disaggregation
        _s("prefill-instances", "cluster.prefill_instances", int),
        _s("decode-instances", "cluster.decode_instances", int),
        _s("prefill-decode-instances", "cluster.prefill_decode_instances", int),
        _s("pd-decider", "cluster.pd_decider", str, pd),
        _s("pd-prefix-threshold", "cluster.pd_prefix_threshold", int),
        _s("pd-transfer-bandwidth", "cluster.pd_transfer_bandwidth", float),
        _s("pd-transfer-base-latency", "cluster.pd_transfer_base_latency", float),
        _s("pd-transfer-contention", "cluster.pd_transfer_contention", bool),
        _s("prefill-routing-scorers", "cluster.prefill_routing_scorers", str),
        _s("decode-routing-scorers", "cluster.decode_routing_scorers", str),
        _s("encode-instances", "cluster.encode_instances", int),
        _s("encode-decider", "cluster.encode_decider", str, encode),
        *pools,
        # model, hardware and latency
        _s("model", "deployment.model", str),
        _s("hardware", "deployment.hardware", str),
        _s("tp", "deployment.tp", int),
        _s("latency-model", "deployment.latency_model", str, LATENCY_MODELS),
        _s("alpha-coeffs", "deployment.alpha", NUMBERS),
        _s("beta-coeffs", "deployment.beta", NUMBERS),
        _s("coefficients", "deployment.coefficients", str),
        _s("max-model-len", "deployment.max_model_len", int),
        # KV cache
        _s("total-kv-blocks", "deployment.total_kv_blocks", int),
        _s("block-size-in-tokens", "deployment.block_size", int),
        _s("gpu-memory-utilization", "deployment.gpu_memory_utilization", float),
        _s("kv-cpu-blocks", "deployment.kv_cpu_blocks", int),
        _s("kv-offload-threshold", "deployment.kv_offload_threshold", float),
        _s("kv-transfer-bandwidth", "deployment.kv_transfer_bandwidth", float),
        _s("kv-transfer-base-latency", "deployment.kv_transfer_base_latency", int),
        _s("kv-offload-config", "deployment.kv_offload_config", str),
        _s("defaults-filepath", "deployment.defaults_filepath", str),
        # batch formation and scheduling
        _s("max-num-seqs", "engine.max_num_seqs", int, aliases=("max-num-running-reqs",)),
        _s("max-num-batched-tokens", "engine.max_num_batched_tokens", int, aliases=("max-num-scheduled-tokens",)),
        _s("long-prefill-token-threshold", "engine.long_prefill_token_threshold", int),
        _s("scheduler", "engine.scheduler", str, SCHEDULERS),
        _s("preemption-policy", "engine.preemption_policy", str, PREEMPTION_POLICIES),
        # LoRA adapters
        _s("lora-config", "lora.config", str),
        _s("lora-adapter-capacity", "lora.adapter_capacity", int),
        _s("lora-load-base-latency-us", "lora.load_base_latency_us", float),
        _s("lora-load-bandwidth-bytes-us", "lora.load_bandwidth_bytes_us", float),
        _s("lora-footprint-bytes-per-rank", "lora.footprint_bytes_per_rank", float),
        _s("lora-scorer-weight", "lora.scorer_weight", float),
    )


SETTINGS: tuple[Setting, ...] = _table()


@functools.cache
def settings_by_key() -> Mapping[str, Setting]:
    """Every setting by key, aliases included (``max-num-running-reqs`` → max-num-seqs)."""
    return {name: s for s in SETTINGS for name in (s.key, *s.aliases)}


def find_setting(key: Any) -> Setting | None:
    """The setting a key names (dashes or underscores, leading dashes optional), else None."""
    if not isinstance(key, str):
        return None
    return settings_by_key().get(key.strip().lstrip("-").replace("_", "-"))


def field_names(where: str | None = None) -> dict[str, str]:
    """A `blis_jax.naming` table: each field named ``<where>.<key>`` (its setting), or by its
    bare key when `where` is None."""
    prefix = "" if where is None else f"{where}."
    return {s.named_field: f"{prefix}{s.key}" for s in SETTINGS if s.names_field}


# ------------------------------------------------------------------------------- values


def check_value(key: str, value: Any, where: str) -> Any:
    """A YAML value of setting `key` (canonical), type-checked and converted: int, float, str,
    bool, or a tuple of floats (the error names ``where.key``)."""
    setting = settings_by_key()[key]
    at = f"{where}.{key}"
    if setting.kind is NUMBERS:
        return _numbers(value, at)
    if setting.kind is bool:
        text = str(value).lower() if isinstance(value, (bool, str)) else ""
        if text not in ("true", "false"):
            raise ConfigError(f"{at}: {short(value)} must be true or false (a switch of `blis-jax run`)")
        return text == "true"
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        raise ConfigError(f"{at}: {short(value)} is not a valid value; give {_expected(setting)}")
    if setting.kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise ConfigError(f"{at}: {short(value)} must be an integer")
        return value
    if setting.kind is float:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{at}: {short(value)} must be a finite number")
        return float(value)
    text = str(value)
    if setting.choices and text not in setting.choices:
        raise ConfigError(f"{at}: {short(text)} is not one of {', '.join(setting.choices)}")
    return text


def _expected(setting: Setting) -> str:
    if setting.choices:
        return f"one of {', '.join(setting.choices)}"
    return {int: "an integer", float: "a number", bool: "true or false"}.get(setting.kind, "a string")


def _numbers(value: Any, at: str) -> tuple[float, ...]:
    if isinstance(value, str):
        parts: list = [p.strip() for p in value.split(",")]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ConfigError(f"{at}: {short(value)} must be a list of numbers, e.g. [15563.2, 777.35, 45.91]")
    out = []
    for i, part in enumerate(parts):
        try:
            number = float(part) if not isinstance(part, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise ConfigError(f"{at}[{i}]: {short(part)} must be a finite number")
        out.append(number)
    return tuple(out)


# ------------------------------------------------------------------------ configuration


def apply_settings(settings: Mapping[str, Any], where: str) -> ScenarioConfig:
    """The `ScenarioConfig` of `settings` ({key: value}; keys as in `SETTINGS`, aliases
    allowed; values as YAML gives them), as `blis-jax run` with those flags builds it.
    Errors, the library's included, name ``<where>.<key>``."""
    values: dict[str, Any] = {}
    for raw, value in settings.items():
        setting = find_setting(raw)
        if setting is None:
            raise ConfigError(f"{where}.{clip(str(raw))}: unknown setting; settings are `blis-jax run` flag names "
                              "without the dashes")
        if setting.key in values:
            raise ConfigError(f"{where}.{raw}: {setting.key} is set twice (an alias names the same setting)")
        values[setting.key] = check_value(setting.key, value, where)
    with naming(field_names(where)):
        return _config(values, where)


def _config(values: Mapping[str, Any], where: str) -> ScenarioConfig:
    by_key = settings_by_key()
    sections: dict[str, dict[str, Any]] = {"": {}, "deployment": {}, "engine": {}, "workload": {}, "cluster": {},
                                           "cluster.flow_control": {}, "workload.prompt": {}, "workload.output": {}, "lora": {}}
    for key, value in values.items():
        head, _, last = by_key[key].field.rpartition(".")
        sections[head][last] = value
    flow = FlowControlConfig(**sections["cluster.flow_control"])
    if not sections["cluster"].pop("flow_control", False):
        if flow != FlowControlConfig():
            given = ", ".join(k for k in values if by_key[k].field.startswith("cluster.flow_control."))
            raise ConfigError(f"{where}: the gateway-queue settings ({given}) need flow-control: true")
        flow = None
    return ScenarioConfig(deployment=Deployment(**sections["deployment"]), engine=EngineSettings(**sections["engine"]),
                          workload=_workload(sections), cluster=ClusterConfig(**sections["cluster"], flow_control=flow),
                          horizon_us=sections[""].get("horizon_us"), seed=sections[""].get("seed"),
                          policy_config=sections[""].get("policy_config"), lora=LoraSettings(**sections["lora"]))


def _workload(sections: Mapping[str, dict[str, Any]]):
    w = sections["workload"]
    if w.get("spec"):   # as `run`: a spec replaces the synthetic workload and its length settings
        return SpecWorkload(spec=w["spec"], num_requests=w.get("num_requests"), timeout_s=w.get("timeout_s"))
    lengths = {}
    for path, default in LENGTHS.items():
        given = sections[path]
        lengths[path.split(".")[1]] = GaussianLength(**{**dataclasses.asdict(default), **given}) if given else None
    return SyntheticWorkload(**{k: v for k, v in w.items() if k != "spec"}, **lengths)
