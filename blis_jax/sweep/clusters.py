"""Cluster scenarios of a sweep: `simulate_cluster` runs that share compiled programs.

A scenario with more than one instance, or with an admission policy other than always-admit,
runs on the cluster engine (`blis_jax.cluster.simulate.simulate_cluster`), the same function
`blis-jax run` calls, so its row equals a separate run of it. Scenarios that share every
static part of the cluster program form a group: the latency model's structure, the engine
dims `simulate_cluster` picks (requests bucket, batch, KV pool, block size, scheduler,
preemption policy, ...), the routing policy, the weighted policy's scorer names, the
admission policy's class and, with prefill/decode pools, the PD decider and the pools'
scorer names. A group runs with `instance_slots` = the next power of two of its
largest instance count: the active count is a mask (`ClusterParams.active`), so instance
counts, rates, seeds, scorer weights, token-bucket numbers, signal delays and latencies
within a group all share one compiled program. Padding slots are inactive and never routed
to; `simulate_cluster` returns counters for the active instances only, so the padding does
not change any metric (tested against `blis-jax run`).

The scenarios run one after another (one compiled program per group; vmapping whole
clusters across scenarios is a later optimization).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax

from blis_jax.cluster import scorers
from blis_jax.cluster.deployments import largest_kv_blocks
from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster
from blis_jax.engine.dims import EngineDims, bucket, choose_dims
from blis_jax.engine.params import EngineParams
from blis_jax.scenario import ResolvedScenario
from blis_jax.sweep.lane import BATCH_START
from blis_jax.sweep.progress import SweepProgress
from blis_jax.sweep.shared_runs import inputs_digest, unbound_peak
from blis_jax.workload.requests import RequestSet

# Events between two host reads of the ITL logs; also sizes the step log (so it is part of the
# program's shape). simulate_cluster's default, which `blis-jax run` uses without --progress.
# The running batch starts at BATCH_START slots, as the sweep's lanes do (a full batch reruns
# the cluster wider), where `run` takes max-num-seqs slots: above 32 the programs differ.
EVENTS_PER_CHUNK = 200_000


def instance_slots(num_instances: int) -> int:
    """Compiled instance slots for a largest instance count: the next power of two."""
    return bucket(num_instances, 1)


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterScenario:
    """One resolved cluster scenario, run as `blis-jax run` runs it (simulate_cluster), at
    the sweep's instance slots and starting batch."""

    scenario: ResolvedScenario

    @property
    def requests(self) -> RequestSet:
        return self.scenario.requests

    @functools.cached_property
    def params(self) -> EngineParams:
        return self.scenario.params

    @property
    def model(self):
        return self.scenario.latency_model

    @property
    def cluster(self) -> ClusterConfig:
        return self.scenario.cluster

    def engine_dims(self) -> EngineDims:
        """The engine dims simulate_cluster picks for this scenario (first attempt). Only
        the grouping depends on this copy of its rule: a scenario always runs at the dims
        simulate_cluster itself chooses."""
        r, s = self.requests, self.scenario
        return choose_dims(input_len=r.input_len, output_len=r.output_len, prefix_group=r.prefix_group,
                           prefix_len=r.prefix_len, max_num_seqs=int(self.params.max_num_seqs),
                           max_num_batched_tokens=int(self.params.max_num_batched_tokens),
                           total_kv_blocks=largest_kv_blocks(self.params, s.prefill_pool, s.decode_pool),
                           block_size=s.block_size, scheduler=s.scheduler, preemption_policy=s.preemption_policy,
                           step_log=EVENTS_PER_CHUNK, batch_start=BATCH_START)

    def group_key(self) -> tuple:
        """Scenarios with equal keys share one compiled cluster program (given equal slots).
        Only the grouping depends on this key: a scenario whose program differs anyway just
        compiles its own."""
        c = self.cluster

        def names(text):
            return tuple(name for name, _ in scorers.parse_profile(text))

        pd = ((jax.tree.structure(c.pd_config()), names(c.prefill_routing_scorers) if c.prefill_routing_scorers
               else (), names(c.decode_routing_scorers) if c.decode_routing_scorers else (),
               c.prefill_decode_instances > 0) if c.pd else None)
        return ("cluster", jax.tree.structure(self.model), self.engine_dims(), c.routing_policy,
                names(c.routing_scorers) if c.routing_policy == "weighted" else (), type(c.admission()), pd, c.encode)

    def simulate(self, slots: int):
        s = self.scenario
        return simulate_cluster(self.requests, self.params, self.model,
                                dataclasses.replace(self.cluster, instance_slots=slots),
                                block_size=s.block_size, scheduler=s.scheduler,
                                preemption_policy=s.preemption_policy, events_per_chunk=EVENTS_PER_CHUNK,
                                kv_bytes_per_token=s.kv_bytes_per_token, prefill_pool=s.prefill_pool,
                                decode_pool=s.decode_pool, batch_start=BATCH_START, startup=s.startup)

    def family_key(self) -> tuple:
        """Equal for scenarios that differ at most in max-num-seqs (`shared_runs.py`): the
        cluster and pool settings by their exact repr, the arrays by digest."""
        s = self.scenario
        pools = (s.prefill_pool, s.decode_pool)
        settings = [None if p is None else dataclasses.replace(p, latency_model=None) for p in pools]
        models = [self.model] + [p.latency_model for p in pools if p is not None]
        # (not group_key: its engine dims depend on max-num-seqs below 32)
        return (jax.tree.structure(models), repr(self.cluster), repr(settings), s.block_size, s.scheduler,
                s.preemption_policy, repr(s.kv_bytes_per_token),
                inputs_digest(self.params, self.requests, jax.tree.leaves(models)))


def plan_groups(scenarios: Sequence[ClusterScenario]) -> list[tuple[int, list[int]]]:
    """[(instance slots, member indices)] per structural group, in first-appearance order."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, scenario in enumerate(scenarios):
        groups[scenario.group_key()].append(i)
    return [(instance_slots(max(scenarios[i].cluster.num_instances for i in members)), members)
            for members in groups.values()]


def run_clusters(
    scenarios: Sequence[ClusterScenario],
    reduce: Callable[[int, Any], Any],
    *,
    progress: SweepProgress | None = None,
    names: Sequence[Any] | None = None,
    shared_runs: bool = True,
) -> list:
    """Simulate every cluster scenario; returns `[reduce(i, SimOutput of scenario i)]` in
    order. A scenario the engine cannot finish is reduced with its failure code in
    `SimOutput.result` (simulate_cluster has already regrown its buffers up to its limit).
    `shared_runs`: a run in which no instance's batch reached max-num-seqs also answers the
    scenarios that differ from it only in a max-num-seqs above every instance's peak (the
    argument of `shared_runs.py`; the cluster reads max-num-seqs nowhere else), so a family is
    run in ascending max-num-seqs."""
    results: list = [None] * len(scenarios)
    limit = [int(s.params.max_num_seqs) for s in scenarios]
    order = [(slots, i) for slots, members in plan_groups(scenarios)
             for i in (sorted(members, key=lambda i: limit[i]) if shared_runs else members)]
    unbound: dict[tuple, list] = defaultdict(list)  # family → [(peak, output)] of runs whose limit never bound
    for k, (slots, i) in enumerate(order):
        family = scenarios[i].family_key() if shared_runs else None
        out = next((out for peak, out in unbound[family] if peak < limit[i]), None) if shared_runs else None
        if out is None:
            if progress is not None:
                name = f"scenario {names[i] if names is not None else i}"
                progress.cluster(k + 1, len(order), f"{name}: {scenarios[i].cluster.num_instances} instances, "
                                                    f"{slots} slots")
            out = scenarios[i].simulate(slots)
            peak = unbound_peak(out, limit[i])
            if shared_runs and peak is not None:
                unbound[family].append((peak, out))
        results[i] = reduce(i, out)
        if progress is not None:
            progress.finished(1)
    return results
