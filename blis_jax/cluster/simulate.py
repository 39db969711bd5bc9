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

from blis_jax.cluster import admission as adm
from blis_jax.cluster import loop
from blis_jax.cluster import routing as routing_policies
from blis_jax.cluster import scorers as sc
from blis_jax.engine import output as so
from blis_jax.engine import results
from blis_jax.engine.dims import choose_dims
from blis_jax.engine.itl_log import ItlLogReader
from blis_jax.engine.params import EngineParams
from blis_jax.engine.simulate import request_arrays, to_output
from blis_jax.errors import ConfigError
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
    snapshot_refresh_interval_us: int = 50_000
    cache_signal_delay_us: int = 50_000
    admission_latency_us: int = 0
    routing_latency_us: int = 0
    seed: int = 42
    instance_slots: int | None = None  # compiled slots (>= num_instances); None = num_instances

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
        return self

    @property
    def slots(self) -> int:
        return self.instance_slots or self.num_instances

    def admission(self) -> adm.AbstractAdmission:
        return adm.make_admission(self.admission_policy, token_bucket_capacity=self.token_bucket_capacity,
                                  token_bucket_refill_rate=self.token_bucket_refill_rate)

    def profile(self) -> sc.ScorerProfile | None:
        if self.routing_policy != "weighted":
            return None
        return sc.make_profile(self.routing_scorers or sc.DEFAULT_PROFILE, self.slots)


def simulate_cluster(
    requests: RequestSet,
    params: EngineParams,
    model,
    cluster: ClusterConfig,
    *,
    block_size: int = 16,
    scheduler: str = "fcfs",
    preemption_policy: str = "fcfs",
    events_per_chunk: int = 200_000,
    progress: Callable[[int, int, int], None] | None = None,
) -> so.SimOutput:
    """Simulate `requests` on a cluster of identical instances; `progress(done, total, sim_us)`
    is called between chunks."""
    cluster = cluster.validate()
    growth = 1
    while True:
        edims = choose_dims(
            input_len=requests.input_len, output_len=requests.output_len, prefix_group=requests.prefix_group,
            prefix_len=requests.prefix_len, max_num_seqs=int(params.max_num_seqs),
            max_num_batched_tokens=int(params.max_num_batched_tokens), total_kv_blocks=int(params.total_kv_blocks),
            block_size=block_size, scheduler=scheduler, preemption_policy=preemption_policy, growth=growth,
            step_log=events_per_chunk,
        )
        profile = cluster.profile()
        cd = loop.ClusterDims(engine=edims, num_instances=cluster.slots, routing_policy=cluster.routing_policy,
                              scorers=profile.names if profile is not None else ())
        cparams = loop.ClusterParams(
            active=jnp.arange(cluster.slots) < cluster.num_instances,
            admission_latency_us=jnp.asarray(cluster.admission_latency_us, jnp.int64),
            routing_latency_us=jnp.asarray(cluster.routing_latency_us, jnp.int64),
        )
        req = request_arrays(requests, edims)
        key = jax.random.fold_in(jax.random.key(cluster.seed), 0x5217)  # the routing subsystem's stream
        cs = _init(cd, params, cparams, req, model, cluster.admission(), profile, key,
                   cluster.snapshot_refresh_interval_us, cluster.cache_signal_delay_us)
        readers = [ItlLogReader() for _ in range(cluster.slots)]
        limit = 0
        while True:
            limit += events_per_chunk
            cs = loop.advance(cd, cs, params, cparams, req, model, jnp.int64(limit))
            cs = _read_logs(cs, readers)
            if progress is not None:
                progress(int(jnp.sum(cs.instances.finished)), len(requests), int(jnp.max(cs.instances.now)))
            if bool(loop.finished(cs, cparams, params, req)):
                break
        code = int(jnp.bitwise_or.reduce(cs.instances.result)) | int(cs.result)
        if code & results.GROWABLE and growth < 64:
            growth *= 4
            continue
        return merge_outputs(cs, edims, params, requests, code, readers, cluster.num_instances)


_init = jax.jit(loop.init_cluster, static_argnums=0)


_LOG_FIELDS = ("steps", "step_log_base", "step_sample", "step_start", "step_dur", "step_basis", "run_len",
               "run_req", "run_first", "run_last")


def _read_logs(cs: loop.ClusterState, readers: list[ItlLogReader]) -> loop.ClusterState:
    """Read every instance's ITL log (one host transfer) and mark it read."""
    host = jax.device_get({f: getattr(cs.instances, f) for f in _LOG_FIELDS})
    for i, reader in enumerate(readers):
        reader._collect(SimpleNamespace(**{f: v[i] for f, v in host.items()}))
    instances = dataclasses.replace(cs.instances, step_log_base=jnp.asarray(host["steps"]),
                                    run_len=jnp.zeros_like(cs.instances.run_len))
    return dataclasses.replace(cs, instances=instances)


def merge_outputs(cs: loop.ClusterState, dims, params: EngineParams, requests: RequestSet, code: int,
                  readers: list[ItlLogReader], num_instances: int) -> so.SimOutput:
    """One `SimOutput` for the cluster: each request's record from the instance that served
    it, ITL step logs concatenated (run step indices offset), counters per instance."""
    n = len(requests)
    host = jax.device_get(cs)
    handled = np.asarray(host.handled_by[:n]).astype(np.int32)
    outs = []
    for i in range(num_instances):
        s = jax.tree.map(lambda x: x[i], host.instances)
        routed = requests.arrival_us[handled == i]
        s = dataclasses.replace(s, sim_end=np.int64(max(int(s.sim_end), int(routed.max()) if len(routed) else 0)))
        outs.append(to_output(s, dims, params, requests, code, readers[i], clock_sees_arrivals=False))
    per_request = {name: np.zeros(n, dtype) for name, dtype in so._PER_REQUEST.items()}
    per_request["ttft_us"][:] = -1
    per_request["e2e_us"][:] = -1
    per_request["sched_delay_us"][:] = -1
    step_parts, run_parts, offset = [], [], 0
    for i, o in enumerate(outs):
        mine = handled == i
        for name in per_request:
            per_request[name][mine] = getattr(o, name)[mine]
        step_parts.append(o.itl_step_us)
        runs = o.itl_runs.copy()
        runs[:, 1:] += offset
        run_parts.append(runs)
        offset += o.itl_step_us.shape[0]
    per_request["handled_by"] = handled
    rejected = np.asarray(host.rejected[:n]) | np.asarray(host.routing_rejected[:n])
    per_request["status"][rejected] = so.REJECTED
    counters = {name: np.array([int(getattr(o, name)[0]) for o in outs], np.int64) for name in so._COUNTERS}
    return so.SimOutput(
        **per_request,
        itl_step_us=np.concatenate(step_parts) if step_parts else np.zeros(0, np.int32),
        itl_runs=np.concatenate(run_parts) if run_parts else np.zeros((0, 3), np.int64),
        **counters,
        result=code,
    )
