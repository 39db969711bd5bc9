"""ScenarioConfig → ResolvedScenario: the model, GPU and latency model loaded, KV capacity and
max-model-len derived, the requests generated (or read), everything the engine needs.

BLIS's precedence: an explicit field wins, otherwise the model's BLIS default (hardware, TP;
`configs/presets/model_defaults.yaml`), otherwise the hard-coded default; KV blocks and
max-model-len are derived unless given (blis-features §2.14).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping

from blis_jax import limits
from blis_jax.cluster import node_pools as infra
from blis_jax.cluster.deployments import PoolDeployment
from blis_jax.cluster.simulate import ClusterConfig, unservable_models
from blis_jax.config import auto_kv_blocks, auto_max_model_len, load_coefficients, load_gpu, load_model
from blis_jax.config.kv_capacity import kv_block_bytes, kv_bytes_per_token
from blis_jax.config.kv_offload import device_classes, from_header_block, load_offload_config, to_header_block
from blis_jax.errors import ConfigError
from blis_jax.scenario.config import (
    DEFAULT_HARDWARE,
    DEFAULT_TP,
    Deployment,
    ScenarioConfig,
    SpecWorkload,
    SyntheticWorkload,
    TraceWorkload,
)
from blis_jax.naming import name
from blis_jax.workload.requests import RequestSet
from blis_jax.workload.tracev2 import TraceHeader

# BLIS: a KV capacity that cannot be derived (an unknown quantity, say) falls back to this,
# with a warning; an over-committed GPU is an error.
PHANTOM_KV_BLOCKS = 1_000_000

Warn = Callable[[str], None]


class ScenarioWarning(UserWarning):
    """Something in a scenario was ignored or replaced (e.g. a preset's fixed lengths)."""


def _python_warning(message: str) -> None:
    warnings.warn(message, ScenarioWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedScenario:
    """Everything one simulation needs, resolved: the deployment (latency model, KV capacity,
    limits), the engine settings, the cluster, the requests (with closed-loop session links
    when the workload has sessions) and the trace header the outputs carry."""

    config: ScenarioConfig
    latency_model: object
    model_id: str
    hardware: str
    tp: int
    latency_kind: str
    total_kv_blocks: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    scheduler: str
    preemption_policy: str
    horizon_us: int | None
    cluster: ClusterConfig
    kv_bytes_per_token: float               # per GPU (sizes PD KV transfers)
    prefill_pool: PoolDeployment | None
    decode_pool: PoolDeployment | None
    requests: RequestSet | None = None
    sessions: object | None = None          # SessionLinks of closed-loop sessions, else None
    lora: object | None = None              # engine.lora.LoraConfig, None without adapters
    cpu_tier: object | None = None          # engine.cpu_tier.CpuTier, None without a CPU KV tier
    offload: object | None = None           # config.kv_offload.OffloadConfig, None without the offload chain
    header: TraceHeader = TraceHeader()
    goodput_targets: Mapping | None = None
    startup: infra.StartupInstances | None = None  # node pools: the placed startup instances

    @property
    def single_instance(self) -> bool:
        """Served by the single-instance engine: one instance that admits every request at its
        arrival (no admission or routing latency, no gateway queue) and serves every request's
        model (else the cluster loop rejects the others at routing, as BLIS does)."""
        c = self.cluster
        return (c.num_instances == 1 and c.admission_policy == "always-admit" and c.flow_control is None
                and c.admission_latency_us == 0 and c.routing_latency_us == 0 and not c.node_pools
                and c.effective_autoscaler() is None and c.warm_up_request_count == 0   # warm-up: cluster loop
                and not (self.requests is not None and unservable_models(self.requests, c.served_model)))

    @property
    def params(self):
        """The engine's dynamic settings (`EngineParams`)."""
        from blis_jax.engine.params import make_engine_params

        return make_engine_params(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold, max_model_len=self.max_model_len,
            total_kv_blocks=self.total_kv_blocks, horizon_us=self.horizon_us)

    def with_coefficients(self, alpha, beta) -> ResolvedScenario:
        """The same scenario with other trained-physics coefficients (arrays allowed: the
        latency model stays differentiable in them)."""
        from blis_jax.latency import with_coefficients

        return dataclasses.replace(self, latency_model=with_coefficients(self.latency_model, alpha=alpha, beta=beta))


@functools.cache
def model_defaults() -> Mapping[str, tuple[str, int]]:
    """BLIS's per-model default (GPU, TP), by lower-cased HuggingFace id."""
    import yaml

    from blis_jax.config.bundled import bundled_dir

    raw = yaml.safe_load((bundled_dir("presets") / "model_defaults.yaml").read_text())["model_defaults"]
    return {key.lower(): (entry["hardware"], int(entry["tp"])) for key, entry in raw.items()}


def resolve(config: ScenarioConfig, *, warn: Warn | None = None) -> ResolvedScenario:
    """Resolve `config`: load what it names, generate or read its requests. Raises
    `ConfigError` naming the field; `warn` (default: `warnings.warn` with `ScenarioWarning`)
    receives what was ignored or replaced."""
    warn = warn or _python_warning
    workload = config.workload
    if isinstance(workload, TraceWorkload):
        return _resolve_trace(config, workload, warn)
    if isinstance(workload, SpecWorkload):
        return _resolve_spec(config, workload, warn)
    return _resolve_synthetic(config, workload, warn)


def resolve_deployment(config: ScenarioConfig, *, horizon_us: int | None, warn: Warn | None = None) -> ResolvedScenario:
    """The scenario without its requests (`requests` None): the deployment, engine and cluster."""
    from blis_jax.scenario.policy import apply_policy_bundle

    warn = warn or _python_warning
    config = apply_policy_bundle(config, warn)
    from blis_jax.config.lora_config import resolve_lora

    d, e = config.deployment, config.engine
    lora = resolve_lora(config.lora)
    cluster = dataclasses.replace(config.cluster, seed=config.effective_seed)
    if lora is not None and config.lora.scorer_weight > 0 and cluster.routing_policy == "weighted":
        from blis_jax.cluster.scorers import DEFAULT_PROFILE

        # BLIS: --lora-scorer-weight appends lora-affinity to the weighted profile
        scorers = cluster.routing_scorers or DEFAULT_PROFILE
        cluster = dataclasses.replace(cluster, routing_scorers=f"{scorers},lora-affinity:{config.lora.scorer_weight:g}")
    cluster = cluster.validate()
    if cluster.served_model is None:  # BLIS: every instance serves --model lower-cased (blis-infra §5.1)
        cluster = dataclasses.replace(cluster, served_model=str(d.model).lower())
    if cluster.decider_ignored:
        # BLIS's message; `blis run` then disaggregates between the shared pods all the same,
        # `blis replay` refuses the configuration
        text = (f'{name("cluster.pd_decider")}="{cluster.pd_decider}" has no effect because '
                f'{name("cluster.prefill_instances")}=0 (disaggregation is disabled); set '
                f'{name("cluster.prefill_instances")} and {name("cluster.decode_instances")} to enable')
        if isinstance(config.workload, TraceWorkload):
            raise ConfigError(text)
        warn(text)
    if cluster.encode_ignored:  # in BLIS's "has no effect" form (its own wording unverified)
        warn(f'{name("cluster.encode_instances")}={cluster.encode_instances} has no effect because '
             f'{name("cluster.encode_decider")}="never" (no request is encoded; the encode instances stay idle); '
             f'set {name("cluster.encode_decider")} always or multimodal to enable')
    if d.defaults_filepath is not None:
        warn(f"{name('deployment.defaults_filepath')} {d.defaults_filepath}: only its kv_offload_devices are read "
             "(device classes for the offload chain); blis-jax's other presets and coefficients are built in")
    kind, alpha, beta = _coefficients(d)
    arch = load_model(d.model)  # ids are matched case-insensitively, as BLIS lower-cases them
    hardware, tp = _hardware_and_tp(d, arch.hf_id)
    gpu = load_gpu(hardware)
    latency_model = _latency_model(kind, arch, gpu, tp, alpha, beta, f"{name('deployment.latency_model')} {kind}")
    blocks = _kv_blocks(d, arch, gpu, tp, warn, lora.reservation_gib if lora is not None else 0.0)
    max_model_len = _max_model_len("deployment.max_model_len", d.max_model_len, arch, blocks, d.block_size)
    pools = {pool: _pool_deployment(d, pool, cluster, arch, kind, alpha, beta, gpu, tp, latency_model, warn)
             for pool in ("prefill", "decode")}
    startup = (_startup_instances(d, cluster, arch, gpu, tp, blocks, max_model_len, warn)
               if cluster.node_pools else None)
    return ResolvedScenario(
        config=config, latency_model=latency_model, model_id=arch.hf_id, hardware=gpu.name, tp=tp,
        latency_kind=kind, total_kv_blocks=blocks, max_model_len=max_model_len, block_size=d.block_size,
        max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
        long_prefill_token_threshold=e.long_prefill_token_threshold, scheduler=e.scheduler,
        preemption_policy=e.preemption_policy, horizon_us=horizon_us, cluster=cluster,
        kv_bytes_per_token=kv_bytes_per_token(arch, tp), prefill_pool=pools["prefill"], decode_pool=pools["decode"],
        startup=startup, lora=lora, cpu_tier=_cpu_tier(d), offload=_offload(d, arch, tp))


# ------------------------------------------------------------------------------ workloads


def distribution_workload(w: SyntheticWorkload, horizon_us: int | None, *, warn: Warn | None = None):
    """The `DistributionWorkload` (rate, lengths, timeout, horizon) a `SyntheticWorkload` generates."""
    from blis_jax.workload.distribution import DistributionWorkload
    from blis_jax.workload.presets import preset_workload

    warn = warn or _python_warning
    if w.kind != "distribution":
        explicit = [name(f"workload.{kind}") + "*" for kind in ("prompt", "output") if getattr(w, kind) is not None]
        if w.prefix_tokens is not None:
            explicit.append(name("workload.prefix_tokens"))
        if explicit:
            warn(f"{name('workload.kind')} {w.kind}: the preset sets the lengths; {', '.join(explicit)} ignored")
        return preset_workload(w.kind, rate=w.rate, num_requests=w.num_requests, timeout_s=w.timeout_s,
                               horizon_us=horizon_us)
    prompt, output, prefix = w.lengths()
    return DistributionWorkload(rate=w.rate, num_requests=w.num_requests, prompt=prompt, output=output,
                                prefix_tokens=prefix, timeout_s=w.timeout_s, horizon_us=horizon_us)


def _resolve_synthetic(config: ScenarioConfig, w: SyntheticWorkload, warn: Warn) -> ResolvedScenario:
    from blis_jax.workload.distribution import constant_iat_us, generate_distribution

    workload = distribution_workload(w, config.horizon_us, warn=warn)
    n = workload.num_requests
    if workload.horizon_us is not None:
        by_horizon = workload.horizon_us // constant_iat_us(workload.rate)
        n = by_horizon if n == 0 else min(n, by_horizon)
    limits.check_requests(n, f"lower {name('workload.num_requests')}" if n == workload.num_requests
                          else f"shorten {name('horizon_us')}")
    resolved = resolve_deployment(config, horizon_us=config.horizon_us, warn=warn)
    requests = generate_distribution(workload, config.effective_seed)
    _check_some_requests(requests)
    header = _with_offload_block(TraceHeader(mode="generated", workload_seed=config.effective_seed), resolved.offload)
    return dataclasses.replace(resolved, requests=requests, header=header)


def _resolve_spec(config: ScenarioConfig, w: SpecWorkload, warn: Warn) -> ResolvedScenario:
    from blis_jax.workload.generate import generate_workload
    from blis_jax.workload.sessions import closed_loop_requests

    spec = w.load()
    limits.check_requests(_spec_request_estimate(spec, w, config.horizon_us),
                          f"lower num_requests (or {name('workload.num_requests')}) or the horizon")
    resolved = resolve_deployment(config, horizon_us=config.horizon_us, warn=warn)
    generated = generate_workload(spec, config.seed, num_requests=w.num_requests, horizon_us=config.horizon_us,
                                  timeout_s=w.timeout_s, sessions="first_round")
    requests, sessions = generated.requests, None
    if generated.sessions:
        requests, sessions = closed_loop_requests(generated)
    _check_some_requests(requests)
    # a spec's goodput targets go into the header and the metrics, as in BLIS
    header = _with_offload_block(TraceHeader(mode="generated", workload_seed=config.effective_seed,
                                             goodput_slo_targets=spec.goodput_slo_targets), resolved.offload)
    return dataclasses.replace(resolved, requests=requests, sessions=sessions, header=header,
                               goodput_targets=spec.goodput_slo_targets)


def _resolve_trace(config: ScenarioConfig, w: TraceWorkload, warn: Warn) -> ResolvedScenario:
    from blis_jax.workload.tracev2 import read_trace

    header, requests = read_trace(w.header, w.data)
    if len(requests) == 0:
        raise ConfigError(f"{name('workload.data')} {w.data}: no request records; the CSV has only a header row")
    block = header.extra.get("kv_offload")
    header_offload = None
    if block is not None:
        # BLIS replays the header's resolved offload chain (blis-features §1.2: it is authoritative)
        header_offload = from_header_block(block, f"{name('workload.header')} {w.header}: kv_offload")
        d = config.deployment
        if d.kv_cpu_blocks:
            raise ConfigError(f"{name('deployment.kv_cpu_blocks')}: the trace header's kv_offload block configures "
                              "the multi-tier offload chain, which excludes the legacy CPU tier; drop "
                              f"{name('deployment.kv_cpu_blocks')}")
        if d.kv_offload_config is not None:
            warn(f"{name('deployment.kv_offload_config')} {d.kv_offload_config} ignored: the trace header "
                 f"{w.header} has a kv_offload block, which BLIS's replay takes instead (the header is authoritative)")
            config = dataclasses.replace(config, deployment=dataclasses.replace(d, kv_offload_config=None))
        if header_offload.block_size != d.block_size:
            raise ConfigError(f"{name('workload.header')} {w.header}: kv_offload.block_size "
                              f"{header_offload.block_size} differs from {name('deployment.block_size')} "
                              f"{d.block_size}; replay with {name('deployment.block_size')} "
                              f"{header_offload.block_size}, the generating run's")
    limits.check_requests(len(requests), "replay a part of the trace")
    resolved = resolve_deployment(config, horizon_us=replay_horizon(config.horizon_us, requests), warn=warn)
    if header_offload is not None:
        own = int(resolved.kv_bytes_per_token * resolved.block_size)
        if own != header_offload.per_block_bytes:
            warn(f"{name('workload.header')} {w.header}: kv_offload.per_block_bytes {header_offload.per_block_bytes} "
                 f"is not this deployment's KV bytes per block ({own}, {resolved.model_id} at TP {resolved.tp}); the "
                 "header's figure sizes the CPU tier, as in BLIS")
        resolved = dataclasses.replace(resolved, offload=header_offload)
    observed = header.extra.get("observed_kv_metrics")
    if isinstance(observed, Mapping) and observed.get("source") == "tiered" and resolved.offload is None:
        # BLIS: an observed trace of a tiered (offloading) server needs the offload chain to replay
        raise ConfigError(f"{name('workload.header')} {w.header}: observed_kv_metrics come from a tiered KV store "
                          f"(source: tiered) but no offload chain is configured; give "
                          f"{name('deployment.kv_offload_config')} (or a kv_offload block in the header)")
    header = _with_offload_block(dataclasses.replace(header, mode="replayed"), resolved.offload)
    return dataclasses.replace(resolved, requests=requests, header=header, goodput_targets=header.goodput_slo_targets)


def _with_offload_block(header: TraceHeader, offload) -> TraceHeader:
    """The header with the resolved offload chain as its kv_offload block (BLIS writes it with
    --trace-output), or as it was without one."""
    if offload is None:
        return header
    return dataclasses.replace(header, extra={**header.extra, "kv_offload": to_header_block(offload)})


def replay_horizon(horizon_us: int | None, requests: RequestSet) -> int | None:
    """An explicit horizon, else BLIS's replay default: 2 × the latest injection time (no
    horizon when every request is injected at time 0). Trace times are at most
    limits.MAX_TIME_US, so the doubled time fits int64."""
    if horizon_us is not None:
        return horizon_us
    latest = int(requests.arrival_us.max()) if len(requests) else 0
    return 2 * latest if latest > 0 else None


def _check_some_requests(requests: RequestSet) -> None:
    if len(requests) == 0:
        raise ConfigError(f"no requests to simulate: {name('horizon_us')} is shorter than one inter-arrival time "
                          f"(1/{name('workload.rate')}); raise {name('horizon_us')} or {name('workload.rate')}")


def _spec_request_estimate(spec, w: SpecWorkload, horizon_us: int | None) -> int:
    """Requests a spec will generate (before generating them): the count, else rate x horizon."""
    n = w.num_requests if w.num_requests is not None else spec.num_requests
    if n:
        return n
    horizon = horizon_us or spec.horizon
    estimate = 0
    if horizon and spec.aggregate_rate:
        estimate = int(spec.aggregate_rate * horizon / 1e6)
    if spec.inference_perf is not None:
        estimate = max(estimate, int(sum(s.rate * s.duration for s in spec.inference_perf.stages)))
    return estimate


# ----------------------------------------------------------------------------- deployment


def _coefficients(d: Deployment) -> tuple[str, tuple | None, tuple | None]:
    if d.alpha is not None:
        return d.latency_model, d.alpha, d.beta
    if d.coefficients is not None:
        coeffs = load_coefficients(d.coefficients)
        return d.latency_model, coeffs.alpha, coeffs.beta
    return d.latency_model, None, None


def _latency_model(kind, arch, gpu, tp, alpha, beta, where: str):
    from blis_jax.latency import build_latency_model

    try:
        return build_latency_model(kind, arch, gpu, tp, alpha=alpha, beta=beta)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _hardware_and_tp(d: Deployment, hf_id: str) -> tuple[str, int]:
    table = model_defaults()
    defaults = table.get(hf_id.lower()) or table.get(str(d.model).lower())
    hardware = d.hardware or (defaults[0] if defaults else DEFAULT_HARDWARE)
    tp = d.tp if d.tp else (defaults[1] if defaults else DEFAULT_TP)
    return hardware, tp


def _cpu_tier(d: Deployment):
    """The legacy CPU KV tier of the deployment, None without `kv_cpu_blocks`."""
    if not d.kv_cpu_blocks:
        return None
    from blis_jax.engine.cpu_tier import CpuTier

    return CpuTier(blocks=d.kv_cpu_blocks, bandwidth=float(d.kv_transfer_bandwidth),
                   base_latency_us=int(d.kv_transfer_base_latency))


def _offload(d: Deployment, arch, tp: int):
    """The multi-tier offload chain of `deployment.kv_offload_config`, None without one; its CPU
    tier counts blocks of this model's KV bytes per GPU block at this TP."""
    if d.kv_offload_config is None:
        return None
    devices = None
    if d.defaults_filepath is not None:
        devices = {**device_classes(), **device_classes(d.defaults_filepath)}
    return load_offload_config(d.kv_offload_config, kv_block_bytes(arch, tp, d.block_size), d.block_size,
                               devices=devices, source=f"{name('deployment.kv_offload_config')} {d.kv_offload_config}")


def _kv_blocks(d: Deployment, arch, gpu, tp: int, warn: Warn, lora_reserve_gib: float = 0.0) -> int:
    if d.total_kv_blocks is not None:
        return d.total_kv_blocks
    try:
        return auto_kv_blocks(arch, gpu, tp, gpu_memory_utilization=d.gpu_memory_utilization, block_size=d.block_size,
                              lora_reserve_gib=lora_reserve_gib)
    except ConfigError as e:
        # BLIS: an over-committed GPU is fatal; any other auto-sizing failure falls back to
        # the phantom total-kv-blocks default with a warning.
        if "do not fit" in str(e) or "divisible" in str(e):
            raise
        warn(f"KV blocks could not be auto-computed ({e}); using {name('deployment.total_kv_blocks')} "
             f"{PHANTOM_KV_BLOCKS}. Set {name('deployment.total_kv_blocks')} to choose it")
        return PHANTOM_KV_BLOCKS


def _max_model_len(path: str, value: int, arch, blocks: int, block: int) -> int:
    """An explicit max-model-len (checked against the KV capacity), else BLIS's auto value."""
    if value == 0:
        return auto_max_model_len(arch, blocks, block)
    needed = -(-value // block)
    if needed > blocks:
        raise ConfigError(f"{name(path)} {value} needs {needed} KV blocks of {block} tokens but the instance has "
                          f"{blocks}; lower {name(path)} or raise {name('deployment.total_kv_blocks')}")
    return value


def _pool_deployment(d: Deployment, pool: str, cluster: ClusterConfig, arch, kind, alpha, beta, base_gpu,
                     base_tp: int, base_model, warn: Warn) -> PoolDeployment | None:
    """A PD pool's own deployment when any of its hardware/tp/max-model-len is set
    (blis-features §3.10: per-pool overrides, pool KV capacity recomputed)."""
    hardware, tp, mml, backend = (getattr(d, f"{pool}_{field}")
                                  for field in ("hardware", "tp", "max_model_len", "latency_model"))
    if hardware is None and tp is None and not mml and backend is None:
        return None
    fields = "/".join(name(f"deployment.{pool}_{field}")
                      for field in ("hardware", "tp", "max_model_len", "latency_model"))
    if not cluster.pd:
        raise ConfigError(f"{fields} configure a PD pool: set {name('cluster.prefill_instances')} and "
                          f"{name('cluster.decode_instances')}")
    gpu = load_gpu(hardware) if hardware is not None else base_gpu
    tp = base_tp if tp is None else tp
    if backend is not None and backend != kind:
        # another backend keeps the cluster's alpha (as BLIS: a roofline pool beside trained-physics
        # enqueues after α0 + α1·input with trained-physics's α), with its own beta
        kind, alpha, beta = backend, tuple(float(a) for a in base_model.alpha.tolist()), None
    model = _latency_model(kind, arch, gpu, tp, alpha, beta,
                           f"{name(f'deployment.{pool}_tp')} / {name(f'deployment.{pool}_hardware')} / "
                           f"{name(f'deployment.{pool}_latency_model')}")
    blocks = _kv_blocks(d, arch, gpu, tp, warn)
    path = f"deployment.{pool}_max_model_len" if mml else "deployment.max_model_len"
    max_model_len = _max_model_len(path, mml or d.max_model_len, arch, blocks, d.block_size)
    return PoolDeployment(latency_model=model, total_kv_blocks=blocks, max_model_len=max_model_len,
                          hardware=gpu.name, tp=tp, kv_bytes_per_token=kv_bytes_per_token(arch, tp))


def _startup_instances(d: Deployment, cluster: ClusterConfig, arch, gpu, tp: int, blocks: int, max_model_len: int,
                       warn: Warn) -> infra.StartupInstances:
    """The startup instances on node pools (blis-infra §2.3 B, §3.3-§3.4): first-fit placement;
    each placed instance's KV blocks recomputed from its GPU type's memory (the first pool of
    that type) unless the blocks are explicit, max-model-len capped at its KV capacity; then
    the loading delays, in index order. Step times keep the deployment's GPU calibration."""
    placements, owner = infra.place_instances(cluster.node_pools, cluster.num_instances, tp)
    kv, mml = [], []
    for p in placements:
        b, m = blocks, max_model_len
        if p is not None and d.total_kv_blocks is None:
            try:
                b = auto_kv_blocks(arch, dataclasses.replace(gpu, memory_gib=p.gpu_memory_gib), tp,
                                   gpu_memory_utilization=d.gpu_memory_utilization, block_size=d.block_size)
            except ConfigError as e:  # BLIS: a warning, and the global block count is kept
                warn(f"{p.instance_id} on {p.gpu_type} ({p.gpu_memory_gib:g} GiB): KV blocks could not be recomputed "
                     f"({e}); keeping {blocks}")
                b = blocks
            if m > 0 and b * d.block_size < m:
                m = b * d.block_size
        kv.append(b)
        mml.append(m)
    pending = [f"instance_{i}" for i, p in enumerate(placements) if p is None]
    if pending:  # BLIS says nothing; an absent instance deserves a line
        later = ("pending: retried when a provisioned node turns Ready" if cluster.provision_nodes
                 else "not started (absent from the outputs)")
        warn(f"{', '.join(pending)}: no Ready node has {max(tp, 1)} free GPUs; {later}")
    return infra.StartupInstances(
        placements=placements, total_kv_blocks=tuple(kv), max_model_len=tuple(mml),
        loaded_at_us=infra.loading_delays(placements, cluster.instance_lifecycle, cluster.seed), gpu_owner=owner)
