"""Lanes that differ only in a max-num-seqs the batch never reached are simulated once.

max-num-seqs enters the engine only as the test `batch_len < max_num_seqs` (admission, and
coasting's "batch is full"). A run whose running batch peaked at P requests never saw that test
fail if P < its max-num-seqs m, and a run at any m' > P takes the same branch at every test, so
it is the same run, event for event. A grid with a max-num-seqs axis therefore simulates each
family of otherwise-equal lanes in ascending max-num-seqs order, in stages: once a stage's run
peaks below its own limit, it is also the answer for every larger limit of its family.
In the benchmark grid (32 to 256 slots, 1,000 requests) most lanes peak below 32.

A family is lanes whose every simulated input is equal (requests, latency model, every engine
setting but max-num-seqs, static dims): equality is checked on a digest of the arrays, not on
the scenario's labels, so sharing can never join two runs that could differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from blis_jax.engine.output import RESULT_OK
from blis_jax.sweep.batch import run_lanes
from blis_jax.sweep.lane import InstanceLane


def _digest_arrays(h, arrays) -> None:
    for a in arrays:
        a = np.asarray(a)
        if a.dtype == object or a.dtype.kind in "USO":
            a = a.astype(str)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())


def inputs_digest(params, requests, arrays=()) -> bytes:
    """Digest of a run's engine settings but max-num-seqs, its requests and more `arrays`
    (dtype, shape and bytes of each; labels as text)."""
    h = hashlib.blake2b(digest_size=20)
    _digest_arrays(h, [getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "max_num_seqs"])
    _digest_arrays(h, [getattr(requests, f.name) for f in dataclasses.fields(requests)
                       if isinstance(getattr(requests, f.name), np.ndarray)])
    _digest_arrays(h, arrays)
    return h.digest()


def unbound_peak(out, limit: int) -> int | None:
    """The run's peak batch (over its instances) if it finished and never reached its
    max-num-seqs `limit`, so that it also answers every limit above the peak; else None."""
    peak = int(out.peak_batch_size.max(initial=0))
    return peak if out.result == RESULT_OK and peak < limit else None


def family_key(lane) -> tuple | None:
    """Equal for lanes that differ at most in max-num-seqs; None for a lane that never shares."""
    if type(lane) is not InstanceLane:
        return None
    return lane.group_key(), inputs_digest(lane.params, lane.requests, jax.tree.leaves(lane.model))


def run_lanes_shared(lanes: Sequence, reduce: Callable[[int, Any], Any], **run_options) -> list:
    """`batch.run_lanes`, with each family's lanes run in ascending max-num-seqs and the run of
    a lane whose batch never reached its limit reused for the family's larger limits."""
    families: dict[Any, list[int]] = defaultdict(list)
    for i, lane in enumerate(lanes):
        key = family_key(lane)
        families[key if key is not None else ("alone", i)].append(i)
    queues = [sorted(members, key=lambda i: int(lanes[i].params.max_num_seqs)) for members in families.values()]
    results: list = [None] * len(lanes)
    progress = run_options.get("progress")
    first = True
    while queues:
        heads = [q[0] for q in queues]
        followers = {q[0]: q[1:] for q in queues}
        carry_on: dict[int, list[int]] = {}

        def reduce_and_share(k: int, out, heads=heads, followers=followers, carry_on=carry_on):
            i = heads[k]
            rest = followers[i]
            results[i] = reduce(i, out)
            if unbound_peak(out, int(lanes[i].params.max_num_seqs)) is not None:  # rest: larger limits
                for j in rest:
                    results[j] = reduce(j, out)
                if progress is not None and rest:
                    progress.finished(sum(getattr(lanes[j], "share", 1.0) for j in rest))
            elif rest:
                carry_on[i] = rest

        # After the first stage a head's batch is known to outgrow the previous limit: it starts
        # with max-num-seqs slots rather than filling a narrow batch first and rerunning.
        stage = [lanes[i] if first else dataclasses.replace(lanes[i], batch_start=None) for i in heads]
        run_lanes(stage, reduce_and_share, **run_options)
        first = False
        queues = [carry_on[i] for i in heads if i in carry_on]
    return results
