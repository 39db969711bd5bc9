"""Node pools, first-fit placement, per-GPU KV capacity, loading delays and the lifecycle's
transition table (blis-infra §1.3, §2, §3; worked examples WE-1 to WE-4 and WE-6)."""

from __future__ import annotations

import json

import pytest

from blis_jax.cluster import lifecycle as lc
from blis_jax.cluster.node_pools import (
    Delay,
    InstanceLifecycle,
    NodePool,
    check_pools,
    inventory,
    loading_delays,
    place_instances,
)
from blis_jax.config.policy_bundle import load_policy_bundle
from blis_jax.errors import ConfigError
from blis_jax.rng.go_rand import GoRand
from blis_jax.scenario import Deployment, ScenarioConfig, resolve_deployment
from blis_jax.scenario.config import SyntheticWorkload
from shared_data import BLIS_DIFF, needs_blis_diff


def pool(name, gpu_type, gpus, nodes, memory=80.0, cost=0.0) -> NodePool:
    return NodePool(name=name, gpu_type=gpu_type, gpus_per_node=gpus, gpu_memory_gib=memory, initial_nodes=nodes,
                    max_nodes=nodes, cost_per_hour=cost)


# --------------------------------------------------------------------------- WE-1 transitions


@pytest.mark.parametrize("source, target", [(lc.SCHEDULING, lc.LOADING), (lc.LOADING, lc.WARMING_UP),
                                            (lc.LOADING, lc.ACTIVE), (lc.WARMING_UP, lc.ACTIVE),
                                            (lc.ACTIVE, lc.DRAINING), (lc.DRAINING, lc.TERMINATED)])
def test_we1_allowed_transitions(source, target):
    assert lc.allowed(source, target)


def test_we1_rejected_and_only_forward():
    assert not lc.allowed(lc.ACTIVE, lc.LOADING) and not lc.allowed(lc.TERMINATED, lc.ACTIVE)
    states = (lc.SCHEDULING, lc.LOADING, lc.WARMING_UP, lc.ACTIVE, lc.DRAINING, lc.TERMINATED)
    for s in states:
        assert not lc.allowed(s, s)   # no self-transition
        for t in lc.ALLOWED[s]:
            assert states.index(t) > states.index(s)


def test_routable_means_warming_up_or_active():
    life = lc.make([lc.ABSENT, lc.LOADING, lc.WARMING_UP, lc.ACTIVE, lc.DRAINING, lc.TERMINATED])
    assert lc.routable(life).tolist() == [False, False, True, True, False, False]


def test_loaded_event_moves_only_due_loading_instances():
    life = lc.make([lc.LOADING, lc.LOADING, lc.ACTIVE], loaded_at=[100, 200, 50])
    assert int(lc.next_loaded(life)) == 100   # an Active instance's stale time is not an event
    after = lc.load(life, 100, True)
    assert after.state.tolist() == [lc.ACTIVE, lc.LOADING, lc.ACTIVE]
    assert int(lc.next_loaded(after)) == 200
    assert lc.load(life, 100, False).state.tolist() == life.state.tolist()


# ----------------------------------------------------------------------- WE-2 inventory


def test_we2_two_pool_inventory():
    gpus = inventory((pool("h100-pool", "H100", 8, 2), pool("a100-pool", "A100", 4, 1)))
    assert len({g.node for g in gpus}) == 3 and len({g.id for g in gpus}) == 20
    assert sum(g.pool == "h100-pool" for g in gpus) == 16 and sum(g.pool == "a100-pool" for g in gpus) == 4
    assert all(g.id.startswith(g.pool) for g in gpus)
    assert [g.node for g in gpus][::4] == ["h100-pool-0"] * 2 + ["h100-pool-1"] * 2 + ["a100-pool-0"]
    assert gpus[0].id == "h100-pool-0-gpu-0"
    assert inventory((pool("empty", "H100", 8, 0),)) == ()


# ------------------------------------------------------------------- WE-3 / WE-4 first fit


def test_we3_first_fit_on_one_node():
    placed, owner = place_instances((pool("p", "H100", 8, 1),), 3, tp=4)
    assert [p.gpu_ids for p in placed[:2]] == [tuple(f"p-0-gpu-{g}" for g in range(4)),
                                              tuple(f"p-0-gpu-{g}" for g in range(4, 8))]
    assert placed[2] is None                     # the third TP-4 instance finds no free GPU
    assert owner == (0,) * 4 + (1,) * 4          # and nothing changed for it (conservation)
    placed, _ = place_instances((pool("p", "H100", 8, 1),), 1, tp=3)
    assert placed[0].gpu_ids == ("p-0-gpu-0", "p-0-gpu-1", "p-0-gpu-2")


def test_we4_later_pool_only_when_earlier_ones_are_full():
    pools = (pool("h100-pool", "H100", 8, 2, cost=20), pool("a100-pool", "A100", 4, 2, cost=10))
    placed, owner = place_instances(pools, 7, tp=4)
    assert [p.node if p else None for p in placed] == [
        "h100-pool-0", "h100-pool-0", "h100-pool-1", "h100-pool-1", "a100-pool-0", "a100-pool-1", None]
    assert [p.gpu_type for p in placed[:6]] == ["H100"] * 4 + ["A100"] * 2
    assert sum(o >= 0 for o in owner) == 24       # GPUs in use = 6 instances × TP 4
    assert place_instances((pool("none", "H100", 8, 0),), 1, tp=1)[0] == (None,)


def test_pending_index_is_consumed_and_tp_zero_means_one():
    placed, _ = place_instances((pool("big", "H100", 2, 1), pool("small", "L40S", 2, 1, memory=48.0)), 5, tp=0)
    assert [p.instance_id if p else None for p in placed] == [
        "instance_0", "instance_1", "instance_2", "instance_3", None]
    assert [p.tp for p in placed[:4]] == [1] * 4


def test_cost_and_memory_come_from_the_first_pool_of_the_type():
    pools = (pool("a", "H100", 1, 1, memory=80.0, cost=10), pool("b", "H100", 1, 1, memory=40.0, cost=99))
    placed, _ = place_instances(pools, 2, tp=1)
    assert placed[1].node == "b-0"
    assert (placed[1].gpu_memory_gib, placed[1].cost_per_hour) == (80.0, 10.0)


def test_duplicate_pool_names_are_refused():
    with pytest.raises(ConfigError, match="duplicate pool name 'p'"):
        check_pools((pool("p", "H100", 1, 1), pool("p", "A100", 1, 1)))


# ------------------------------------------------------------------------- loading delays


class NoDraw:
    def norm_float64(self):
        raise AssertionError("a draw was made")


@pytest.mark.parametrize("delay, want", [(Delay(2.5, 0.0), 2_500_000), (Delay(0.0, 0.0), 0),
                                         (Delay(0.0000004, 0.0), 0), (Delay(1e-6, 0.0), 1)])
def test_delay_without_stddev_draws_nothing(delay, want):
    assert delay.sample_us(NoDraw()) == want


def test_delay_draw_is_norm_times_stddev_plus_mean_truncated_and_clamped():
    rng, ref = GoRand(7), GoRand(7)
    for _ in range(20):
        z = ref.norm_float64()
        assert Delay(1.0, 0.75).sample_us(rng) == int(max(z * 0.75 + 1.0, 0.0) * 1e6)
    assert Delay(0.0, 1.0).sample_us(type("Neg", (), {"norm_float64": lambda self: -3.0})()) == 0


def test_warm_start_and_pending_instances_draw_nothing():
    placed, _ = place_instances((pool("p", "H100", 2, 1),), 4, tp=1)
    assert loading_delays(placed, InstanceLifecycle(Delay(2.0, 0.5), True), seed=1) == (0, 0, 0, 0)
    delays = loading_delays(placed, InstanceLifecycle(Delay(2.0, 0.5)), seed=1)
    assert delays[2:] == (0, 0) and all(d > 0 for d in delays[:2])
    # the pending ones draw nothing: the placed instances' delays are the stream's first two
    assert loading_delays(placed[:2], InstanceLifecycle(Delay(2.0, 0.5)), seed=1) == delays[:2]


@needs_blis_diff
def test_f01_loading_delays_agree_with_blis_first_routed_arrivals():
    """F01: each instance became Active before (or at) its first routed arrival, and the first
    one after request_63 arrived (rejected: nothing routable) and by request_64's arrival."""
    folder = next(BLIS_DIFF.glob("F01_*"))
    case = json.loads((folder / "case.json").read_text())
    bundle = load_policy_bundle(folder / "bundle.yaml")
    placed, _ = place_instances(bundle.node_pools, 4, tp=1)
    delays = loading_delays(placed, bundle.instance_lifecycle, seed=case["seed"])
    first = case["key_outcomes"]["first_routed_arrival_s_per_instance"]
    for i, d in enumerate(delays):
        assert d <= round(first[f"instance_{i}"] * 1e6)
    assert 1_599_936 < min(delays) <= 1_624_935


# ------------------------------------------------------------------- WE-6 per-GPU KV (resolve)


def resolved(bundle_dir: str, num_instances: int, **deployment):
    folder = next(BLIS_DIFF.glob(f"{bundle_dir}_*"))
    case = json.loads((folder / "case.json").read_text())
    config = ScenarioConfig(deployment=Deployment(model=case["model"], hardware="H100", tp=1, **deployment),
                            workload=SyntheticWorkload(), policy_config=str(folder / "bundle.yaml"))
    config = config.replace(cluster=config.cluster.__class__(num_instances=num_instances))
    warnings = []
    return resolve_deployment(config, horizon_us=None, warn=warnings.append), case, warnings


@needs_blis_diff
def test_f02_per_instance_kv_from_pool_memory_and_the_pending_instance():
    r, case, warnings = resolved("F02", 5)
    want = case["per_instance_total_kv_blocks"]
    assert r.total_kv_blocks == case["total_kv_blocks"]             # the global value is unchanged
    assert r.startup.total_kv_blocks[:4] == tuple(want[f"instance_{i}"] for i in range(4))
    assert r.startup.placed == (True, True, True, True, False)
    assert [p.gpu_type for p in r.startup.placements[:4]] == ["H100", "H100", "L40S", "L40S"]
    assert r.startup.loaded_at_us == (0,) * 5                        # warm start
    assert any("instance_4" in w for w in warnings)
    assert r.startup.max_model_len[:4] == (case["max_model_len"],) * 4  # 4113 × 16 > 40960: no cap
    assert not r.single_instance


@needs_blis_diff
def test_explicit_kv_blocks_are_kept():
    r, _, _ = resolved("F02", 4, total_kv_blocks=9999)
    assert r.startup.total_kv_blocks == (9999,) * 4


@needs_blis_diff
def test_a_failed_recompute_keeps_the_global_blocks_with_a_warning():
    r, _, warnings = resolved("F02", 4, gpu_memory_utilization=0.6)   # the weights do not fit in 48 GiB × 0.6
    assert r.startup.total_kv_blocks[2:] == (r.total_kv_blocks,) * 2
    assert any("instance_2" in w and "keeping" in w for w in warnings)


@needs_blis_diff
def test_max_model_len_is_capped_at_the_recomputed_capacity():
    r, _, _ = resolved("F02", 4, gpu_memory_utilization=0.75)
    blocks, mml = r.startup.total_kv_blocks, r.startup.max_model_len
    assert blocks[2] * 16 < r.max_model_len == mml[0]               # 48 GiB: fewer blocks than the context needs
    assert mml[2] == blocks[2] * 16


@needs_blis_diff
@pytest.mark.parametrize("case_id, instances", [("F01", 4), ("F02", 5)])
def test_placed_instances_agree_with_blis_log(case_id, instances):
    """BLIS logs one per-instance KV line per placed instance, in index order (stderr.txt)."""
    import re

    r, case, _ = resolved(case_id, instances)
    log = (next(BLIS_DIFF.glob(f"{case_id}_*")) / "stderr.txt").read_text()
    lines = re.findall(r'per-instance KV auto-calc for GPU \\"(\w+)\\": total-kv-blocks=(\d+)', log)
    ours = [(p.gpu_type, str(b)) for p, b in zip(r.startup.placements, r.startup.total_kv_blocks) if p is not None]
    assert ours == lines and len(lines) == r.startup.num_placed
