"""`InstanceLane`: one single-instance scenario as a lane of a batched sweep.

A lane adapts one engine to the batch runner (`batch.run_lanes`), which needs only:

* `group_key()`: lanes with equal keys can share a compiled program;
* `dims(growth)` and `cover(dims_list)`: the lane's own static shape (growth multiplies the
  capacities that can overflow) and the smallest shape covering several lanes;
* `inputs(dims)`: the lane's arrays as one pytree (stacked over lanes by the runner), and
  `idle(inputs)`: the same shapes simulating nothing (padding);
* `run(dims, inputs)`: the whole simulation as a pure, vmappable function;
* `result_code(state)`, `output(state, dims, code)`: the host-side result (a `SimOutput`);
* `state_bytes(dims, inputs)` for the memory budget and `work()` for chunk ordering.

The cluster engine gets its own lane type with the same methods (see docs/SWEEPS.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from blis_jax.engine import simulate
from blis_jax.engine.dims import EngineDims, choose_dims, cover
from blis_jax.engine.params import EngineParams
from blis_jax.workload.requests import RequestSet
from blis_jax.workload.sessions import FOLLOW_UP_ARRIVAL, SessionLinks, settle_sessions

# Running-batch slots of a lane before any overflow (dims.choose_dims `batch_start`): most lanes
# of a grid never run more requests at once, and a loop iteration costs ~3x less at 32 slots
# than at 256; a lane that fills them reruns with 4x, then 16x.
BATCH_START = 32


def run_instance(dims: EngineDims, inputs):
    """One single-instance simulation, start to end (vmapped over lanes by the runner)."""
    params, req, model = inputs
    return simulate.run_to_end(dims, params, req, model)


@dataclasses.dataclass(frozen=True, eq=False)
class InstanceLane:
    """One single-instance scenario ready to simulate."""

    requests: RequestSet
    params: EngineParams
    model: Any  # LatencyModel
    block_size: int = 16
    scheduler: str = "fcfs"
    preemption_policy: str = "fcfs"
    share: float = 1.0  # of a scenario, for progress: 1/N for one of a cluster's N independent instances
    batch_start: int | None = BATCH_START  # running-batch slots before any overflow (None: max-num-seqs)

    run = staticmethod(run_instance)

    @classmethod
    def of(cls, scenario, requests: RequestSet | None = None, **batch) -> InstanceLane:
        """The lane of a `ResolvedScenario` (its requests, or `requests`: e.g. one instance's
        share of a cluster); `batch`: the batch-only fields (share, batch_start, ...)."""
        return cls(requests=scenario.requests if requests is None else requests, params=scenario.params,
                   model=scenario.latency_model, block_size=scenario.block_size, scheduler=scenario.scheduler,
                   preemption_policy=scenario.preemption_policy, **batch)

    def group_key(self) -> tuple:
        """The model's tree structure holds its static fields (kind, beta mode, MoE
        communication); block size, scheduler and preemption policy are static dims."""
        return ("instance", jax.tree.structure(self.model), self.block_size, self.scheduler,
                self.preemption_policy)

    def dims(self, growth: int | Growth = 1) -> EngineDims:
        r = self.requests
        return choose_dims(input_len=r.input_len, output_len=r.output_len, prefix_group=r.prefix_group,
                           prefix_len=r.prefix_len, max_num_seqs=int(self.params.max_num_seqs),
                           max_num_batched_tokens=int(self.params.max_num_batched_tokens),
                           total_kv_blocks=int(self.params.total_kv_blocks), block_size=self.block_size,
                           scheduler=self.scheduler, preemption_policy=self.preemption_policy, growth=growth,
                           num_sessions=self.num_sessions, batch_start=self.batch_start,
                           max_model_len=int(self.params.max_model_len))

    @property
    def num_sessions(self) -> int:
        return 0

    @staticmethod
    def cover(dims: Sequence[EngineDims]) -> EngineDims:
        """The smallest dims at least as large as each of `dims` (one structure)."""
        return cover(list(dims))

    def inputs(self, dims: EngineDims):
        return (self.params, simulate.request_arrays(self.requests, dims, on_device=False), self.model)

    @staticmethod
    def idle(inputs):
        """`inputs` with no valid request (same shapes, nothing to simulate): padding for a
        device's share of a chunk, done at once."""
        params, req, model = inputs
        return params, dataclasses.replace(req, valid=np.zeros_like(np.asarray(req.valid))), model

    @staticmethod
    def state_bytes(dims: EngineDims, inputs) -> int:
        """Bytes of the engine state and inputs of one lane (from shapes; nothing runs)."""
        params, req, model = inputs
        state = jax.eval_shape(functools.partial(simulate.start.__wrapped__, dims), params, req, model)
        leaves = jax.tree.leaves((state, inputs))
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)

    @staticmethod
    def result_code(state) -> int:
        return int(state.result)

    def output(self, state, dims: EngineDims, code: int):
        return simulate.to_output(state, dims, self.params, self.requests, code)

    def work(self) -> float:
        """Rough loop iterations, to put lanes of similar length in one chunk (a vmapped loop
        runs until its slowest lane is done) and to share a mapped chunk's lanes evenly among
        the devices: an iteration per request event, plus the engine steps folded into coasting
        runs of `coast_steps`. Steps are bounded below by the arrival span (at ~10 ms a step) and
        by the decode work at a full batch."""
        r = self.requests
        known = r.arrival_us[r.arrival_us < FOLLOW_UP_ARRIVAL]  # closed-loop rounds arrive in the run
        if len(known) == 0:
            return 0.0
        span_steps = (int(known[-1]) - int(known[0])) / 10_000
        decode_steps = float(r.output_len.sum()) / max(int(self.params.max_num_seqs), 1)
        return max(span_steps, decode_steps) / EngineDims.coast_steps + len(r)


@dataclasses.dataclass(frozen=True, eq=False)
class SessionLane(InstanceLane):
    """An `InstanceLane` whose workload has closed-loop sessions (the loop generates the
    follow-up rounds). Its output is (the requests that existed, their `SimOutput`), as
    `simulate.simulate_sessions` returns."""

    links: SessionLinks | None = None  # None: no sessions (then this is a plain lane)
    # golden experiments are few and busy: one program at max-num-seqs beats regrowing
    batch_start: int | None = None
    # ...and run four per device and chunk on CPU, dealt longest first: at one per device the
    # devices wait for each other after every chunk; more per device costs memory (their states
    # are large) for no gain (docs/ACCURACY.md)
    cpu_lanes_per_device = 4

    def _links(self) -> SessionLinks:
        return self.links if self.links is not None else SessionLinks.none(len(self.requests))

    @property
    def num_sessions(self) -> int:
        return self._links().num_sessions

    def inputs(self, dims: EngineDims):
        return (self.params, simulate.request_arrays(self.requests, dims, self._links(), on_device=False), self.model)

    def output(self, state, dims: EngineDims, code: int):
        out = super().output(state, dims, code)
        if self.links is None:
            return self.requests, out
        rows, settled = settle_sessions(self.requests, self.links, np.asarray(state.arrival)[: len(self.requests)],
                                        np.asarray(state.follow_seq)[: len(self.requests)])
        return settled, out.take(rows)
