"""Node pools, GPU inventory and first-fit placement of the startup instances (blis-infra §1.3,
§2.3-§2.4, §3).

A node pool is a set of identical nodes (`initial_nodes` of them, all Ready at t = 0, each with
`gpus_per_node` GPUs of one type and memory). At construction, BLIS places `instance_<idx>`
for idx = 0 … N−1 on the first node (pools in declaration order, nodes in index order) with
max(TP, 1) free GPUs, taking that node's lowest free GPU indices; an instance that fits nowhere
is *pending*: never built, absent from every output, its index consumed. A placed instance
starts `Loading` for a delay drawn from the `instance-loading` Go stream (in index order, one
`NormFloat64` per placed instance when the delay's stddev > 0), unless the lifecycle says
warm start. All of this happens once, on the host, before the run; the transitions that follow
(Loading → Active when the delay is over) happen inside the cluster loop (lifecycle.py).

Only what BLIS's CLI reaches is built here: nodes never change state and no node is added
(provisioning delays and `min_nodes`/`max_nodes` are validated only). The library-only node
lifecycle (provisioning, NodeReady retry of the pending instances, node drain) runs in the
cluster loop with `ClusterConfig.provision_nodes` (scaling.py). `free_gpu_slots` is the
GPU inventory BLIS computes every tick for its library-only greedy engine.
"""

from __future__ import annotations

import dataclasses
import math

from blis_jax.cluster import lifecycle as lc
from blis_jax.errors import ConfigError


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Delay:
    """A delay drawn as N(mean, stddev) seconds (stddev 0: exactly `mean`, no draw)."""

    mean: float = 0.0
    stddev: float = 0.0

    def check(self, where: str) -> None:
        for part in ("mean", "stddev"):
            value = getattr(self, part)
            if not _number(value) or not math.isfinite(value):
                raise ConfigError(f"{where}.{part} must be a finite number of seconds, got {value!r}")
            if value < 0:
                raise ConfigError(f"{where}.{part} must be >= 0, got {value:g}")

    def sample_us(self, rng) -> int:
        """BLIS's sampling rule (blis-infra §1.3): no draw when stddev <= 0; a negative, NaN or
        infinite result becomes 0; seconds → µs truncated toward zero. `rng`: a GoRand (only
        read when stddev > 0)."""
        if self.stddev <= 0:
            secs = float(self.mean)
        else:
            secs = rng.norm_float64() * float(self.stddev) + float(self.mean)
            secs = max(secs, 0.0)
        if not math.isfinite(secs):
            return 0
        return int(secs * 1e6)  # Go's int64(secs * 1e6): truncation toward zero


@dataclasses.dataclass(frozen=True)
class NodePool:
    """One pool of identical nodes (bundle key `node_pools[i]`, blis-infra §3.1)."""

    name: str
    gpu_type: str
    gpus_per_node: int
    gpu_memory_gib: float
    initial_nodes: int = 0
    min_nodes: int = 0
    max_nodes: int = 0
    provisioning_delay: Delay = Delay()  # validated only: nothing provisions nodes from the CLI
    cost_per_hour: float = 0.0

    def check(self, index: int) -> None:
        """BLIS's bundle validation of one pool, in its order and with its messages."""
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"node_pools[{index}]: name must not be empty")
        where = f"node_pools[{index}] {self.name!r}"
        if not isinstance(self.gpu_type, str) or not self.gpu_type:
            raise ConfigError(f"{where}: gpu_type must not be empty")
        if not _integer(self.gpus_per_node) or self.gpus_per_node < 1:
            raise ConfigError(f"{where}: gpus_per_node must be >= 1, got {self.gpus_per_node!r}")
        memory = self.gpu_memory_gib
        if not _number(memory) or not math.isfinite(memory):
            raise ConfigError(f"{where}: gpu_memory_gib must be a finite number, got {memory!r}")
        if memory <= 0:
            raise ConfigError(f"{where}: gpu_memory_gib must be > 0, got {memory:g}")
        for field in ("initial_nodes", "min_nodes", "max_nodes"):
            value = getattr(self, field)
            if not _integer(value) or value < 0:
                raise ConfigError(f"{where}: {field} must be an integer >= 0, got {value!r}")
        if self.max_nodes < self.initial_nodes:
            raise ConfigError(f"{where}: max_nodes ({self.max_nodes}) must be >= initial_nodes ({self.initial_nodes})")
        if self.min_nodes > self.max_nodes:
            raise ConfigError(f"{where}: min_nodes ({self.min_nodes}) must be <= max_nodes ({self.max_nodes})")
        if not isinstance(self.provisioning_delay, Delay):
            raise ConfigError(f"{where}: provisioning_delay must be a Delay(mean, stddev)")
        self.provisioning_delay.check(f"{where}: provisioning_delay")
        cost = self.cost_per_hour
        if not _number(cost) or not math.isfinite(cost):
            raise ConfigError(f"{where}: cost_per_hour must be a finite number, got {cost!r}")
        if cost < 0:
            raise ConfigError(f"{where}: cost_per_hour must be >= 0, got {cost:g}")


@dataclasses.dataclass(frozen=True)
class InstanceLifecycle:
    """Bundle key `instance_lifecycle` (blis-infra §2.4): the startup instances' loading delay,
    or a warm start (Active at t = 0, no draw). Effective only with node pools, as in BLIS."""

    loading_delay: Delay = Delay()
    warm_start_initial_instances: bool = False

    def check(self) -> None:
        if not isinstance(self.loading_delay, Delay):
            raise ConfigError("instance_lifecycle.loading_delay must be a Delay(mean, stddev)")
        self.loading_delay.check("instance_lifecycle.loading_delay")
        if not isinstance(self.warm_start_initial_instances, bool):
            raise ConfigError("instance_lifecycle.warm_start_initial_instances must be true or false, got "
                              f"{self.warm_start_initial_instances!r}")


def check_pools(pools) -> tuple[NodePool, ...]:
    """Every pool's validation, then unique names (BLIS panics on a duplicate; a clean error here)."""
    pools = tuple(pools)
    for i, pool in enumerate(pools):
        if not isinstance(pool, NodePool):
            raise ConfigError(f"node_pools[{i}]: expected a NodePool, got {type(pool).__name__}")
        pool.check(i)
    seen = set()
    for pool in pools:
        if pool.name in seen:
            raise ConfigError(f"node_pools: duplicate pool name {pool.name!r}; pool names must be unique")
        seen.add(pool.name)
    return pools


# ------------------------------------------------------------------------------ inventory


@dataclasses.dataclass(frozen=True)
class Gpu:
    id: str  # <node>-gpu-<g>
    node: str  # <pool>-<k>
    pool: str
    gpu_type: str
    memory_gib: float


def inventory(pools, provisionable: bool = False) -> tuple[Gpu, ...]:
    """Every GPU of the initial nodes, in pool, node, GPU-index order (first-fit order); with
    `provisionable`, of every node a pool may have (`max_nodes`: its provisioned nodes continue
    the pool's node counter, after its initial ones)."""
    return tuple(Gpu(id=f"{p.name}-{k}-gpu-{g}", node=f"{p.name}-{k}", pool=p.name, gpu_type=p.gpu_type,
                     memory_gib=float(p.gpu_memory_gib))
                 for p in pools for k in range(max(p.max_nodes, p.initial_nodes) if provisionable else p.initial_nodes)
                 for g in range(p.gpus_per_node))


# instance states that hold GPUs in the inventory
_HOLDING = (lc.LOADING, lc.WARMING_UP, lc.ACTIVE, lc.DRAINING)


def free_gpu_slots(ready_gpus: dict[str, int], instances, cluster_tp: int) -> dict[tuple[str, int], int]:
    """The autoscaler's GPU inventory (blis-infra §4.5; computed by BLIS at every tick for its
    library-only greedy engine, ignored by the unlimited engine it wires): free GPU slots per
    variant (GPU type, TP). `ready_gpus`: GPUs of Ready nodes per type (empty without node
    pools); `instances`: (GPU type, TP, lifecycle state code) per constructed instance. Listed:
    (type, max(cluster TP, 1)) for every type with Ready GPUs, and every (type, TP) of a live
    instance with TP > 0; free = Ready GPUs of the type − Σ TP of its GPU-holding instances,
    clamped at 0."""
    if not ready_gpus:
        return {}
    used: dict[str, int] = {}
    variants = [(t, max(cluster_tp, 1)) for t in ready_gpus]
    for gpu_type, tp, state in instances:
        if state in _HOLDING:
            used[gpu_type] = used.get(gpu_type, 0) + tp
            if tp > 0 and (gpu_type, tp) not in variants:
                variants.append((gpu_type, tp))
    return {(t, tp): max(ready_gpus.get(t, 0) - used.get(t, 0), 0) for t, tp in variants}


@dataclasses.dataclass(frozen=True)
class InstancePlacement:
    """Where one startup instance landed, with the per-GPU-type figures BLIS takes from the
    *first* pool of that type (cost, memory; blis-infra §3.4 step 3)."""

    instance_id: str
    node: str
    gpus: tuple[int, ...]  # indices into `inventory(pools)`
    gpu_ids: tuple[str, ...]
    gpu_type: str
    tp: int
    gpu_memory_gib: float
    cost_per_hour: float


def place_instances(pools, num_instances: int, tp: int) -> tuple[tuple[InstancePlacement | None, ...], tuple[int, ...]]:
    """First-fit placement of instance_0 … instance_{N−1}, each on max(tp, 1) GPUs of one Ready
    node. Returns (placement per index, None when pending; owner of each inventory GPU, -1 free)."""
    tp = max(int(tp), 1)
    gpus = inventory(pools)
    owner = [-1] * len(gpus)
    first_of_type: dict[str, NodePool] = {}
    for p in pools:
        first_of_type.setdefault(p.gpu_type, p)
    by_node: dict[str, list[int]] = {}
    for g, gpu in enumerate(gpus):
        by_node.setdefault(gpu.node, []).append(g)
    placed: list[InstancePlacement | None] = []
    for idx in range(num_instances):
        choice = None
        for node, members in by_node.items():  # pools, then nodes, in declaration order
            free = [g for g in members if owner[g] < 0]
            if len(free) >= tp:
                choice = (node, tuple(free[:tp]))
                break
        if choice is None:
            placed.append(None)
            continue
        node, taken = choice
        for g in taken:
            owner[g] = idx
        gpu_type = gpus[taken[0]].gpu_type
        first = first_of_type[gpu_type]
        placed.append(InstancePlacement(
            instance_id=f"instance_{idx}", node=node, gpus=taken, gpu_ids=tuple(gpus[g].id for g in taken),
            gpu_type=gpu_type, tp=tp, gpu_memory_gib=float(first.gpu_memory_gib),
            cost_per_hour=float(first.cost_per_hour)))
    return tuple(placed), tuple(owner)


@dataclasses.dataclass(frozen=True)
class StartupInstances:
    """The startup instances of a cluster with node pools, resolved: which exist, their KV
    capacity and max-model-len (recomputed from their pool's GPU memory), when each becomes
    routable (0: Active at t = 0; > 0: Loading until then), and the GPU inventory."""

    placements: tuple[InstancePlacement | None, ...]  # per instance index; None = pending
    total_kv_blocks: tuple[int, ...]  # per index (a pending index keeps the global value, unused)
    max_model_len: tuple[int, ...]
    loaded_at_us: tuple[int, ...]  # per index; 0 = routable from the start
    gpu_owner: tuple[int, ...]  # per inventory GPU: the instance index holding it, -1 free

    @property
    def placed(self) -> tuple[bool, ...]:
        return tuple(p is not None for p in self.placements)

    @property
    def num_placed(self) -> int:
        return sum(self.placed)

    @property
    def gpus_held(self) -> tuple[int, ...]:
        return tuple(p.tp if p is not None else 0 for p in self.placements)


def loading_delays(placements, lifecycle: InstanceLifecycle | None, seed: int) -> tuple[int, ...]:
    """Per instance index, the µs at which it becomes routable: 0 for a warm start, a pending
    index or a zero delay; else the delay drawn from the `instance-loading` stream (seeded from
    `seed`), in index order, for placed instances only."""
    from blis_jax.rng.go_rand import GoRand
    from blis_jax.rng.streams import INSTANCE_LOADING, subsystem_seed

    lifecycle = lifecycle or InstanceLifecycle()
    if lifecycle.warm_start_initial_instances:
        return tuple(0 for _ in placements)
    rng = GoRand(subsystem_seed(seed, INSTANCE_LOADING)) if lifecycle.loading_delay.stddev > 0 else None
    return tuple(lifecycle.loading_delay.sample_us(rng) if p is not None else 0 for p in placements)
