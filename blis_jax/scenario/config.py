"""A scenario as plain Python values: what to deploy, how the engine schedules, what load
arrives, how the cluster routes it, for how long and with which seed.

Every section validates its own numbers on construction; whatever needs files (a model, a GPU,
a coefficient set, a workload spec, a trace) is checked by `resolve`. Defaults are BLIS's,
except the model: BLIS requires one, blis-jax defaults to meta-llama/llama-3.1-8b-instruct so
that `ScenarioConfig()` is the embedded default scenario (`blis-jax run` with no flags).
Error messages name fields by their path here (`blis_jax.naming`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from blis_jax import limits
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.engine.dims import PREEMPTION_POLICIES, SCHEDULERS
from blis_jax.errors import ConfigError
from blis_jax.naming import name
from blis_jax.workload.distribution import DEFAULT_TIMEOUT_S, OUTPUT_DEFAULT, PROMPT_DEFAULT, GaussianLength
from blis_jax.workload.presets import PRESETS

DEFAULT_MODEL = "meta-llama/llama-3.1-8b-instruct"
DEFAULT_HARDWARE = "H100"
DEFAULT_TP = 1
DEFAULT_SEED = 42
DEFAULT_NUM_REQUESTS = 100
LATENCY_MODELS = ("trained-physics", "roofline")
SYNTHETIC_KINDS = ("distribution", *PRESETS)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(path: str, value, low: int, high: int = INT64_MAX, what: str = "") -> None:
    if not _is_int(value):
        raise ConfigError(f"{name(path)} {value!r}: must be an integer")
    limits.check_int(name(path), value, low, high, what)


def _check_choice(path: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name(path)} {value!r}: use one of {', '.join(choices)}")


@dataclasses.dataclass(frozen=True)
class Deployment:
    """The model served, on which GPU, with which latency model and KV cache.

    `hardware` and `tp` None take the model's BLIS default (else H100, TP 1); `total_kv_blocks`
    None is derived from GPU memory; `max_model_len` 0 from the model and the KV capacity.
    `alpha`/`beta` (given together) or a `coefficients` YAML override the trained-physics
    defaults. The `prefill_*`/`decode_*` fields give a PD pool its own GPU, TP, latency
    backend or max-model-len (None / 0: the deployment's; shared prefill-decode pods take the
    decode pool's)."""

    model: str = DEFAULT_MODEL
    hardware: str | None = None
    tp: int | None = None
    latency_model: str = "trained-physics"
    alpha: tuple[float, ...] | None = None
    beta: tuple[float, ...] | None = None
    coefficients: str | Path | None = None
    total_kv_blocks: int | None = None
    block_size: int = 16
    # BLIS's legacy CPU KV tier (engine/cpu_tier.py): 0 blocks = none. The offload threshold is
    # accepted and ignored, as BLIS ignores it; bandwidth in blocks per µs, base latency in µs.
    kv_cpu_blocks: int = 0
    kv_offload_threshold: float = 0.9
    kv_transfer_bandwidth: float = 100.0
    kv_transfer_base_latency: int = 0
    # BLIS's multi-tier KV offload chain (config/kv_offload.py): its YAML, None = none. A
    # replayed trace's header block replaces it (the header is authoritative)
    kv_offload_config: str | Path | None = None
    # BLIS's defaults.yaml (--defaults-filepath): blis-jax reads only its `kv_offload_devices`,
    # device classes added to the shipped ones for the chain's `device_class`; None = none
    defaults_filepath: str | Path | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0
    prefill_hardware: str | None = None
    prefill_tp: int | None = None
    prefill_max_model_len: int = 0
    decode_hardware: str | None = None
    decode_tp: int | None = None
    decode_max_model_len: int = 0
    prefill_latency_model: str | None = None
    decode_latency_model: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model).strip():
            raise ConfigError(f"{name('deployment.model')}: give a bundled model id or a config path")
        _check_choice("deployment.latency_model", self.latency_model, LATENCY_MODELS)
        for pool in ("prefill", "decode"):
            if getattr(self, f"{pool}_latency_model") is not None:
                _check_choice(f"deployment.{pool}_latency_model", getattr(self, f"{pool}_latency_model"),
                              LATENCY_MODELS)
        for path, value in (("deployment.hardware", self.hardware), ("deployment.prefill_hardware",
                            self.prefill_hardware), ("deployment.decode_hardware", self.decode_hardware)):
            if value is not None and not str(value).strip():
                raise ConfigError(f"{name(path)}: empty GPU name; give a bundled GPU (e.g. H100) or a GPU YAML "
                                  "path, or leave it unset")
        if self.tp is not None and (not _is_int(self.tp) or self.tp < 0):
            raise ConfigError(f"{name('deployment.tp')} {self.tp}: the tensor-parallel degree must be >= 1 "
                              "(0 = model default)")
        for pool in ("prefill", "decode"):
            tp = getattr(self, f"{pool}_tp")
            if tp is not None and (not _is_int(tp) or tp < 1):
                raise ConfigError(f"{name(f'deployment.{pool}_tp')} {tp}: the tensor-parallel degree must be >= 1 "
                                  f"(leave it unset to use {name('deployment.tp')})")
        _check_int("deployment.kv_cpu_blocks", self.kv_cpu_blocks, 0, limits.MAX_KV_BLOCKS, " blocks")
        _check_int("deployment.kv_transfer_base_latency", self.kv_transfer_base_latency, 0)
        if self.defaults_filepath is not None and (not isinstance(self.defaults_filepath, (str, Path))
                                                   or not str(self.defaults_filepath).strip()):
            raise ConfigError(f"{name('deployment.defaults_filepath')}: give the path of a BLIS defaults.yaml "
                              "(its kv_offload_devices are read), or leave it unset")
        if self.kv_offload_config is not None:
            if not isinstance(self.kv_offload_config, (str, Path)) or not str(self.kv_offload_config).strip():
                raise ConfigError(f"{name('deployment.kv_offload_config')}: give the path of a multi-tier KV offload "
                                  "YAML (top-level kv_offload:), or leave it unset")
            if _is_int(self.kv_cpu_blocks) and self.kv_cpu_blocks > 0:
                # BLIS: the two CPU tiers are mutually exclusive (blis-features §1.1)
                raise ConfigError(f"{name('deployment.kv_cpu_blocks')} and {name('deployment.kv_offload_config')} "
                                  "both set: the legacy CPU tier and the multi-tier offload chain are mutually "
                                  f"exclusive; drop one (the chain's CPU tier is its cpu_bytes_to_use)")
        bw = self.kv_transfer_bandwidth
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
            raise ConfigError(f"{name('deployment.kv_transfer_bandwidth')} {bw!r}: must be a finite number > 0")
        if self.total_kv_blocks is not None:
            if not _is_int(self.total_kv_blocks) or self.total_kv_blocks < 1:
                raise ConfigError(f"{name('deployment.total_kv_blocks')} {self.total_kv_blocks}: must be >= 1 "
                                  "(leave it unset to auto-size from GPU memory)")
            _check_int("deployment.total_kv_blocks", self.total_kv_blocks, 1, limits.MAX_KV_BLOCKS,
                       f" (block ids are 32-bit; raise {name('deployment.block_size')} instead)")
        if _is_int(self.block_size) and self.block_size < 1:
            raise ConfigError(f"{name('deployment.block_size')} {self.block_size}: must be >= 1")
        _check_int("deployment.block_size", self.block_size, 1, limits.MAX_BLOCK_SIZE,
                   " tokens (vLLM uses 16 to 256)")
        for path in ("deployment.max_model_len", "deployment.prefill_max_model_len",
                     "deployment.decode_max_model_len"):
            value = getattr(self, path.split(".")[1])
            if _is_int(value) and value < 0:
                raise ConfigError(f"{name(path)} {value}: must be >= 0 (0 = auto)")
            _check_int(path, value, 0, limits.MAX_TOKENS, " tokens (0 = auto)")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not (math.isfinite(util) and 0.0 < util <= 1.0):
            raise ConfigError(f"{name('deployment.gpu_memory_utilization')} {util}: must be in (0, 1], e.g. 0.9")
        self._check_coefficients()

    def _check_coefficients(self) -> None:
        from blis_jax.config.coefficients import check_alpha, check_beta

        given_alpha, given_beta = self.alpha is not None, self.beta is not None
        if given_alpha != given_beta:
            present, missing = ((name("deployment.alpha"), name("deployment.beta")) if given_alpha
                                else (name("deployment.beta"), name("deployment.alpha")))
            raise ConfigError(f"{present} needs {missing} too: give both coefficient lists or neither")
        if self.coefficients is not None and given_alpha:
            raise ConfigError(f"{name('deployment.coefficients')} and {name('deployment.alpha')}/"
                              f"{name('deployment.beta')} both set; use one source")
        if self.latency_model == "roofline" and (given_beta or self.coefficients is not None):
            field = name("deployment.beta") if given_beta else name("deployment.coefficients")
            raise ConfigError(f"{field} is for trained-physics only, but {name('deployment.latency_model')} is "
                              f"roofline; drop it or use {name('deployment.latency_model')} trained-physics")
        if given_alpha:
            for path, check, values in (("deployment.alpha", check_alpha, self.alpha),
                                        ("deployment.beta", check_beta, self.beta)):
                values = tuple(values)
                for i, v in enumerate(values):
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                        raise ConfigError(f"{name(path)}: value {i + 1} is {v!r}; coefficients must be finite "
                                          "numbers")
                try:
                    check(values)
                except ConfigError as e:
                    raise ConfigError(f"{name(path)}: {e}") from None
            object.__setattr__(self, "alpha", tuple(float(v) for v in self.alpha))
            object.__setattr__(self, "beta", tuple(float(v) for v in self.beta))


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """vLLM's batch formation and scheduling knobs (BLIS's defaults)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    scheduler: str = "fcfs"
    preemption_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check_int("engine.max_num_seqs", self.max_num_seqs, 1, limits.MAX_TOKENS)
        _check_int("engine.max_num_batched_tokens", self.max_num_batched_tokens, 1, limits.MAX_TOKENS)
        _check_int("engine.long_prefill_token_threshold", self.long_prefill_token_threshold, 0, limits.MAX_TOKENS)
        _check_choice("engine.scheduler", self.scheduler, SCHEDULERS)
        _check_choice("engine.preemption_policy", self.preemption_policy, PREEMPTION_POLICIES)


@dataclasses.dataclass(frozen=True)
class SyntheticWorkload:
    """`blis-jax run`'s own workload: constant arrivals at `rate` req/s with clamped-Gaussian
    lengths (`kind` distribution) or a named preset's lengths. `prompt`/`output`/`prefix_tokens`
    None take the defaults (and a preset ignores them, with a warning). `num_requests` 0 means
    bounded by the horizon only; `timeout_s` < 0 disables client timeouts."""

    kind: str = "distribution"
    rate: float = 1.0
    num_requests: int = DEFAULT_NUM_REQUESTS
    timeout_s: float = DEFAULT_TIMEOUT_S
    prefix_tokens: int | None = None
    prompt: GaussianLength | None = None
    output: GaussianLength | None = None

    def __post_init__(self) -> None:
        _check_choice("workload.kind", self.kind, SYNTHETIC_KINDS)
        rate = self.rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise ConfigError(f"{name('workload.rate')} {rate!r}: must be a finite number of requests/s > 0")
        _check_int("workload.num_requests", self.num_requests, 0)
        _check_timeout(self.timeout_s)
        if self.prefix_tokens is not None:
            _check_int("workload.prefix_tokens", self.prefix_tokens, 0, limits.MAX_TOKENS, " tokens")
        for path, dist in (("workload.prompt", self.prompt), ("workload.output", self.output)):
            if dist is None:
                continue
            for value in (dist.mean, dist.std):
                if isinstance(value, (int, float)) and abs(value) > limits.MAX_TOKENS:
                    raise ConfigError(f"{name(path)} {value:g}: at most {limits.MAX_TOKENS:,} tokens")
            for value in (dist.min, dist.max):
                if _is_int(value) and value > limits.MAX_TOKENS:
                    limits.check_int(name(path), value, 0, limits.MAX_TOKENS, " tokens")
            if not math.isfinite(dist.mean) or dist.mean < 0:
                raise ConfigError(f"{name(path)} {dist.mean:g}: the mean length must be a number >= 0")

    def lengths(self) -> tuple[GaussianLength, GaussianLength, int]:
        """(prompt, output, prefix tokens) with the defaults filled in (distribution kind)."""
        return (self.prompt or PROMPT_DEFAULT, self.output or OUTPUT_DEFAULT, self.prefix_tokens or 0)


@dataclasses.dataclass(frozen=True)
class SpecWorkload:
    """A workload spec v2 (a YAML path, a parsed mapping or a `WorkloadSpec`). `num_requests`
    and the scenario's horizon override the spec's; `timeout_s` applies only when given; the
    spec's own seed is used unless the scenario sets one."""

    spec: Any
    num_requests: int | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.spec is None or (isinstance(self.spec, (str, Path)) and not str(self.spec).strip()):
            raise ConfigError(f"{name('workload.spec')}: give a workload spec v2 YAML path or mapping")
        if self.num_requests is not None:
            _check_int("workload.num_requests", self.num_requests, 0)
        if self.timeout_s is not None:
            _check_timeout(self.timeout_s)

    def load(self):
        """The `WorkloadSpec`."""
        from blis_jax.workload.spec import WorkloadSpec, load_spec, parse_spec

        if isinstance(self.spec, WorkloadSpec):
            return self.spec
        if isinstance(self.spec, Mapping):
            return parse_spec(self.spec)
        return load_spec(self.spec)


@dataclasses.dataclass(frozen=True)
class TraceWorkload:
    """The requests of a TraceV2: its header YAML and request CSV (`blis-jax replay`)."""

    header: str | Path
    data: str | Path


def _check_timeout(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value == 0:
        raise ConfigError(f"{name('workload.timeout_s')} {value!r}: 0 is not allowed; give seconds > 0, or a "
                          "negative value to disable")
    if abs(value) * 1e6 > limits.MAX_TIME_US:
        raise ConfigError(f"{name('workload.timeout_s')} {value:g}: at most {limits.MAX_TIME_US / 1e6:.3g} s "
                          "(a negative value disables timeouts)")


Workload = SyntheticWorkload | SpecWorkload | TraceWorkload


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (blis-features §3.12). `config`: a LoRA YAML path (top-level `lora:`) or
    such a mapping, with the adapter registry; the other fields, when set, override its values
    (BLIS: flags win). `scorer_weight` > 0 adds `lora-affinity` with that weight to weighted
    routing. Without adapters LoRA is inert."""

    config: str | Path | Mapping | None = None
    adapter_capacity: int | None = None
    load_base_latency_us: float | None = None
    load_bandwidth_bytes_us: float | None = None
    footprint_bytes_per_rank: float | None = None
    scorer_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.adapter_capacity is not None:
            _check_int("lora.adapter_capacity", self.adapter_capacity, 1, limits.MAX_TOKENS,
                       " resident adapters per instance")
        for path in ("lora.load_base_latency_us", "lora.load_bandwidth_bytes_us", "lora.footprint_bytes_per_rank",
                     "lora.scorer_weight"):
            value = getattr(self, path.split(".")[1])
            if value is None:
                continue
            positive = path in ("lora.load_bandwidth_bytes_us", "lora.footprint_bytes_per_rank")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or (value <= 0 if positive else value < 0):
                raise ConfigError(f"{name(path)} {value!r}: must be a finite number {'> 0' if positive else '>= 0'}")


@dataclasses.dataclass(frozen=True)
class ScenarioConfig:
    """One simulation, fully described. `ScenarioConfig()` is `blis-jax run` with no flags.

    `horizon_us` None: no horizon (a trace's default is twice its latest arrival). `seed` None:
    42, or a workload spec's own seed (BLIS's precedence)."""

    deployment: Deployment = Deployment()
    engine: EngineSettings = EngineSettings()
    workload: Workload = SyntheticWorkload()
    cluster: ClusterConfig = ClusterConfig()
    horizon_us: int | None = None
    seed: int | None = None
    # BLIS's policy bundle: a YAML path or a `blis_jax.config.policy_bundle.PolicyBundle`;
    # applied at resolve with BLIS's precedence (scenario/policy.py). None: no bundle.
    policy_config: str | Path | Any = None
    lora: LoraSettings = LoraSettings()

    def __post_init__(self) -> None:
        for path, value, kind in (("deployment", self.deployment, Deployment),
                                  ("engine", self.engine, EngineSettings),
                                  ("cluster", self.cluster, ClusterConfig), ("lora", self.lora, LoraSettings)):
            if not isinstance(value, kind):
                raise ConfigError(f"{name(path)}: expected a {kind.__name__}, got {type(value).__name__}")
        if not isinstance(self.workload, (SyntheticWorkload, SpecWorkload, TraceWorkload)):
            raise ConfigError(f"{name('workload')}: expected a SyntheticWorkload, SpecWorkload or TraceWorkload, "
                              f"got {type(self.workload).__name__}")
        if self.policy_config is not None:
            from blis_jax.config.policy_bundle import PolicyBundle

            given = self.policy_config
            if not isinstance(given, (str, Path, PolicyBundle)) or (not isinstance(given, PolicyBundle)
                                                                    and not str(given).strip()):
                raise ConfigError(f"{name('policy_config')}: give a policy-config YAML path or a PolicyBundle")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ConfigError(f"{name('seed')} {self.seed}: must fit in a signed 64-bit integer")
        if self.horizon_us is not None and (not _is_int(self.horizon_us) or self.horizon_us <= 0):
            raise ConfigError(f"{name('horizon_us')} {self.horizon_us}: must be > 0 µs (leave it unset for no "
                              "horizon)")
        n = self.cluster.num_instances
        if _is_int(n) and n < 1:
            raise ConfigError(f"{name('cluster.num_instances')} {n}: must be >= 1")
        if self.cluster.routing_scorers is not None and self.cluster.routing_policy != "weighted":
            raise ConfigError(f"{name('cluster.routing_scorers')} is used by {name('cluster.routing_policy')} "
                              f"weighted only, but the policy is {self.cluster.routing_policy}; add "
                              f"{name('cluster.routing_policy')} weighted or drop {name('cluster.routing_scorers')}")
        if isinstance(self.workload, SyntheticWorkload) and self.workload.num_requests == 0 \
                and self.horizon_us is None:
            raise ConfigError(f"{name('workload.num_requests')} is 0 and no {name('horizon_us')} is set; give at "
                              "least one bound")

    @property
    def effective_seed(self) -> int:
        return DEFAULT_SEED if self.seed is None else self.seed

    def replace(self, **changes) -> ScenarioConfig:
        """A copy with top-level fields replaced (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)
