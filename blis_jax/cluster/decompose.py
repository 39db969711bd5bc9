"""Round-robin clusters whose instances never interact: N independent single-instance runs.

With round-robin routing, always-admit admission, no admission or routing latency, no
gateway queue and no prefill/decode pools, where a request goes depends only on its place in the arrival order
(the k-th routed request goes to instance k mod N), and nothing one instance does reaches
another: the router reads no instance signal, and each instance sees its requests at their
arrival time exactly as a lone instance would. Such a cluster is exactly N single-instance runs
of the requests each instance is routed, merged as the cluster driver merges its instances
(`simulate.merge_outputs` → `combine`): tested equal, request by request, to the cluster loop.

A sweep runs those N instances as N lanes of its batched single-instance runner, which is much
cheaper than one cluster program per scenario (the instances are not in lockstep, and a lightly
loaded instance coasts through its decode runs).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from blis_jax.cluster.simulate import combine
from blis_jax.engine import output as so
from blis_jax.workload.requests import RequestSet


def independent(cluster, requests: RequestSet) -> bool:
    """Whether `cluster` (a validated `ClusterConfig`) runs `requests` as independent instances."""
    from blis_jax.cluster.simulate import unservable_models   # simulate.py is the heavier module

    return (cluster.routing_policy == "round-robin" and cluster.admission_policy == "always-admit"
            and cluster.admission_latency_us == 0 and cluster.routing_latency_us == 0 and not cluster.pd
            and cluster.flow_control is None and cluster.num_instances >= 1 and len(requests) > 0
            and not cluster.node_pools   # pools: instances differ (KV, loading times, absent ones)
            and cluster.effective_autoscaler() is None   # the autoscaler couples them (drains, new ones)
            and not unservable_models(requests, cluster.served_model))   # rejected at routing instead


def route(requests: RequestSet, num_instances: int, horizon_us: int | None) -> np.ndarray:
    """`handled_by` of each request: requests are routed in arrival order while they arrive by
    the horizon (the cluster's arrival events stop at the first later one); -1 = not routed."""
    n = len(requests)
    routed = np.ones(n, bool) if horizon_us is None else np.cumprod(requests.arrival_us <= horizon_us).astype(bool)
    return np.where(routed, np.arange(n) % num_instances, -1).astype(np.int32)


def instance_requests(requests: RequestSet, members: np.ndarray) -> RequestSet:
    """The requests at positions `members` (ascending), as their own request set."""
    per_request = {f.name: getattr(requests, f.name)[members] for f in dataclasses.fields(requests)
                   if isinstance(getattr(requests, f.name), np.ndarray)}
    columns = {name: col[members] for name, col in requests.trace_columns.items()}
    return dataclasses.replace(requests, **per_request, trace_columns=columns)


def merge(outputs, members: list[np.ndarray], handled: np.ndarray) -> so.SimOutput:
    """The cluster's `SimOutput` from its instances' own runs: `outputs` holds, in instance
    order, one output over the requests `members[i]` for each instance that was routed any."""
    n = handled.shape[0]
    lanes = []
    outputs = iter(outputs)
    for idx in members:
        if not len(idx):  # an instance that was routed nothing
            lanes.append(_idle(n))
            continue
        out = next(outputs)
        # rows of other instances' requests stay zero: `combine` reads only this instance's
        fields = {}
        for name, dtype in so._PER_REQUEST.items():
            fields[name] = np.zeros(n, dtype)
            fields[name][idx] = getattr(out, name)
        runs = out.itl_runs.copy()
        runs[:, 0] = idx[runs[:, 0]]
        lanes.append(dataclasses.replace(out, **fields, itl_runs=runs))
    code = 0
    for out in lanes:
        code |= out.result
    return so.SimOutput(**combine(lanes, handled), result=code)


def _idle(n: int) -> so.SimOutput:
    """The output of an instance that served nothing (its rows are never read)."""
    per_request = {name: np.zeros(n, dtype) for name, dtype in so._PER_REQUEST.items()}
    return so.SimOutput(**per_request, **{name: 0 for name in so._COUNTERS}, itl_step_us=np.zeros(0, np.int32),
                        itl_runs=np.zeros((0, 3), np.int64), result=0)
