"""Host driver of the cluster loop: configuration → arrays → chunked jitted loop → `SimOutput`.

`simulate_cluster` sizes the buffers (the single-instance engine's dims, plus the instance
count), runs `loop.advance` in chunks of events (reading every instance's ITL log between
chunks, as the single-instance driver does), regrows and reruns on an overflow result, and
merges the instances' outputs into one `SimOutput` with per-instance counters and
`handled_by` per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax import executables
from blis_jax.cluster import admission as adm
from blis_jax.cluster import autoscaler as asc
from blis_jax.cluster import deployments as deploy
from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster import node_pools as infra
from blis_jax.cluster import gateway as gw
from blis_jax.cluster import pd as pd_rules
from blis_jax.cluster import drain, loop, scaling, warm_up
from blis_jax.cluster import encode as encode_rules
from blis_jax.cluster import routing as routing_policies
from blis_jax.cluster import scorers as sc
from blis_jax.engine import output as so
from blis_jax.engine import results
from blis_jax.engine.dims import bucket, choose_dims
from blis_jax.engine.growth import Growth, run_growing
from blis_jax.engine.itl_log import ItlLogReader
from blis_jax.engine.params import INF_TIME, EngineParams
from blis_jax.engine.simulate import (request_arrays, to_output, with_adapter_counts, with_cpu_tier, with_lora,
                                      with_offload, with_offload_params, with_tier_params)
from blis_jax.errors import ConfigError
from blis_jax.naming import name
from blis_jax.rng.go_jax import go_stream
from blis_jax.rng.streams import DECODE_ROUTER, PREFILL_ROUTER, ROUTER, subsystem_seed
from blis_jax.workload.requests import RequestSet

MAX_INSTANCES = 1024


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """BLIS's cluster flags (names as on the command line, defaults as BLIS's)."""

    num_instances: int = 1
    routing_policy: str = "round-robin"
    routing_scorers: str | None = None  # weighted: "name:weight,..."; None = default profile
    admission_policy: str = "always-admit"
    token_bucket_capacity: float = 10_000
    token_bucket_refill_rate: float = 1_000
    tier_shed_threshold: int = 0  # tier-shed (BLIS policy-bundle keys, flags here)
    tier_shed_min_priority: int = 0
    queue_depth_threshold: float = 5.0  # gaie-legacy saturation
    kv_cache_util_threshold: float = 0.8
    snapshot_refresh_interval_us: int = 50_000
    cache_signal_delay_us: int = 50_000
    admission_latency_us: int = 0
    routing_latency_us: int = 0
    seed: int = 42
    instance_slots: int | None = None  # compiled slots (>= num_instances); None = num_instances
    # prefill/decode disaggregation (blis-features §3.10): the first `prefill_instances` slots
    # are prefill-only, the next `decode_instances` decode-only, the next
    # `prefill_decode_instances` shared (in both pools)
    prefill_instances: int = 0
    decode_instances: int = 0
    prefill_decode_instances: int = 0
    pd_decider: str = "never"
    pd_prefix_threshold: int = 16
    pd_transfer_bandwidth: float = 25.0  # GB/s
    pd_transfer_base_latency: float = 0.05  # ms
    pd_transfer_contention: bool = False
    prefill_routing_scorers: str | None = None  # weighted routing inside the prefill pool
    decode_routing_scorers: str | None = None
    # E/P/D (cluster/encode.py): the next `encode_instances` slots after the PD pools are the
    # encode pool (they serve nothing); when `encode_decider` fires for a request, an encode
    # routing decision with the main policy comes first, a rejection if the pool is empty
    encode_instances: int = 0
    encode_decider: str = "never"
    flow_control: gw.FlowControlConfig | None = None  # the gateway queue (--flow-control); None = off
    # the model every instance serves (BLIS: --model lower-cased): a request tagged with another
    # model is rejected at routing (blis-infra §5); None = every instance serves every request
    served_model: str | None = None
    # node pools and the startup instances' lifecycle (policy bundle keys node_pools,
    # instance_lifecycle; blis-infra §2-§3): () = no pools, every instance Active at t = 0
    node_pools: tuple[infra.NodePool, ...] = ()
    instance_lifecycle: infra.InstanceLifecycle = infra.InstanceLifecycle()
    # the autoscaler (blis-infra §4): its settings (the bundle's `autoscaler` section), and
    # BLIS's --model-autoscaler-interval-us, which overrides their interval whenever given (0 =
    # off) and alone enables an autoscaler with default settings
    autoscaler: asc.AutoscalerConfig | None = None
    model_autoscaler_interval_us: float | None = None
    # library-only lifecycle features of BLIS (its bundle parser rejects these keys; blis-jax
    # extensions on the CLI): warm-up (warm_up.py: instances start WarmingUp until this many
    # requests completed on them; their first this-many routed requests' cluster-level TTFT is
    # multiplied by the factor when > 1; 0 = off), and how the autoscaler drains an instance
    # (scaling.py: "bare", BLIS's CLI behaviour, or the WAIT / IMMEDIATE / REDIRECT policies)
    warm_up_request_count: int = 0
    warm_up_ttft_factor: float = 0.0
    drain_policy: str = "bare"
    # a blis-jax extension beyond BLIS (whose autoscaler never provisions nodes): a scale-up
    # that finds no room provisions a node of the pool (up to `max_nodes`, Ready after the
    # pool's `provisioning_delay` drawn from the `node-provisioning` stream; scaling.py); its
    # NodeReady events retry the pending startup instances (BLIS library behaviour, §3.5)
    provision_nodes: bool = False
    # node drains (a BLIS library call, blis-infra §3.5): (node ID, µs) pairs; at that time a
    # Ready node turns Draining (nothing is placed on it any more) and is Terminated once none
    # of its GPUs is allocated. Needs provision_nodes (the node lifecycle lives there)
    node_drains: tuple[tuple[str, int], ...] = ()

    def validate(self) -> ClusterConfig:
        n = self.num_instances
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_INSTANCES:
            raise ConfigError(f"--num-instances must be an integer in 1..{MAX_INSTANCES}, got {n!r}")
        if self.instance_slots is not None and self.instance_slots < n:
            raise ConfigError(f"instance slots ({self.instance_slots}) must be >= --num-instances ({n})")
        routing_policies.check_policy(self.routing_policy)
        for flag, value in (("--snapshot-refresh-interval", self.snapshot_refresh_interval_us),
                            ("--cache-signal-delay", self.cache_signal_delay_us),
                            ("--admission-latency", self.admission_latency_us),
                            ("--routing-latency", self.routing_latency_us)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{flag} must be an integer >= 0 microseconds, got {value!r}")
        if self.routing_policy == "weighted":
            sc.parse_profile(self.routing_scorers or sc.DEFAULT_PROFILE)
        self.admission()
        if self.flow_control is not None:
            if self.admission_policy != "always-admit":
                raise ConfigError(f"--flow-control: the gateway queue is the admission policy; drop --admission-policy "
                                  f"{self.admission_policy} (or --flow-control)")
            self.flow_control.validate()
        autoscaler = self.effective_autoscaler()
        if autoscaler is not None and self.pd:
            raise ConfigError("the autoscaler with PD pools is not simulated (BLIS's autoscaler creates instances "
                              "without a PD role); drop the autoscaler or the PD pools")
        if self.pd:
            self.pool_masks()
            if self.prefill_decode_instances == 0 and (self.prefill_instances == 0 or self.decode_instances == 0):
                raise ConfigError("--prefill-instances and --decode-instances: disaggregation needs both pools "
                                  f"(got {self.prefill_instances} prefill, {self.decode_instances} decode); "
                                  "or set --prefill-decode-instances for pods that serve both roles")
            self.pd_config()
            for flag, text in (("--prefill-routing-scorers", self.prefill_routing_scorers),
                               ("--decode-routing-scorers", self.decode_routing_scorers)):
                if text is not None:
                    sc.parse_profile(text, flag)
        elif self.prefill_routing_scorers or self.decode_routing_scorers or self.pd_decider != "never":
            raise ConfigError("--pd-decider / --prefill-routing-scorers / --decode-routing-scorers need PD pools: "
                              "set --prefill-instances and --decode-instances (or --prefill-decode-instances)")
        self._check_encode(autoscaler)
        infra.check_pools(self.node_pools)
        if not isinstance(self.instance_lifecycle, infra.InstanceLifecycle):
            raise ConfigError("instance_lifecycle: expected an InstanceLifecycle")
        self.instance_lifecycle.check()
        warm_up.check(self.warm_up_request_count, self.warm_up_ttft_factor)
        drain.check_drain_policy(self.drain_policy)
        if self.drain_policy != "bare" and autoscaler is None:
            raise ConfigError(f"{name('cluster.drain_policy')} {self.drain_policy}: only the autoscaler's scale-down "
                              f"drains instances; enable it ({name('cluster.model_autoscaler_interval_us')} or the "
                              "policy bundle's autoscaler) or leave the drain policy at bare")
        if self.provision_nodes and (autoscaler is None or not self.node_pools):
            raise ConfigError(f"{name('cluster.provision_nodes')}: only the autoscaler's scale-up provisions nodes, on "
                              "node pools; enable the autoscaler and give node_pools (with max_nodes > initial_nodes)")
        self._check_node_drains()
        if self.drain_policy == "redirect" and (self.flow_control is not None or self.admission().reads_state):
            raise ConfigError(f"{name('cluster.drain_policy')} redirect with flow control or a state-reading "
                              "admission policy (tier-shed, gaie-legacy) is not simulated yet")
        if self.node_pools and self.pd:
            raise ConfigError("node_pools with prefill/decode pools are not supported yet; drop node_pools from the "
                              "policy bundle or --prefill-instances/--decode-instances")
        return self

    def _check_encode(self, autoscaler):
        encode_rules.check_decider(self.encode_decider)
        if not self.encode:
            return
        self.encode_mask()  # pool sizes (negative counts, sum > --num-instances)
        for on, what in ((autoscaler is not None, "the autoscaler"), (bool(self.node_pools), "node_pools"),
                         (self.flow_control is not None, "--flow-control")):
            if on:
                raise ConfigError(f"--encode-instances / --encode-decider with {what} are not simulated yet (the "
                                  f"idle encode instances would count in its instance views); drop {what} or the "
                                  "encode pool")

    def _check_node_drains(self):
        if not self.node_drains:
            return
        field = name("cluster.node_drains")
        if not self.provision_nodes:
            raise ConfigError(f"{field}: node drain is part of the node lifecycle of "
                              f"{name('cluster.provision_nodes')}; set it (with the autoscaler and node_pools)")
        nodes = {g.node for g in infra.inventory(self.node_pools, provisionable=True)}
        seen = set()
        for entry in self.node_drains:
            if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str)
                    or isinstance(entry[1], bool) or not isinstance(entry[1], int) or entry[1] < 0):
                raise ConfigError(f"{field}: each entry is (node ID, time in µs >= 0), e.g. ('pool-0', 5_000_000); "
                                  f"got {entry!r}")
            if entry[0] not in nodes:
                raise ConfigError(f"{field}: unknown node {entry[0]!r}; nodes are <pool name>-<k>, k < "
                                  f"max(max_nodes, initial_nodes): {', '.join(sorted(nodes))}")
            if entry[0] in seen:
                raise ConfigError(f"{field}: node {entry[0]!r} is drained twice; give each node at most once")
            seen.add(entry[0])

    def effective_autoscaler(self) -> asc.AutoscalerConfig | None:
        """The autoscaler that runs (None: off), with the flag's interval precedence."""
        config = self.autoscaler
        flag = self.model_autoscaler_interval_us
        if flag is not None:
            config = (dataclasses.replace(config, interval_us=flag) if config is not None and config.interval_us > 0
                      else asc.AutoscalerConfig(interval_us=flag))
        if config is None:
            return None
        config.validate("--model-autoscaler-interval-us / autoscaler" if flag is not None else "autoscaler")
        return config if config.interval_us > 0 else None

    @property
    def pd(self) -> bool:
        return bool(self.prefill_instances or self.decode_instances or self.prefill_decode_instances)

    @property
    def encode(self) -> bool:
        """An encode pool or an encode decider: the loop compiles the encode step."""
        return bool(self.encode_instances) or self.encode_decider != "never"

    @property
    def encode_ignored(self) -> bool:
        """Encode instances whose decider never fires: they only sit idle (warned)."""
        return bool(self.encode_instances) and self.encode_decider == "never"

    @property
    def decider_ignored(self) -> bool:
        """BLIS's "--pd-decider has no effect because --prefill-instances=0" case (shared pods
        only): `blis run` warns and still disaggregates between shared pods; `blis replay`
        refuses it."""
        return self.pd and self.prefill_instances == 0 and self.pd_decider != "never"

    def pool_masks(self):
        """(prefill-role, decode-role) masks over the slots (shared pods in both)."""
        return self._masks()[:2]

    def encode_mask(self):
        """The encode pool's slots (the last pool indices)."""
        return self._masks()[2]

    def _masks(self):
        return pd_rules.pool_masks(self.slots, prefill=self.prefill_instances, decode=self.decode_instances,
                                   shared=self.prefill_decode_instances, encode=self.encode_instances,
                                   num_instances=self.num_instances)

    def pd_config(self):
        return pd_rules.make_pd_config(self.pd_decider, prefix_threshold=self.pd_prefix_threshold,
                                       transfer_bandwidth_gbps=self.pd_transfer_bandwidth,
                                       transfer_base_latency_ms=self.pd_transfer_base_latency,
                                       contention=self.pd_transfer_contention)

    def pool_routing(self) -> tuple[routing_policies.Weighted | None, routing_policies.Weighted | None]:
        """(prefill pool's routing policy, decode pool's), each None without pool scorers (the
        pool then routes with the cluster's policy)."""
        return tuple(None if text is None else routing_policies.Weighted(sc.make_profile(text, self.slots, flag=flag))
                     for flag, text in (("--prefill-routing-scorers", self.prefill_routing_scorers),
                                        ("--decode-routing-scorers", self.decode_routing_scorers)))

    @property
    def slots(self) -> int:
        return self.instance_slots or self.num_instances

    def admission(self) -> adm.AbstractAdmission:
        return adm.make_admission(self.admission_policy, token_bucket_capacity=self.token_bucket_capacity,
                                  token_bucket_refill_rate=self.token_bucket_refill_rate,
                                  tier_shed_threshold=self.tier_shed_threshold,
                                  tier_shed_min_priority=self.tier_shed_min_priority,
                                  queue_depth_threshold=self.queue_depth_threshold,
                                  kv_cache_util_threshold=self.kv_cache_util_threshold)

    def routing(self) -> routing_policies.AbstractRouting:
        """The cluster's routing policy (`--routing-scorers` is read by weighted routing only)."""
        weighted = self.routing_policy == "weighted"
        return routing_policies.make_routing(self.routing_policy, self.slots,
                                             scorers=(self.routing_scorers or None) if weighted else None)


@dataclasses.dataclass(frozen=True)
class ViewRows:
    """The rows of an instance view with extra sub-request rows (`InstanceViews.requests`): an
    instance's metrics block reads no request field, only that the rows line up."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclasses.dataclass(frozen=True)
class InstanceViews:
    """What each instance itself served, for its own metrics block: with PD pools, a prefill
    instance served prompt-only sub-requests and a decode instance the decode sub-requests,
    whose metrics differ from their parent requests'."""

    outputs: tuple[so.SimOutput, ...]  # outputs[k]: rows served by instance k, handled_by == k
    disaggregated: np.ndarray  # per request
    dropped_at_decode: int
    transfer_us: np.ndarray  # durations of the transfers that started
    prefill_completed: int  # completions (sub-requests and whole requests) on prefill-pool instances
    decode_completed: int  # ... on decode-pool instances (a shared pod's count in both)
    # outputs[k]'s requests when they differ from the run's: a shared pod that prefilled and
    # then decoded a request served it twice (one extra row for its prefill sub-request)
    requests: tuple[ViewRows | None, ...] = ()
    contention: bool = False  # --pd-transfer-contention: the section reports the transfer queue
    transfers_in_flight: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    #   transfers active at each start, itself included


def simulate_cluster(requests: RequestSet, params: EngineParams, model, cluster: ClusterConfig,
                     **kwargs) -> so.SimOutput:
    """Simulate `requests` on a cluster; one output row per request. Instances are identical
    unless PD pools bring their own deployment (`prefill_pool`, `decode_pool` keywords)."""
    return simulate_cluster_views(requests, params, model, cluster, **kwargs)[0]


NEW_SLOTS = 8  # instance slots planned for autoscaler-created instances (x4 per rerun when full)


def simulate_cluster_views(requests: RequestSet, params: EngineParams, model, cluster: ClusterConfig, **kwargs
                           ) -> tuple[so.SimOutput, InstanceViews | None]:
    """`simulate_cluster`, plus the per-instance views when there are PD pools (keywords: see
    `_simulate_cluster_views`). An autoscaler that places instances on node pools gets
    instance slots for them; it reruns with 4x as many if it ran out."""
    cluster = cluster.validate()
    autoscaler = cluster.effective_autoscaler()
    if autoscaler is None or not cluster.node_pools:
        return _simulate_cluster_views(requests, params, model, cluster, autoscaler=autoscaler, **kwargs)
    new_slots = NEW_SLOTS
    while True:
        sized = dataclasses.replace(cluster, instance_slots=cluster.num_instances + new_slots)
        out, views = _simulate_cluster_views(requests, params, model, sized, autoscaler=autoscaler, **kwargs)
        if not out.result & results.INSTANCE_SLOTS_FULL or new_slots >= 64 * NEW_SLOTS:
            return out, views
        new_slots *= 4


def prepare_cluster(requests: RequestSet, params: EngineParams, model, cluster: ClusterConfig,
                    new_slots: int = NEW_SLOTS, **kwargs) -> PreparedCluster:
    """`simulate_cluster_views` taken apart (`PreparedCluster`), with `new_slots` instance slots
    for the autoscaler's instances when it places them on node pools (`simulate_cluster_views`
    starts at NEW_SLOTS and reruns with 4x as many while a run reports INSTANCE_SLOTS_FULL)."""
    cluster = cluster.validate()
    autoscaler = cluster.effective_autoscaler()
    if autoscaler is not None and cluster.node_pools:
        cluster = dataclasses.replace(cluster, instance_slots=cluster.num_instances + new_slots)
    return _simulate_cluster_views(requests, params, model, cluster, autoscaler=autoscaler, prepare=True, **kwargs)


def _simulate_cluster_views(
    requests: RequestSet,
    params: EngineParams,
    model,
    cluster: ClusterConfig,
    *,
    autoscaler: asc.AutoscalerConfig | None = None,
    hardware: str = "",
    block_size: int = 16,
    scheduler: str = "fcfs",
    preemption_policy: str = "fcfs",
    events_per_chunk: int = 200_000,
    kv_bytes_per_token: float = 0.0,
    prefill_pool: deploy.PoolDeployment | None = None,
    decode_pool: deploy.PoolDeployment | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    batch_start: int | None = None,
    startup: infra.StartupInstances | None = None,
    lora=None,
    cpu_tier=None,
    offload=None,
    seed: int | None = None,
    prepare: bool = False,
) -> tuple[so.SimOutput, InstanceViews | None]:
    """`simulate_cluster`, plus the per-instance views when there are PD pools.
    `kv_bytes_per_token` (per GPU of the prefill pool) sizes KV transfers; a `prefill_pool` /
    `decode_pool` deployment runs that pool on its own hardware and TP (the prefill pool's
    then sizes the transfers); `progress(done, total, sim_us)` is called between chunks;
    `batch_start`: running-batch slots to start with (`dims.choose_dims`; a full batch reruns
    the cluster wider, same outputs); `startup`: the startup instances placed on node pools
    (which exist, their KV blocks, when each becomes routable), None without node pools;
    `cpu_tier` (engine/cpu_tier.CpuTier) / `offload` (config.kv_offload.OffloadConfig): a KV tier
    below each instance's GPU cache, every instance with its own store and counters; the chain's
    jitter draws come from the `kv-offload` stream of `seed` (default: the cluster's seed), the
    same on every instance as in BLIS (blis-rng §10.3);
    `prepare`: return the run taken apart (`PreparedCluster`) instead of running it."""
    cluster = cluster.validate()
    if (prefill_pool or decode_pool) and not cluster.pd:
        raise ConfigError("--prefill-hardware/--prefill-tp/--decode-hardware/--decode-tp configure PD pools: "
                          "set --prefill-instances and --decode-instances")
    if prefill_pool is not None:
        kv_bytes_per_token = prefill_pool.kv_bytes_per_token
    if cluster.pd and kv_bytes_per_token <= 0:
        raise ConfigError("PD disaggregation needs the model's KV bytes per token to size transfers")
    adapters = None
    if lora is not None:  # LoRA adapters (engine/lora.py): resident sets per instance
        from blis_jax.engine import lora as lora_mod

        if cluster.pd:
            raise ConfigError("LoRA adapters with PD disaggregation are not simulated yet; drop --lora-config or "
                              "the PD pools")
        adapters = lora.adapter_index(lora_mod.adapter_labels(requests))
        params = lora_mod.with_params(params, lora)
    if cpu_tier is not None or offload is not None:
        _check_tiers(cluster, autoscaler, startup, offload, scheduler)
        params = with_tier_params(params, block_size, cpu_tier, offload)
    seed = cluster.seed if seed is None else seed
    kv_blocks = deploy.largest_kv_blocks(params, prefill_pool, decode_pool)
    slot_ids = jnp.arange(cluster.slots)
    prefill_role, decode_role = cluster.pool_masks() if cluster.pd else (slot_ids < 0, slot_ids >= 0)
    deployed = deploy.stack_deployments(model, params, cluster.slots, prefill_role, decode_role,
                                        prefill=prefill_pool, decode=decode_pool)
    exists, lifecycle0 = slot_ids < cluster.num_instances, None
    if startup is not None:
        deployed, exists, lifecycle0 = _place(deployed, startup, cluster)
        kv_blocks = max(kv_blocks, int(np.max(np.asarray(deployed.total_kv_blocks))))
    scaling_setup = (_scaling_setup(autoscaler, cluster, startup, params, deployed, hardware)
                     if autoscaler is not None else None)
    if scaling_setup is not None:
        deployed = scaling_setup.deployed
        if scaling_setup.provisioning is not None:   # the provisionable inventory's GPU owners
            lifecycle0 = dataclasses.replace(lifecycle0, gpu_owner=jnp.asarray(scaling_setup.provisioning["owner"]))
    gateway, bands, tenants = (gw.make_params(cluster.flow_control, requests, cluster.queue_depth_threshold,
                                              cluster.kv_cache_util_threshold)
                               if cluster.flow_control is not None else (None, 1, 1))

    def build(growth: Growth):
        edims = choose_dims(
            input_len=requests.input_len, output_len=requests.output_len, prefix_group=requests.prefix_group,
            prefix_len=requests.prefix_len, max_num_seqs=int(params.max_num_seqs),
            max_num_batched_tokens=int(params.max_num_batched_tokens), total_kv_blocks=kv_blocks,
            block_size=block_size, scheduler=scheduler, preemption_policy=preemption_policy, growth=growth,
            step_log=events_per_chunk, batch_start=batch_start,
        )
        edims = with_lora(dataclasses.replace(edims, sample_wait=True), lora)  # sample_wait: HOL blocking events
        edims = with_offload(with_cpu_tier(edims, cpu_tier), offload, growth.offload)
        run_params = with_offload_params(params, edims, offload, seed)
        if cluster.pd:
            edims = dataclasses.replace(edims, exit_log=2 * edims.batch_slots, transfers=True)
        shared = cluster.pd and cluster.prefill_decode_instances > 0
        gateway_slots = 0
        if gateway is not None:
            depth = cluster.flow_control.max_gateway_queue_depth
            gateway_slots = bucket(max(1, min(len(requests), depth if depth > 0 else 256))) * growth.gateway_slots
        routings = (cluster.routing(), *(cluster.pool_routing() if cluster.pd else (None, None)))
        cd = loop.ClusterDims(
            engine=edims, num_instances=cluster.slots, **loop.routing_dims(*routings), pd=cluster.pd,
            transfers=bucket(64 * growth.transfers) if cluster.pd else 1, shared_pods=shared,
            admission_reads_state=cluster.admission().reads_state,
            gateway_slots=gateway_slots, gateway_bands=bands, gateway_tenants=tenants,
            warm_up=cluster.warm_up_request_count > 0, encode=cluster.encode,
            **(scaling_setup.dims(growth) if scaling_setup is not None else {}),
        )
        cparams = loop.ClusterParams(
            active=exists,
            admission_latency_us=jnp.asarray(cluster.admission_latency_us, jnp.int64),
            routing_latency_us=jnp.asarray(cluster.routing_latency_us, jnp.int64),
            prefill_role=prefill_role, decode_role=decode_role,
            pd=cluster.pd_config() if cluster.pd else None,
            kv_bytes_per_token=jnp.asarray(float(kv_bytes_per_token), jnp.float64),
            total_kv_blocks=deployed.total_kv_blocks, max_model_len=deployed.max_model_len,
            gateway=gw.padded(gateway, edims.num_requests) if gateway is not None else None,
            **model_ids(requests, cluster, edims.num_requests),
            scaling=scaling_setup.params(growth, params) if scaling_setup is not None else None,
            **(encode_params(requests, cluster, edims.num_requests) if cluster.encode else {}),
        )
        req = request_arrays(requests, edims, adapters=adapters)
        streams = tuple(go_stream(subsystem_seed(cluster.seed, name))   # blis-rng §2: seed XOR fnv1a64(name)
                        for name in (ROUTER, PREFILL_ROUTER, DECODE_ROUTER))
        cs = _init(cd, run_params, cparams, req, deployed.model, cluster.admission(),
                   routings, streams, cluster.snapshot_refresh_interval_us,
                   cluster.cache_signal_delay_us, lifecycle0,
                   scaling_setup.state(cd) if scaling_setup is not None else None,
                   warm_up_requests=cluster.warm_up_request_count)
        readers = [ItlLogReader() for _ in range(cluster.slots)]
        inputs = jax.device_put((run_params, cparams, req, deployed.model))
        return cd, cs, inputs, readers, edims

    def attempt(growth: Growth):
        cd, cs, inputs, readers, edims = build(growth)
        events = np.zeros(cluster.slots, np.int64)
        while True:
            # each instance's own budget: one that joins late (the autoscaler's) or idled long
            # must not run more steps in a chunk than the step log holds
            cs, done = advance_chunk(cd, cs, inputs, jnp.asarray(events + events_per_chunk, jnp.int64))
            cs, events = _read_logs(cs, readers)
            if progress is not None:
                progress(int(np.sum(np.asarray(cs.instances.finished))), len(requests),
                         int(np.max(np.asarray(cs.instances.now))))
            if bool(done):
                break
        code = result_code(cs)
        return (cs, edims, code, readers), code

    def finish(cs, edims, code, readers):
        return _finish_cluster(cs, edims, code, readers, requests=requests, params=params, cluster=cluster,
                               startup=startup, scaling_setup=scaling_setup, prefill_role=prefill_role,
                               decode_role=decode_role, lora=lora, slot_alpha=np.asarray(deployed.model.alpha))

    if prepare:  # the batched driver (sweep/scaling_batch.py) runs the chunks of many such runs at once
        return PreparedCluster(build=build, finish=finish)
    return finish(*run_growing(attempt))


def result_code(cs: loop.ClusterState) -> int:
    """A finished cluster run's result code (its instances', the router's, the autoscaler's)."""
    code = (int(np.bitwise_or.reduce(np.asarray(cs.instances.result))) | int(cs.result)
            | scaling.result_bits(jax.device_get(cs.scaling)))
    if cs.gateway is not None and bool(cs.gateway.full):
        code |= results.GATEWAY_FULL
    return code


@dataclasses.dataclass(frozen=True)
class PreparedCluster:
    """A cluster run taken apart for a driver of several runs: `build(growth)` → (dims, initial
    state, (params, cluster params, requests, model), ITL log readers, engine dims), and
    `finish(state, engine dims, result code, readers)` → (output, views), as `simulate_cluster`
    returns them."""

    build: Callable
    finish: Callable


def _finish_cluster(cs, edims, code, readers, *, requests, params, cluster, startup, scaling_setup, prefill_role,
                    decode_role, lora, slot_alpha):
    # the instances that exist (a pending startup instance is absent from every output, as in
    # BLIS); first-fit with one TP for all makes the placed ones a prefix of the indices, and
    # the autoscaler's and those a NodeReady retry placed later follow them in creation order
    built = cluster.num_instances if startup is None else startup.num_placed
    if scaling_setup is not None:
        built = int(cs.scaling.next_slot)
    pools = ((np.asarray(prefill_role), np.asarray(decode_role), cluster.pd_transfer_contention, slot_alpha)
             if cluster.pd else None)
    out, views = merge_outputs(cs, edims, params, requests, code, readers, built, pools)
    if cs.warm_up is not None:  # the post-hoc warm-up penalty (cluster-level TTFTs only)
        out = dataclasses.replace(out, ttft_adjusted_us=warm_up.adjusted_ttft(
            out.ttft_us, np.asarray(cs.warm_up.marks[:len(requests)]), cluster.warm_up_ttft_factor))
    if lora is not None:
        out = with_adapter_counts(out, lora, cs.instances.lora_loads[:built], cs.instances.lora_evictions[:built])
    if scaling_setup is None:
        return out, views
    names = scaling.slot_names(cs.scaling, scaling_setup.model_names[0], built)
    log = scaling.scaling_log_lines(cs.scaling, model_names=scaling_setup.model_names, slot_names=names,
                                    variants=scaling_setup.variants, node_names=scaling_setup.node_names)
    return dataclasses.replace(out, instance_names=tuple(names), cluster_log=tuple(log),
                               instance_entered=np.asarray(jax.device_get(cs.entered))[:built]), views


def _check_tiers(cluster: ClusterConfig, autoscaler, startup, offload, scheduler: str) -> None:
    """The cluster configurations a KV tier (--kv-cpu-blocks, a kv_offload chain) runs in: each
    instance keeps its own store; what would move requests or KV between instances, or create
    instances during the run, is not simulated with one yet (issue #24)."""
    flag = name("deployment.kv_offload_config") if offload is not None else name("deployment.kv_cpu_blocks")
    if cluster.pd:
        raise ConfigError(f"{flag}: a CPU KV tier with PD disaggregation is not simulated yet; drop the PD pools "
                          "(--prefill-instances/--decode-instances) or the tier")
    if autoscaler is not None or startup is not None:
        raise ConfigError(f"{flag}: a CPU KV tier with the autoscaler or node pools is not simulated yet; drop "
                          "the autoscaler / node_pools or the tier")
    if offload is not None and scheduler != "fcfs":
        raise ConfigError("kv_offload: the multi-tier KV offload chain runs with the fcfs scheduler for now")


def _place(deployed: deploy.InstanceDeployments, startup: infra.StartupInstances, cluster: ClusterConfig):
    """(deployments with each placed instance's own KV blocks and max-model-len, the slots
    that hold an instance, the initial lifecycle: Active, or Loading until its delay is over)."""
    n, slots = cluster.num_instances, cluster.slots
    if len(startup.placements) != n:
        raise ConfigError(f"startup instances: {len(startup.placements)} placements for {n} instances")
    placed = np.zeros(slots, bool)
    placed[:n] = startup.placed
    if not np.array_equal(placed[:n], np.arange(n) < startup.num_placed):
        raise ConfigError("startup instances: the placed instances must be the first ones (first-fit placement)")
    if startup.num_placed == 0:
        raise ConfigError("node_pools: no instance could be placed (no Ready node has enough free GPUs); every "
                          "request would be rejected at routing. Add nodes (initial_nodes) or lower --tp")
    blocks = np.asarray(deployed.total_kv_blocks).copy()
    mml = np.asarray(deployed.max_model_len).copy()
    blocks[:n] = np.where(startup.placed, startup.total_kv_blocks, blocks[:n])
    mml[:n] = np.where(startup.placed, startup.max_model_len, mml[:n])
    loaded_at = np.full(slots, INF_TIME, np.int64)
    loaded_at[:n] = startup.loaded_at_us
    ready = lc.WARMING_UP if cluster.warm_up_request_count > 0 else lc.ACTIVE
    state = np.where(placed, np.where(loaded_at > 0, lc.LOADING, ready), lc.ABSENT)
    loaded_at = np.where(state == lc.LOADING, loaded_at, INF_TIME)
    gpus = np.zeros(slots, np.int32)
    gpus[:n] = startup.gpus_held
    lifecycle0 = lc.make(state, loaded_at, gpus, startup.gpu_owner)
    deployed = dataclasses.replace(deployed, total_kv_blocks=jnp.asarray(blocks, jnp.int64),
                                   max_model_len=jnp.asarray(mml, jnp.int64))
    return deployed, jnp.asarray(placed), lifecycle0


@dataclasses.dataclass(frozen=True)
class ScalingSetup:
    """What the autoscaler needs from the host: its replica variants, the GPU inventory, the
    pre-drawn delays, and the deployments of the slots it may fill."""

    config: asc.AutoscalerConfig
    deployed: deploy.InstanceDeployments
    variants: list  # (GPU type, TP, cost) per variant id
    slot_variant: np.ndarray  # per slot
    gpu_node: np.ndarray
    gpu_type: np.ndarray
    variant_gpu_type: np.ndarray
    node_names: list
    model_names: list
    first_new_slot: int
    pools: bool
    seed: int
    loading_delay: infra.Delay
    construction_draws: int
    drain_policy: str = "bare"
    provisioning: dict | None = None  # node provisioning (an extension): per-node arrays, remapped GPU owners

    def dims(self, growth: Growth) -> dict:
        return dict(scaling=True, scaling_models=1, scaling_pending=4 * growth.scaling,
                    scaling_log=bucket(64 * growth.scaling), scaling_pools=self.pools,
                    scaling_drain=self.drain_policy != "bare")

    def params(self, growth: Growth, engine_params: EngineParams) -> scaling.ScalingParams:
        from blis_jax.rng.go_rand import GoRand
        from blis_jax.rng.streams import AUTOSCALER, INSTANCE_LOADING

        draws = bucket(64 * growth.scaling)
        c = self.config

        def table(delay: infra.Delay, stream: str, skip: int = 0):
            rng = GoRand(subsystem_seed(self.seed, stream)) if delay.stddev > 0 else None
            for _ in range(skip if rng is not None else 0):
                rng.norm_float64()
            return jnp.asarray([delay.sample_us(rng) for _ in range(draws)], jnp.int64)

        slots = self.slot_variant.shape[0]
        names = [f"instance_{k}" for k in range(slots)]
        rank = np.empty(slots, np.int64)
        rank[sorted(range(slots), key=lambda k: names[k].encode())] = np.arange(slots)
        return scaling.ScalingParams(
            interval_us=jnp.asarray(int(c.interval_us), jnp.int64),
            up_window_us=jnp.asarray(int(c.scale_up_stabilization_window_us), jnp.int64),
            down_window_us=jnp.asarray(int(c.scale_down_stabilization_window_us), jnp.int64),
            analyzer=asc.AnalyzerParams.of(c.analyzer), variants=asc.Variants.of(self.variants),
            variant_gpu_type=jnp.asarray(self.variant_gpu_type, jnp.int32),
            variant_tp=jnp.asarray([tp for _, tp, _ in self.variants], jnp.int32),
            scrape_delay_us=table(c.hpa_scrape_delay, AUTOSCALER),
            loading_delay_us=table(self.loading_delay, INSTANCE_LOADING, self.construction_draws),
            gpu_node=jnp.asarray(self.gpu_node, jnp.int32), gpu_type=jnp.asarray(self.gpu_type, jnp.int32),
            startup_rank=jnp.asarray(rank), first_new_slot=jnp.asarray(self.first_new_slot, jnp.int32),
            unbounded=jnp.asarray(int(engine_params.horizon_us) >= INF_TIME),
            drain_policy=jnp.asarray(drain.CODES[self.drain_policy], jnp.int32) if self.drain_policy != "bare" else None,
            **self._provisioning_params(draws))

    def _provisioning_params(self, draws: int) -> dict:
        from blis_jax.rng.go_rand import GoRand
        from blis_jax.rng.streams import NODE_PROVISIONING

        if self.provisioning is None:
            return {}
        p = self.provisioning
        rng = GoRand(subsystem_seed(self.seed, NODE_PROVISIONING))
        return dict(node_initial=jnp.asarray(p["initial"]), node_type=jnp.asarray(p["type"], jnp.int32),
                    startup_tp=jnp.asarray(p["startup_tp"], jnp.int32),
                    type_variant=jnp.asarray(p["type_variant"], jnp.int32),
                    node_delay_mean_s=jnp.asarray(p["mean"], jnp.float64),
                    node_delay_std_s=jnp.asarray(p["std"], jnp.float64),
                    provisioning_normals=jnp.asarray([rng.norm_float64() for _ in range(draws)], jnp.float64))

    def state(self, cd: loop.ClusterDims) -> scaling.ScalingState:
        ss = scaling.init_state(cd.scaling_models, cd.num_instances, cd.scaling_pending, cd.scaling_log,
                                self.slot_variant)
        if self.provisioning is not None:
            p = self.provisioning
            retry = np.full(cd.num_instances, -1, np.int32)   # BLIS's pending list: index order at construction
            retry[:len(p["pending"])] = p["pending"]
            ss = dataclasses.replace(ss, node_ready_at=jnp.asarray(np.where(p["initial"], 0, INF_TIME), jnp.int64),
                                     provisioning_draws=jnp.int32(0), node_ready=jnp.asarray(p["initial"]),
                                     retry_index=jnp.asarray(retry), retry_len=jnp.int32(len(p["pending"])))
            if p["drain_at"] is not None:
                nodes = p["drain_at"].shape[0]
                ss = dataclasses.replace(ss, node_drain_at=jnp.asarray(p["drain_at"]),
                                         node_draining=jnp.zeros(nodes, bool),
                                         node_terminated_at=jnp.full(nodes, INF_TIME, jnp.int64))
        return dataclasses.replace(ss, next_slot=jnp.asarray(self.first_new_slot, jnp.int32))


def _scaling_setup(config: asc.AutoscalerConfig, cluster: ClusterConfig, startup: infra.StartupInstances | None,
                   params: EngineParams, deployed: deploy.InstanceDeployments, hardware: str) -> ScalingSetup:
    """Variants (blis-infra §4.3: (GPU type, max(TP, 1)) of the placed instances, cost of the
    first pool of that type; without node pools one variant (`hardware`, 1) at cost 0), the GPU
    inventory for placement, and the KV capacity of the slots new instances take."""
    slots = cluster.slots
    model_names = [cluster.served_model or ""]
    if startup is None:
        return ScalingSetup(
            config=config, deployed=deployed, variants=[(hardware, 1, 0.0)], slot_variant=np.zeros(slots, np.int32),
            gpu_node=np.zeros(1, np.int32), gpu_type=np.full(1, -1, np.int32), variant_gpu_type=np.zeros(1, np.int32),
            node_names=[], model_names=model_names, first_new_slot=cluster.num_instances, pools=False,
            seed=cluster.seed, loading_delay=infra.Delay(), construction_draws=0, drain_policy=cluster.drain_policy)
    gpus = infra.inventory(cluster.node_pools, provisionable=cluster.provision_nodes)
    types = sorted({g.gpu_type for g in gpus})
    nodes = list(dict.fromkeys(g.node for g in gpus))
    provisioning = _provisioning(cluster, gpus, nodes, types, startup) if cluster.provision_nodes else None
    variants: list = []
    slot_variant = np.zeros(slots, np.int32)
    blocks_of: dict = {}
    for k, p in enumerate(startup.placements):
        if p is None:
            continue
        key = (p.gpu_type, max(p.tp, 1), p.cost_per_hour)
        if key not in variants:
            variants.append(key)
        slot_variant[k] = variants.index(key)
        blocks_of.setdefault(variants.index(key), (startup.total_kv_blocks[k], startup.max_model_len[k]))
    if len(set(blocks_of.values())) > 1:
        raise ConfigError("the autoscaler on node pools of different GPU memory is not simulated yet (its new "
                          "instances' KV capacity depends on where they land); give the pools the same "
                          "gpu_memory_gib, or set --total-kv-blocks")
    if provisioning is not None:   # a pending startup instance may land on any type (§3.5)
        provisioning["type_variant"] = _startup_variants(cluster, startup, types, variants, provisioning["startup_tp"])
    new_blocks, new_mml = next(iter(blocks_of.values()))
    first_new = startup.num_placed
    blocks = np.asarray(deployed.total_kv_blocks).copy()
    mml = np.asarray(deployed.max_model_len).copy()
    blocks[first_new:], mml[first_new:] = new_blocks, new_mml
    slot_variant[first_new:] = 0
    deployed = dataclasses.replace(deployed, total_kv_blocks=jnp.asarray(blocks, jnp.int64),
                                   max_model_len=jnp.asarray(mml, jnp.int64))
    lifecycle = cluster.instance_lifecycle
    construction = (0 if lifecycle.warm_start_initial_instances or lifecycle.loading_delay.stddev <= 0
                    else startup.num_placed)
    return ScalingSetup(
        config=config, deployed=deployed, variants=variants, slot_variant=slot_variant,
        gpu_node=np.asarray([nodes.index(g.node) for g in gpus], np.int32),
        gpu_type=np.asarray([types.index(g.gpu_type) for g in gpus], np.int32),
        variant_gpu_type=np.asarray([types.index(t) for t, _, _ in variants], np.int32), node_names=nodes,
        model_names=model_names, first_new_slot=first_new, pools=True, seed=cluster.seed,
        loading_delay=lifecycle.loading_delay,
        construction_draws=construction, drain_policy=cluster.drain_policy, provisioning=provisioning)


def _startup_variants(cluster: ClusterConfig, startup: infra.StartupInstances, types: list, variants: list,
                      tp: int) -> np.ndarray:
    """Per GPU type, the variant (type, startup TP, cost of the first pool of that type) of a
    pending startup instance placed on it at a NodeReady retry, added to `variants` when no
    placed instance has it (a variant without replicas changes no autoscaler figure). Its KV
    capacity is the new slots' (one for all): pools whose GPU memory differs are refused."""
    first = {}
    for pool in cluster.node_pools:
        first.setdefault(pool.gpu_type, pool)
    out = np.zeros(len(types), np.int32)
    for t, gpu_type in enumerate(types):
        key = (gpu_type, tp, float(first[gpu_type].cost_per_hour))
        if key not in variants and startup.num_placed < len(startup.placements):
            variants.append(key)
        out[t] = variants.index(key) if key in variants else 0
    if startup.num_placed < len(startup.placements):
        memory = {float(p.gpu_memory_gib) for p in cluster.node_pools}
        if len(memory) > 1:
            raise ConfigError(f"{name('cluster.provision_nodes')}: pending startup instances placed on a provisioned "
                              "node of pools with different gpu_memory_gib are not simulated yet (their KV capacity "
                              "depends on where they land); give the pools the same gpu_memory_gib")
    return out


def _provisioning(cluster: ClusterConfig, gpus, nodes: list, types: list, startup: infra.StartupInstances) -> dict:
    """Per node of the provisionable inventory (padded to the GPU count): whether it exists at
    t = 0, its GPU type and its pool's provisioning delay; and the startup GPU owners moved onto
    this inventory (the startup placement saw the initial nodes only)."""
    g = len(gpus)
    pools = {p.name: p for p in cluster.node_pools}
    initial, kind = np.ones(g, bool), np.full(g, -1, np.int32)
    mean, std = np.zeros(g), np.zeros(g)
    for gpu in gpus:
        n, pool = nodes.index(gpu.node), pools[gpu.pool]
        initial[n] = int(gpu.node.rsplit("-", 1)[1]) < pool.initial_nodes
        kind[n] = types.index(gpu.gpu_type)
        mean[n], std[n] = pool.provisioning_delay.mean, pool.provisioning_delay.stddev
    where = {gpu.id: i for i, gpu in enumerate(gpus)}
    owner = np.full(g, -1, np.int32)
    for gpu, held_by in zip(infra.inventory(cluster.node_pools), startup.gpu_owner):
        owner[where[gpu.id]] = held_by
    pending = [k for k, p in enumerate(startup.placements) if p is None]
    tp = max((p.tp for p in startup.placements if p is not None), default=1)
    drain_at = None
    if cluster.node_drains:
        drain_at = np.full(g, INF_TIME, np.int64)
        for node, at in cluster.node_drains:
            drain_at[nodes.index(node)] = at
    return dict(initial=initial, type=kind, mean=mean, std=std, owner=owner, pending=pending, startup_tp=tp,
                drain_at=drain_at)


def model_ids(requests: RequestSet, cluster: ClusterConfig, padded_to: int) -> dict:
    """`ClusterParams.instance_model` / `request_model`: every slot serves model 0 (the served
    model); a request's id is -1 without a model (or when instances serve every model), 0 for
    the served model and 1 for any other (no instance has it)."""
    wanted = np.full(padded_to, -1, np.int32)
    if cluster.served_model is not None:
        names = np.asarray(requests.model, dtype=object)
        wanted[:len(requests)] = np.where(names == "", -1, np.where(names == cluster.served_model, 0, 1))
    return dict(instance_model=jnp.zeros(cluster.slots, jnp.int32), request_model=jnp.asarray(wanted))


def encode_params(requests: RequestSet, cluster: ClusterConfig, padded_to: int) -> dict:
    """`ClusterParams.encode_role` / `encode_fires` (padding rows never fire)."""
    fire = np.zeros(padded_to, bool)
    fire[:len(requests)] = encode_rules.fires(cluster.encode_decider, requests)
    return dict(encode_role=cluster.encode_mask(), encode_fires=jnp.asarray(fire))


def unservable_models(requests: RequestSet, served_model: str | None) -> bool:
    """Some request names a model no instance serves (rejected at routing)."""
    if served_model is None:
        return False
    names = np.asarray(requests.model, dtype=object)
    return bool(np.any((names != "") & (names != served_model)))


_init = jax.jit(loop.init_cluster, static_argnums=0)


_CHUNK_PROGRAMS: dict = {}  # ClusterDims → the driver's jitted chunk program


def advance_chunk(cd: loop.ClusterDims, cs: loop.ClusterState, inputs, event_limit):
    """The host driver's chunk: (cluster state, (params, cluster params, requests, model), event
    limit) → (state after the chunk, run over?), through the on-disk executables when the CLI
    keeps them. The check runs inside the program: evaluated eagerly on device arrays it would
    compile a dozen one-op programs in every process."""
    program = _CHUNK_PROGRAMS.get(cd)
    if program is None:
        def chunk(cs, inputs, event_limit):
            params, cparams, req, model = inputs
            cs = loop.run_cluster(cd, cs, params, cparams, req, model, event_limit)
            return cs, loop.finished(cs, cparams, params, req)

        program = _CHUNK_PROGRAMS[cd] = jax.jit(chunk, donate_argnums=0)
    return executables.call(program, f"cluster.advance {cd}", cs, inputs, event_limit)


def compiled_programs() -> int:
    """Programs the cluster driver has compiled in this process (no-recompile tests)."""
    return sum(p._cache_size() for p in _CHUNK_PROGRAMS.values()) + _init._cache_size()


_LOG_FIELDS = ("steps", "step_log_base", "step_sample", "step_start", "step_dur", "step_basis", "run_len",
               "run_req", "run_first", "run_last")


def _read_logs(cs: loop.ClusterState, readers: list[ItlLogReader]) -> tuple[loop.ClusterState, np.ndarray]:
    """Read every instance's ITL log (one host transfer, which also brings each instance's event
    count) and mark it read: (state, event counts)."""
    host = jax.device_get({f: getattr(cs.instances, f) for f in (*_LOG_FIELDS, "events")})
    events = np.asarray(host.pop("events"), np.int64)
    for i, reader in enumerate(readers):
        reader.collect(SimpleNamespace(**{f: v[i] for f, v in host.items()}))
    instances = dataclasses.replace(cs.instances, step_log_base=jnp.asarray(host["steps"]),
                                    run_len=jnp.zeros_like(cs.instances.run_len))
    return dataclasses.replace(cs, instances=instances), events


def merge_outputs(cs: loop.ClusterState, dims, params: EngineParams, requests: RequestSet, code: int,
                  readers: list[ItlLogReader], num_instances: int, pools=None):
    """(one `SimOutput` for the cluster, per-instance views or None): each request's record
    from the instance that served it (with PD, its parent record rebuilt from its sub-requests),
    ITL step logs concatenated (run step indices offset), counters per instance. `pools`: with
    PD, (prefill-role mask, decode-role mask, transfer contention, each slot's alpha [I, 4])."""
    n = len(requests)
    host = jax.device_get(cs)
    handled = np.asarray(host.handled_by[:n]).astype(np.int32)
    tr = host.transfers
    disaggregated = np.asarray(tr.decode_target[:n]) >= 0
    prefill_by = np.asarray(tr.prefill_by[:n])
    lanes, admit_steps = [], []
    for i in range(num_instances):
        s = jax.tree.map(lambda x: x[i], host.instances)
        served = (handled == i) | (disaggregated & (prefill_by == i))
        routed = requests.arrival_us[served]
        s = dataclasses.replace(s, sim_end=np.int64(max(int(s.sim_end), int(routed.max()) if len(routed) else 0)))
        lanes.append(to_output(s, dims, params, requests, code, readers[i], clock_sees_arrivals=False))
        admit_steps.append(np.asarray(s.out_admit_step[:n]))
    fields = combine(lanes, handled)
    fields.update(tier_counts(lanes))
    views = None
    if pools is not None:
        fields, views = _pd_parents(fields, lanes, admit_steps, handled, disaggregated, prefill_by, tr, n,
                                    requests, pools)
    if host.drain is not None:  # IMMEDIATE: discarded requests time out at their deadline (drain.py)
        fields = drain.discarded_timeouts(fields, np.asarray(host.drain.discarded_by[:n]), requests.deadline_us,
                                          int(params.horizon_us))
    fields["status"][np.asarray(host.rejected[:n])] = so.REJECTED
    fields["status"][np.asarray(host.routing_rejected[:n])] = so.ROUTING_REJECTED
    if host.encode_rejected is not None:
        fields["status"][np.asarray(host.encode_rejected[:n])] = so.ENCODE_REJECTED
        fields["encode_by"] = np.asarray(host.encode_by[:n])
    if host.gateway is not None:
        fields.update(_gateway_outcomes(fields["status"], host.gateway, n))
    if host.drain is not None:
        fields["extra_arrivals"] = drain.extra_arrivals(host.drain, fields["status"], n)
    return so.SimOutput(**fields, result=code, hol_blocking_events=hol_blocking_events(
        np.asarray(host.instances.wait_depth_sum[:num_instances]), np.asarray(host.instances.steps[:num_instances]))
    ), views


def hol_blocking_events(wait_depth_sum: np.ndarray, steps: np.ndarray) -> int:
    """BLIS's HOL Blocking Events (blis-features §1.9): instances whose mean wait-queue length
    (sampled after batch formation, every step) exceeds twice the mean over the instances; an
    instance without steps has mean 0. None with fewer than two instances."""
    if len(steps) < 2:
        return 0
    depth = np.divide(wait_depth_sum.astype(np.float64), steps, out=np.zeros(len(steps)), where=steps > 0)
    return int((depth > 2.0 * depth.mean()).sum()) if depth.mean() > 0 else 0


def _gateway_outcomes(status: np.ndarray, g, n: int) -> dict:
    """Statuses of the requests that ended at the gateway, and every request's queue delay."""
    outcome = np.asarray(g.outcome[:n])
    status = status.copy()
    for code, terminal in ((gw.QUEUED, so.GATEWAY_QUEUED), (gw.REJECTED, so.GATEWAY_REJECTED),
                           (gw.SHED, so.GATEWAY_SHED), (gw.EXPIRED, so.GATEWAY_EXPIRED)):
        status[outcome == code] = terminal
    dispatched = np.asarray(g.dispatched_us[:n])
    delay = np.where(dispatched >= 0, dispatched - np.asarray(g.enqueued_us[:n]), -1)
    return {"status": status, "gateway_delay_us": delay}


def combine(lanes: list[so.SimOutput], handled: np.ndarray) -> dict:
    """SimOutput fields with each request's row taken from the instance `handled` names."""
    n = handled.shape[0]
    per_request = {name: np.zeros(n, dtype) for name, dtype in so._PER_REQUEST.items()}
    for name in ("ttft_us", "e2e_us", "sched_delay_us"):
        per_request[name][:] = -1
    step_parts, run_parts, offset = [], [], 0
    for i, o in enumerate(lanes):
        mine = handled == i
        for name in per_request:
            per_request[name][mine] = getattr(o, name)[mine]
        runs = o.itl_runs[mine[o.itl_runs[:, 0]]].copy()
        runs[:, 1:] += offset
        step_parts.append(o.itl_step_us)
        run_parts.append(runs)
        offset += o.itl_step_us.shape[0]
    per_request["handled_by"] = handled.copy()
    counters = {name: np.array([int(getattr(o, name)[0]) for o in lanes], np.int64) for name in so._COUNTERS}
    return dict(**per_request, **counters,
                itl_step_us=np.concatenate(step_parts) if step_parts else np.zeros(0, np.int32),
                itl_runs=np.concatenate(run_parts) if run_parts else np.zeros((0, 3), np.int64))


def tier_counts(lanes: list[so.SimOutput]) -> dict:
    """The KV tiers' counters of the instances' outputs, one entry per instance [I] (none
    without a tier)."""
    first = lanes[0] if lanes else None
    out = {}
    if first is not None and first.cpu_tier_counts is not None:
        out["cpu_tier_counts"] = tuple(np.concatenate([o.cpu_tier_counts[k] for o in lanes]) for k in range(3))
        out["cpu_reload_failures"] = np.concatenate([o.cpu_reload_failures for o in lanes])
    if first is not None and first.offload_counts is not None:
        out["offload_counts"] = {k: np.concatenate([o.offload_counts[k] for o in lanes]) for k in first.offload_counts}
    return out


def _pd_parents(fields: dict, lanes, admit_steps, handled, disaggregated, prefill_by, tr, n, requests, pools):
    """BLIS's parent metrics of disaggregated requests (blis-features §3.10): TTFT = decode
    scheduling delay (arrival → decode admission) + the first decode ITL sample; E2E = decode
    scheduling delay + the decode sub-request's own E2E; scheduling delay = the prefill's; ITL
    = the decode's. A request in transfer at the end counts as still running; one dropped for
    lack of KV at its decode instance as dropped.

    A shared pod may prefill and then decode the same request: its record on that pod is the
    decode sub-request's once that arrived, the prefill's figures were saved at the transfer
    start (`Transfers.prefill_*`)."""
    f = fields
    prefill_role, decode_role, contention, slot_alpha = pools
    dropped = np.asarray(tr.dropped[:n])
    started = np.asarray(tr.start_us[:n]) >= 0
    moving = np.asarray(tr.request)[np.asarray(tr.done_at) < INF_TIME]
    decode_arrived = started & ~np.isin(np.arange(n), moving)
    prefill_done = disaggregated & (started | dropped)
    # the record on a shared pod is still the prefill's until the decode sub-request arrives
    reused = disaggregated & (prefill_by == handled)
    status = np.where(reused & ~decode_arrived, so.NOT_ARRIVED, f["status"])
    decode_delay = f["sched_delay_us"].copy()
    prefill_status = np.zeros(n, np.int8)
    prefill_delay = np.full(n, -1, np.int64)
    views, view_requests, completed = [], [], []
    saved_delay, saved_ttft, saved_e2e = (np.asarray(getattr(tr, k)[:n]) for k in
                                          ("prefill_delay_us", "prefill_ttft_us", "prefill_e2e_us"))
    for i, o in enumerate(lanes):
        mine = disaggregated & (prefill_by == i)
        prefill_status[mine] = o.status[mine]
        prefill_delay[mine] = o.sched_delay_us[mine]
        # the instance's own view: its decode sub-requests have no first token of their own
        view = {name: getattr(o, name).copy() for name in so._PER_REQUEST}
        served = (handled == i) | mine
        view["handled_by"] = np.where(served, i, -1).astype(np.int32)
        view["status"] = np.where(served, o.status, so.NOT_ARRIVED).astype(np.int8)
        view["ttft_us"] = np.where(disaggregated & (handled == i) & decode_arrived, -1, o.ttft_us)
        counters = {name: f[name] for name in so._COUNTERS}
        runs = o.itl_runs[served[o.itl_runs[:, 0]]]
        twice = np.flatnonzero(reused & decode_arrived & (handled == i))
        reqs = None
        if twice.size:  # the prefill sub-requests of requests this pod also decoded: extra rows
            extra = {name: np.zeros(twice.size, dtype) for name, dtype in so._PER_REQUEST.items()}
            extra.update(status=np.full(twice.size, so.COMPLETED, np.int8), ttft_us=saved_ttft[twice],
                         e2e_us=saved_e2e[twice], sched_delay_us=saved_delay[twice],
                         handled_by=np.full(twice.size, i, np.int32))
            view = {name: np.concatenate([view[name], extra[name]]) for name in so._PER_REQUEST}
            reqs = ViewRows(n + twice.size)
        views.append(so.SimOutput(**view, **counters, itl_step_us=o.itl_step_us, itl_runs=runs))
        view_requests.append(reqs)
        completed.append(int((so.is_completed(view["status"]) & (view["handled_by"] == i)).sum()))
    prefill_status = np.where(prefill_done, so.COMPLETED, prefill_status).astype(np.int8)
    prefill_delay = np.where(prefill_done, saved_delay, prefill_delay)
    first_sample = np.full(n, -1, np.int64)
    lag = np.zeros(n, np.int64)
    for i, o in enumerate(lanes):
        mine = (disaggregated & (handled == i) & (admit_steps[i] >= 0) & (admit_steps[i] < o.itl_step_us.shape[0])
                & decode_arrived)
        first_sample[mine] = o.itl_step_us[admit_steps[i][mine]]
        # blis-jax's first-token lag (α₃ × the first token's step, as the engine adds it to a
        # co-located request's TTFT): here that step is the decode pod's first, sample − trunc(α₂)
        step_us = first_sample[mine] - np.trunc(slot_alpha[i, 2]).astype(np.int64)
        lag[mine] = np.trunc(slot_alpha[i, 3] * step_us.astype(np.float64)).astype(np.int64)
    done = disaggregated & so.is_completed(status)
    f["ttft_us"] = np.where(disaggregated, np.where(first_sample >= 0, decode_delay + first_sample + lag, -1),
                            f["ttft_us"])
    f["e2e_us"] = np.where(done, decode_delay + f["e2e_us"] + lag, f["e2e_us"])
    f["sched_delay_us"] = np.where(disaggregated, prefill_delay, f["sched_delay_us"])
    # before the decode side: the prefill's state (waiting, running, timed out), in transfer, dropped
    not_at_decode = disaggregated & (status == so.NOT_ARRIVED)
    in_transfer = not_at_decode & started & ~dropped & so.is_completed(prefill_status)
    status = np.where(not_at_decode & ~so.is_completed(prefill_status), prefill_status, status)
    status = np.where(in_transfer, so.RUNNING, status)
    status = np.where(disaggregated & dropped, so.DROPPED, status)
    f["status"] = status.astype(np.int8)
    f["handled_by"] = np.where(disaggregated & dropped, -1, handled).astype(np.int32)
    still_running, dropped_count = f["still_running"].copy(), f["dropped_unservable"].copy()
    np.add.at(still_running, handled[in_transfer], 1)
    np.add.at(dropped_count, handled[disaggregated & dropped], 1)
    f["still_running"], f["dropped_unservable"] = still_running, dropped_count
    durations = np.asarray(tr.duration_us[:n])
    completed = np.asarray(completed, np.int64)
    k = len(lanes)
    views = InstanceViews(
        outputs=tuple(views), disaggregated=disaggregated, dropped_at_decode=int((disaggregated & dropped).sum()),
        transfer_us=durations[durations >= 0],
        prefill_completed=int(completed[prefill_role[:k]].sum()),
        decode_completed=int(completed[decode_role[:k]].sum()),
        requests=tuple(view_requests), contention=bool(contention),
        transfers_in_flight=np.asarray(tr.active_at_start[:n])[durations >= 0])
    return f, views
