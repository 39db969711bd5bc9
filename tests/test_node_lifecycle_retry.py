"""BLIS's library-only retry of pending startup instances (blis-infra §3.5, §1.2, §1.3 rule 3,
§2.3 D), reached here through node provisioning (`ClusterConfig.provision_nodes`): a startup
instance that could not be placed stays on BLIS's pending list; when a provisioned node turns
Ready (its NodeReady event, priority −2) one retry pass over the list places every entry that
now fits — removed by moving the last entry into its place — as a live instance after every
existing one, with a loading delay drawn from `instance-loading` in retry order."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.engine.params import INF_TIME
from blis_jax.rng.go_rand import GoRand
from blis_jax.rng.streams import INSTANCE_LOADING, subsystem_seed

from cluster_helpers import after_each_chunk  # noqa: E402

POOL = NodePool(name="p", gpu_type="H100", gpus_per_node=1, gpu_memory_gib=80.0, initial_nodes=1, max_nodes=3,
                provisioning_delay=Delay(2.0, 0.0))
LOADING = Delay(1.0, 0.3)


# ------------------------------------------------------------------- the retry pass, by itself


def _retry(pending: list[int], free_gpus: int, delays: list[int]):
    """One NodeReady event of node 1 (with `free_gpus` TP-1 GPUs) on a cluster whose startup
    slots 0–1 are Active on node 0 and whose pending list is `pending`; returns (scaling state,
    lifecycle)."""
    from blis_jax.cluster import autoscaler as asc
    from blis_jax.cluster import scaling

    slots = 10
    gpu_node = np.array([0, 0] + [1] * free_gpus, np.int32)
    g = gpu_node.shape[0]
    rank = np.empty(slots, np.int64)
    names = [f"instance_{k}" for k in range(slots)]
    rank[sorted(range(slots), key=lambda k: names[k].encode())] = np.arange(slots)
    variants = asc.Variants.of([("H100", 1, 0.0)])
    sp = scaling.ScalingParams(
        interval_us=jnp.int64(1), up_window_us=jnp.int64(0), down_window_us=jnp.int64(0),
        analyzer=asc.AnalyzerParams.of(asc.AnalyzerConfig().effective()), variants=variants,
        variant_gpu_type=jnp.zeros(1, jnp.int32), variant_tp=jnp.ones(1, jnp.int32),
        scrape_delay_us=jnp.zeros(4, jnp.int64), loading_delay_us=jnp.asarray(delays, jnp.int64),
        gpu_node=jnp.asarray(gpu_node), gpu_type=jnp.zeros(g, jnp.int32), startup_rank=jnp.asarray(rank),
        first_new_slot=jnp.int32(2), unbounded=jnp.asarray(True),
        node_initial=jnp.asarray(np.arange(g) == 0), node_type=jnp.zeros(g, jnp.int32),
        node_delay_mean_s=jnp.zeros(g), node_delay_std_s=jnp.zeros(g), provisioning_normals=jnp.zeros(4),
        startup_tp=jnp.int32(1), type_variant=jnp.zeros(1, jnp.int32))
    retry = np.full(slots, -1, np.int32)
    retry[:len(pending)] = pending
    ss = scaling.init_state(1, slots, 2, 16, np.zeros(slots, np.int32))
    ready_at = np.full(g, INF_TIME, np.int64)
    ready_at[0], ready_at[1] = 0, 5_000
    ss = dataclasses.replace(ss, next_slot=jnp.int32(2), node_ready_at=jnp.asarray(ready_at),
                             provisioning_draws=jnp.int32(0), node_ready=jnp.asarray(np.arange(g) == 0),
                             retry_index=jnp.asarray(retry), retry_len=jnp.int32(len(pending)))
    owner = np.full(g, -1, np.int32)
    owner[:2] = [0, 1]
    life = lc.make([lc.ACTIVE, lc.ACTIVE] + [lc.ABSENT] * (slots - 2), gpus=[1, 1] + [0] * (slots - 2),
                   gpu_owner=owner)
    return jax.jit(scaling.node_ready_event)(ss, sp, life, jnp.int64(5_000), jnp.asarray(True))


def test_retry_pass_swaps_the_last_pending_entry_into_a_placed_ones_place():
    from blis_jax.cluster import scaling

    ss, life = _retry([2, 3, 4, 5], free_gpus=2, delays=[700, 0, 900, 0])
    # entry 0 (instance_2) fits; instance_5 moves into its place and is tried next, fits; then
    # no room: instance_4, instance_3 stay pending, in that order (§3.5)
    names = scaling.slot_names(ss, "m", int(ss.next_slot))
    assert names == ["instance_0", "instance_1", "instance_2", "instance_5"]
    assert int(ss.retry_len) == 2 and np.asarray(ss.retry_index[:2]).tolist() == [4, 3]
    # delays in retry order (§1.3 rule 3): instance_2 the first draw (700 µs: Loading), instance_5
    # the second (0: Active at once, no event)
    state, loaded = np.asarray(life.state), np.asarray(life.loaded_at)
    assert state[2] == lc.LOADING and loaded[2] == 5_000 + 700
    assert state[3] == lc.ACTIVE
    assert int(ss.loading_draws) == 2
    # first fit on the node now Ready; INV-A
    assert np.asarray(life.gpu_owner).tolist() == [0, 1, 2, 3]
    used, held = lc.gpus_in_use(life)
    assert int(used) == int(held) == 4
    assert bool(ss.node_ready[1])


def test_retry_pass_with_room_for_all_places_every_pending_instance():
    from blis_jax.cluster import scaling

    ss, life = _retry([2, 3, 4], free_gpus=3, delays=[0, 0, 0, 0])
    # 2 placed → [4, 3]: 4 placed → [3]: 3 placed (each entry tried once, bounded by 3 attempts)
    assert scaling.slot_names(ss, "m", int(ss.next_slot))[2:] == ["instance_2", "instance_4", "instance_3"]
    assert int(ss.retry_len) == 0


def test_retry_pass_keeps_what_does_not_fit_pending():
    ss, life = _retry([2, 3], free_gpus=1, delays=[0, 0, 0, 0])   # one GPU: one instance
    assert int(ss.next_slot) == 3 and int(ss.retry_len) == 1 and int(ss.retry_index[0]) == 3
    assert int(ss.loading_draws) == 1   # no draw for an instance not placed


# ------------------------------------------------------------------------ inside a whole run


def _scenario(**cluster):
    from blis_jax.scenario import ScenarioConfig
    from blis_jax.scenario.config import SyntheticWorkload
    from blis_jax.workload.distribution import GaussianLength

    base = dict(num_instances=2, node_pools=(POOL,),
                instance_lifecycle=InstanceLifecycle(loading_delay=LOADING, warm_start_initial_instances=True),
                model_autoscaler_interval_us=1_000_000, provision_nodes=True)
    base.update(cluster)
    return ScenarioConfig(
        workload=SyntheticWorkload(rate=60.0, num_requests=600, prompt=GaussianLength(1000, 50, 16, 2000),
                                   output=GaussianLength(200, 10, 8, 400)),
        cluster=ClusterConfig(**base), seed=7)


PROVISIONED = re.compile(r"provisioning node (\S+) after a failed placement .*: Ready at (\d+) µs")
PLACED = re.compile(r"scale-up: placed instance (\S+) for model .* on node (\S+) ")


@pytest.mark.slow   # compiles a cluster program
def test_pending_startup_instance_starts_on_the_first_provisioned_node():
    from blis_jax.engine import output as so
    from blis_jax.scenario import simulate

    held = []
    with after_each_chunk(lambda cs: held.append(tuple(int(x) for x in lc.gpus_in_use(cs.lifecycle)))):
        result = simulate(_scenario())
    out = result.output
    assert held and all(a == b for a, b in held)   # INV-A
    log = [(t, text) for t, _, text in out.cluster_log]
    provisioned = [(t, *PROVISIONED.search(x).groups()) for t, x in log if PROVISIONED.search(x)]
    assert provisioned and provisioned[0][1] == "p-1"
    ready = int(provisioned[0][2])
    # instance_1 (pending: one GPU for two TP-1 instances) is placed at p-1's NodeReady, as a
    # new instance after the existing ones; the autoscaler's replicas never land on p-1
    names = list(out.instance_names)
    assert names[0] == "instance_0" and "instance_1" in names
    k = names.index("instance_1")
    placed = [(t, *PLACED.search(x).groups()) for t, x in log if PLACED.search(x)]
    assert all(node != "p-1" for _, _, node in placed)
    assert all(names.index(i) < k for t, i, _ in placed if t < ready)
    # Loading at the NodeReady, Active after the first run-time draw of `instance-loading`
    # (the startup instance was warm-started: no construction draw)
    z = GoRand(subsystem_seed(7, INSTANCE_LOADING)).norm_float64()
    delay = int(max(z * LOADING.stddev + LOADING.mean, 0.0) * 1e6)
    entered = np.asarray(out.instance_entered)[k]
    assert entered[lc.LOADING] == ready and entered[lc.ACTIVE] == ready + delay
    # then it serves requests, all routed after it became routable
    mine = np.asarray(out.handled_by) == k
    assert mine.sum() > 0 and np.all(np.asarray(result.requests.arrival_us)[mine] >= ready + delay)
    # request conservation: every request completed or was rejected at routing
    status = np.asarray(out.status)
    assert np.all(so.is_completed(status) | (status == so.ROUTING_REJECTED))
    assert np.all(np.asarray(out.handled_by)[so.is_completed(status)] >= 0)


@pytest.mark.slow   # compiles a cluster program
def test_without_provisioning_no_node_event_is_traced_and_the_pending_instance_never_starts(monkeypatch):
    from blis_jax.cluster import scaling
    from blis_jax.scenario import simulate

    def traced(*args, **kwargs):
        raise AssertionError("node lifecycle traced without provision_nodes")

    for name in ("node_ready_event", "next_node_ready", "node_drain_event", "next_node_drain", "nodes_drained",
                 "_provision", "_past_provisioning"):
        monkeypatch.setattr(scaling, name, traced)
    jax.clear_caches()   # trace the program here, not reuse one traced before
    out = simulate(_scenario(provision_nodes=False)).output
    # BLIS's CLI: a startup instance that cannot be placed never starts
    assert "instance_0" in out.instance_names and "instance_1" not in out.instance_names


# -------------------------------------------------------------------------------- node drain


def test_node_drains_validation():
    from blis_jax.errors import ConfigError

    ok = dict(node_pools=(POOL,), model_autoscaler_interval_us=1_000_000, provision_nodes=True)
    ClusterConfig(**ok, node_drains=(("p-2", 0),)).validate()   # a provisionable node
    with pytest.raises(ConfigError, match="cluster.node_drains.*provision_nodes"):
        ClusterConfig(node_pools=(POOL,), node_drains=(("p-0", 0),)).validate()
    with pytest.raises(ConfigError, match="unknown node 'p-3'"):
        ClusterConfig(**ok, node_drains=(("p-3", 0),)).validate()
    with pytest.raises(ConfigError, match="drained twice"):
        ClusterConfig(**ok, node_drains=(("p-0", 0), ("p-0", 5))).validate()
    for bad in (("p-0",), ("p-0", -1), ("p-0", 1.5), ["p-0", 0]):
        with pytest.raises(ConfigError, match="node ID, time in µs"):
            ClusterConfig(**ok, node_drains=(bad,)).validate()


DRAIN_LOG = re.compile(r"\[node\] (?:draining node (\S+):|node (\S+) drained:|drain of node (\S+) ignored)")


@pytest.mark.slow   # compiles a cluster program
def test_node_drain_ready_to_draining_to_terminated():
    from blis_jax.scenario import simulate

    pool = dataclasses.replace(POOL, initial_nodes=2, max_nodes=4)
    # p-0 holds instance_0 (never released), p-1 is empty, p-3 is never provisioned, p-2 gets
    # the autoscaler's replica at 7 s (p-0 Draining and p-1 Terminated leave no room before)
    drains = (("p-0", 1_000_000), ("p-1", 1_000_000), ("p-3", 1_000_000), ("p-2", 8_000_000))
    held = []
    with after_each_chunk(lambda cs: held.append(tuple(int(x) for x in lc.gpus_in_use(cs.lifecycle)))):
        out = simulate(_scenario(num_instances=1, node_pools=(pool,), node_drains=drains)).output
    assert held and all(a == b for a, b in held)   # INV-A
    log = [(t, x) for t, _, x in out.cluster_log]
    events = [(t, "draining" if m[1] else "drained" if m[2] else "ignored", next(g for g in m.groups() if g))
              for t, x in log if (m := DRAIN_LOG.search(x))]
    placed = [(t, *PLACED.search(x).groups()) for t, x in log if PLACED.search(x)]
    # nothing is placed on a Draining or Terminated node: the first scale-up fails and provisions p-2
    assert placed and all(node == "p-2" for _, _, node in placed)
    assert any("PlaceInstance failed" in x for t, x in log if 1_000_000 < t < placed[0][0])
    names = list(out.instance_names)
    k = names.index(placed[0][1])
    terminated = int(np.asarray(out.instance_entered)[k][lc.TERMINATED])
    assert terminated > 8_000_000   # the autoscaler drains its replica later
    # empty p-1: Terminated at once; p-0 stays Draining (its GPU is never released); p-3 is not
    # Ready (never provisioned): ignored; p-2: Terminated when its only instance released its GPU
    assert events == [(1_000_000, "draining", "p-0"), (1_000_000, "draining", "p-1"), (1_000_000, "drained", "p-1"),
                      (1_000_000, "ignored", "p-3"), (8_000_000, "draining", "p-2"), (terminated, "drained", "p-2")]


def test_a_node_provisioned_with_no_delay_is_still_provisioning_until_its_node_ready():
    # two failed placements at the same µs, zero provisioning delay: node 1 was provisioned by
    # the first (Ready at 5000 µs, its NodeReady not yet run), so the second provisions nothing
    from blis_jax.cluster import scaling

    ss = scaling.init_state(1, 4, 2, 16, np.zeros(4, np.int32))
    ss = dataclasses.replace(ss, node_ready_at=jnp.asarray([0, 5000, INF_TIME], jnp.int64),
                             provisioning_draws=jnp.int32(0), node_ready=jnp.asarray([True, False, False]))

    class Params:  # the fields _provision reads: three nodes of one type, node 0 initial, no delay
        node_type = jnp.zeros(3, jnp.int32)
        node_initial = jnp.asarray([True, False, False])
        provisioning_normals = jnp.zeros(4)
        node_delay_std_s = jnp.zeros(3)
        node_delay_mean_s = jnp.zeros(3)

    out = scaling._provision(ss, Params, jnp.int32(0), jnp.asarray(True), jnp.int64(5000))
    assert np.asarray(out.node_ready_at).tolist() == [0, 5000, INF_TIME]
    # once node 1 is Ready, a failed placement provisions node 2
    ready = dataclasses.replace(ss, node_ready=jnp.asarray([True, True, False]))
    out = scaling._provision(ready, Params, jnp.int32(0), jnp.asarray(True), jnp.int64(5000))
    assert np.asarray(out.node_ready_at).tolist() == [0, 5000, 5000]
