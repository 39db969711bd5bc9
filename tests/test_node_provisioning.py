"""Node provisioning by the autoscaler: a blis-jax extension beyond BLIS (BLIS's library can
provision nodes — blis-infra §3.5, WE-5 — but nothing in it, the autoscaler included, does).
With `ClusterConfig.provision_nodes`, a scale-up that finds no room provisions the next node of
a pool of the variant's GPU type (up to `max_nodes`), Ready after the pool's
`provisioning_delay` drawn by BLIS's rule (§1.3) from the `node-provisioning` stream; the
failed replica is dropped (as in BLIS), and a later scale-up places on the node once Ready."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool, inventory
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.errors import ConfigError
from blis_jax.rng.go_rand import GoRand
from blis_jax.rng.streams import NODE_PROVISIONING, subsystem_seed

from cluster_helpers import after_each_chunk  # noqa: E402

POOL = NodePool(name="p", gpu_type="H100", gpus_per_node=1, gpu_memory_gib=80.0, initial_nodes=1, max_nodes=3,
                provisioning_delay=Delay(2.0, 0.0))


def test_we5_provisioning_delay_and_node_ids():
    assert Delay(120.0, 0.0).sample_us(None) == 120_000_000   # {mean 120 s, stddev 0}: no draw
    # provisioned nodes continue the pool's node counter after its initial ones
    assert [g.node for g in inventory([POOL])] == ["p-0"]
    assert [g.id for g in inventory([POOL], provisionable=True)] == ["p-0-gpu-0", "p-1-gpu-0", "p-2-gpu-0"]


def test_validation():
    with pytest.raises(ConfigError, match="cluster.provision_nodes"):
        ClusterConfig(node_pools=(POOL,), provision_nodes=True).validate()   # no autoscaler
    with pytest.raises(ConfigError, match="cluster.provision_nodes"):
        ClusterConfig(model_autoscaler_interval_us=1e6, provision_nodes=True).validate()   # no node pools
    assert ClusterConfig().provision_nodes is False


def _scenario(stddev: float):
    from blis_jax.scenario import ScenarioConfig
    from blis_jax.scenario.config import SyntheticWorkload
    from blis_jax.workload.distribution import GaussianLength

    return ScenarioConfig(
        workload=SyntheticWorkload(rate=60.0, num_requests=600, prompt=GaussianLength(1000, 50, 16, 2000),
                                   output=GaussianLength(200, 10, 8, 400)),
        cluster=ClusterConfig(num_instances=1, node_pools=(dataclasses.replace(POOL, provisioning_delay=Delay(2.0, stddev)),),
                              instance_lifecycle=InstanceLifecycle(warm_start_initial_instances=True),
                              model_autoscaler_interval_us=1_000_000, provision_nodes=True), seed=7)


PLACED = re.compile(r"scale-up: placed instance (\S+) for model .* on node (\S+) ")
PROVISIONED = re.compile(r"provisioning node (\S+) after a failed placement .*: Ready at (\d+) µs")


@pytest.mark.slow   # compiles a cluster program
@pytest.mark.parametrize("stddev", [0.0, 0.5])
def test_scale_up_provisions_a_node_and_places_on_it_once_ready(stddev):
    from blis_jax.scenario import simulate

    held = []
    with after_each_chunk(lambda cs: held.append(tuple(int(x) for x in lc.gpus_in_use(cs.lifecycle)))):
        out = simulate(_scenario(stddev)).output
    assert all(a == b for a, b in held)   # INV-A on the grown inventory
    log = [(t, text) for t, _, text in out.cluster_log]
    failures = [t for t, text in log if "PlaceInstance failed" in text]
    provisioned = [(t, *PROVISIONED.search(text).groups()) for t, text in log if PROVISIONED.search(text)]
    placed = [(t, *PLACED.search(text).groups()) for t, text in log if PLACED.search(text)]
    assert failures and provisioned and placed
    t0, node, ready = provisioned[0]
    assert t0 == failures[0] and node == "p-1"   # the first failure provisions the pool's next node
    z = GoRand(subsystem_seed(7, NODE_PROVISIONING)).norm_float64()
    delay = 2_000_000 if stddev == 0 else int(max(z * stddev + 2.0, 0.0) * 1e6)   # blis-infra §1.3
    assert int(ready) == t0 + delay
    # nothing placed before the node is Ready, then the first placement lands on it
    assert all(t >= int(ready) for t, _, _ in placed) and placed[0][2] == "p-1"
    # no second node while p-1 was provisioning
    assert all(t >= int(ready) for t, _, _ in provisioned[1:])
    assert placed[0][1] in out.instance_names
