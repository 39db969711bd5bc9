"""Autoscaled cluster runs that differ only in numbers, as one batched program.

An autoscaler's thresholds, stabilization windows and interval, the HPA scrape delay, the
loading delay and the node pools' sizes are all arrays of the cluster program
(`ScalingParams`, the initial lifecycle, the GPU inventory), not part of its structure. So a
grid of autoscaler policies under one load ramp runs as one program: every run is taken apart
by the cluster driver (`simulate.prepare_cluster`: the same dims, inputs and initial state a
single `simulate_cluster` run builds), the runs' states and inputs are stacked on a leading
axis, and each chunk of events is one call, vmapped over the runs (on CPU `lax.map`: one
dispatch, the runs one after another, which XLA:CPU runs faster than a vmap). Between chunks
every run's ITL log is read, as the single driver does; a finished run is held unchanged.

What may differ between the stacked runs is checked, not assumed: runs join one batch only
when their programs' dims, pytree structures and array shapes are equal, after the GPU
inventories are padded to the largest (padding GPUs have no GPU type: never free for a
placement, never counted in use). Runs that overflow a capacity are rerun, grown, as the
single driver reruns them (first the overflowed buffers, then the autoscaler's instance
slots; the running batch starts at the sweep lanes' BATCH_START slots: an instance of an
autoscaled cluster rarely runs more requests at once, and a loop iteration costs several
times less at 32 slots than at 256). Capacities never change what is simulated, so every
run's output equals its own `simulate_cluster` run, request by request and scaling event by
scaling event (tested).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax.cluster import loop
from blis_jax.cluster import simulate as cluster_sim
from blis_jax.engine import results
from blis_jax.engine.growth import Growth
from blis_jax.engine.output import SimOutput
from blis_jax.errors import ConfigError
from blis_jax.scenario import ResolvedScenario
from blis_jax.sweep.lane import BATCH_START

EVENTS_PER_CHUNK = 200_000  # as simulate_cluster's default (it sizes the step log: part of the program)
MAX_NEW_SLOTS = 64 * cluster_sim.NEW_SLOTS

MAX_BATCH = 64  # runs stacked in one batch at most (each holds a whole cluster state)
_PROGRAMS: dict = {}  # (cluster dims, mode) → jitted batched chunk


def _lane_chunk(cd: loop.ClusterDims, cs: loop.ClusterState, inputs, limit, was_done):
    """One run's chunk, as the single driver's (`simulate.advance_chunk`); a run already
    finished is returned unchanged."""
    params, cparams, req, model = inputs
    new = loop.run_cluster(cd, cs, params, cparams, req, model, limit)
    new = jax.tree.map(lambda a, b: jnp.where(was_done, b, a), new, cs)
    return new, was_done | loop.finished(new, cparams, params, req)


def _program(cd: loop.ClusterDims, mode: str):
    key = (cd, mode)
    if key not in _PROGRAMS:
        def batched(cs, inputs, limit, was_done):
            lane = lambda *a: _lane_chunk(cd, *a)  # noqa: E731
            if mode == "vmap":
                return jax.vmap(lane)(cs, inputs, limit, was_done)
            return jax.lax.map(lambda a: lane(*a), (cs, inputs, limit, was_done))

        _PROGRAMS[key] = jax.jit(batched, donate_argnums=0)
    return _PROGRAMS[key]


def compiled_programs() -> int:
    """Batched chunk programs compiled in this process (no-recompile tests)."""
    return sum(p._cache_size() for p in _PROGRAMS.values())


def default_mode() -> str:
    return "map" if jax.devices()[0].platform == "cpu" else "vmap"


# ------------------------------------------------------------------------------------ stacking


def _gpus(cs: loop.ClusterState) -> int:
    return int(cs.lifecycle.gpu_owner.shape[0])


def pad_inventory(cs: loop.ClusterState, inputs, gpus: int):
    """A run's state and inputs with its GPU inventory padded to `gpus` entries: free GPUs of
    no type on node 0, which no placement takes and no count includes."""
    extra = gpus - _gpus(cs)
    if extra <= 0:
        return cs, inputs
    life = cs.lifecycle
    cs = dataclasses.replace(cs, lifecycle=dataclasses.replace(
        life, gpu_owner=jnp.concatenate([life.gpu_owner, jnp.full(extra, -1, life.gpu_owner.dtype)])))
    params, cparams, req, model = inputs
    sp = cparams.scaling
    if sp is not None:
        sp = dataclasses.replace(sp, gpu_node=jnp.concatenate([sp.gpu_node, jnp.zeros(extra, sp.gpu_node.dtype)]),
                                 gpu_type=jnp.concatenate([sp.gpu_type, jnp.full(extra, -1, sp.gpu_type.dtype)]))
        cparams = dataclasses.replace(cparams, scaling=sp)
    return cs, (params, cparams, req, model)


def _signature(cd, cs, inputs) -> tuple:
    leaves, tree = jax.tree.flatten((cs, inputs))
    # the dtype of a device array without copying it to the host (np.asarray would)
    return cd, tree, tuple((np.shape(x), (x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).str)
                           for x in leaves)


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _lane(tree, b: int):
    return jax.tree.map(lambda x: x[b], tree)


# ------------------------------------------------------------------------------------ the driver


_LOG_FIELDS = (*cluster_sim._LOG_FIELDS, "events")


def _drive(cd, cs, inputs, readers, events_per_chunk: int, mode: str, report=None):
    """Run stacked runs (leading axis B) to their ends, reading every run's ITL logs between
    chunks: the batched `simulate._simulate_cluster_views` loop. `report(finished requests,
    simulated µs)` is called between chunks (over all the runs; the furthest clock)."""
    program = _program(cd, mode)
    runs, slots = len(readers), cd.num_instances
    events = np.zeros((runs, slots), np.int64)
    done = np.zeros(runs, bool)
    fields = (*_LOG_FIELDS, "finished", "now") if report is not None else _LOG_FIELDS
    while not done.all():
        live = ~done
        cs, finished = program(cs, inputs, jnp.asarray(events + events_per_chunk, jnp.int64), jnp.asarray(done))
        host = jax.device_get({f: getattr(cs.instances, f) for f in fields})
        if report is not None:
            report(int(np.sum(host["finished"])), int(np.max(host["now"])))
        for b in np.flatnonzero(live):
            for i, reader in enumerate(readers[b]):
                reader.collect(SimpleNamespace(**{f: host[f][b, i] for f in cluster_sim._LOG_FIELDS}))
        events = np.asarray(host["events"], np.int64)
        instances = dataclasses.replace(cs.instances, step_log_base=jnp.asarray(host["steps"]),
                                        run_len=jnp.zeros_like(cs.instances.run_len))
        cs = dataclasses.replace(cs, instances=instances)
        done = np.asarray(finished)
    return cs


@dataclasses.dataclass
class _Run:
    scenario: ResolvedScenario
    growth: Growth = dataclasses.field(default_factory=Growth)
    new_slots: int = cluster_sim.NEW_SLOTS

    def prepare(self, events_per_chunk: int) -> cluster_sim.PreparedCluster:
        s = self.scenario
        return cluster_sim.prepare_cluster(
            s.requests, s.params, s.latency_model, s.cluster, new_slots=self.new_slots, block_size=s.block_size,
            scheduler=s.scheduler, preemption_policy=s.preemption_policy, events_per_chunk=events_per_chunk,
            kv_bytes_per_token=s.kv_bytes_per_token, prefill_pool=s.prefill_pool, decode_pool=s.decode_pool,
            startup=s.startup, hardware=s.hardware, batch_start=BATCH_START)


def check_batchable(scenario: ResolvedScenario, where: str = "scenario") -> None:
    """The runs this driver takes: autoscaled clusters without the features it does not stack
    (LoRA adapters, closed-loop sessions)."""
    if scenario.requests is None or scenario.sessions is not None:
        raise ConfigError(f"{where}: batched autoscaler runs need an open-loop workload (no sessions)")
    if scenario.lora is not None:
        raise ConfigError(f"{where}: batched autoscaler runs do not support LoRA adapters yet")
    if scenario.cluster.validate().effective_autoscaler() is None:
        raise ConfigError(f"{where}: not an autoscaled cluster; set an autoscaler interval (policy-config "
                          "autoscaler.interval_us, or model-autoscaler-interval-us)")


def simulate_batched(scenarios: Sequence[ResolvedScenario], *, events_per_chunk: int = EVENTS_PER_CHUNK,
                     mode: str | None = None, max_batch: int | None = None, new_slots: int = cluster_sim.NEW_SLOTS,
                     progress: Callable[[int, int, int], None] | None = None) -> list[SimOutput]:
    """Simulate autoscaled cluster scenarios that share one program's structure as batched
    calls; returns each scenario's `SimOutput`, equal to its own `simulate_cluster` run.
    `mode`: "vmap" (accelerators' default) or "map" (CPU's). Scenarios whose programs differ in
    structure run in separate batches (one per structure); `max_batch` caps the runs stacked in
    one batch (None: MAX_BATCH); `new_slots`: instance slots planned for each run's autoscaler
    (on node pools; 4x as many on a rerun when they ran out); `progress(finished, total, sim_us)`
    is called between chunks, over the batch being run (a rerun reports from 0 again)."""
    mode = mode or default_mode()
    if mode not in ("vmap", "map"):
        raise ConfigError(f"mode must be vmap or map, got {mode!r}")
    for k, s in enumerate(scenarios):
        check_batchable(s, f"scenario {k}")
    runs = [_Run(s, new_slots=new_slots) for s in scenarios]
    outputs: list = [None] * len(runs)
    pending = list(range(len(runs)))
    while pending:
        built = {}
        for i in pending:
            prepared = runs[i].prepare(events_per_chunk)
            built[i] = (prepared, *prepared.build(runs[i].growth))
        gpus = max(_gpus(b[2]) for b in built.values())
        batches: dict[tuple, list[int]] = defaultdict(list)
        for i, (prepared, cd, cs, inputs, readers, edims) in built.items():
            cs, inputs = pad_inventory(cs, inputs, gpus)
            built[i] = (prepared, cd, cs, inputs, readers, edims)
            batches[_signature(cd, cs, inputs)].append(i)
        pending = []
        max_batch = max_batch or MAX_BATCH
        for members in [m[k:k + max_batch] for m in batches.values() for k in range(0, len(m), max_batch)]:
            cd = built[members[0]][1]
            cs = _stack([built[i][2] for i in members])
            inputs = _stack([built[i][3] for i in members])
            readers = [built[i][4] for i in members]
            for i in members:   # the stacked copies replace the runs' own states (memory: slots × requests)
                built[i] = (*built[i][:2], None, None, *built[i][4:])
            total = sum(len(runs[i].scenario.requests) for i in members)
            report = (lambda done, sim_us: progress(done, total, sim_us)) if progress is not None else None  # noqa: E731
            cs = _drive(cd, cs, inputs, readers, events_per_chunk, mode, report)
            host = jax.device_get(cs)
            del cs, inputs
            for b, i in enumerate(members):
                lane = _lane(host, b)
                code = cluster_sim.result_code(lane)
                run = runs[i]
                grown = run.growth.after(code)
                if grown is not None:  # as run_growing: the overflowed buffers, same slots
                    run.growth = grown
                    pending.append(i)
                elif code & results.INSTANCE_SLOTS_FULL and run.new_slots < MAX_NEW_SLOTS:
                    run.growth, run.new_slots = Growth(), run.new_slots * 4  # as simulate_cluster_views
                    pending.append(i)
                else:
                    prepared, edims = built[i][0], built[i][5]
                    outputs[i] = prepared.finish(lane, edims, code, built[i][4])[0]
    return outputs
