"""The ITL log: written inside the loop (`record_step`), read by the host (`ItlLogReader`) to
build `SimOutput`'s ITL pool.

Inside the loop every executed step writes its ITL sample (step time + α2, the same for every
request decoding in it) at `step index mod step_log`, and a decode run broken by a gap goes to
the run log. The chunked driver reads both after every chunk and marks them read (`step_log_base`, `run_len`), so their device sizes only bound one chunk; a whole run
in one call (`run_to_end`) needs logs that hold the whole run (else a *_LOG_FULL result bit).

A request's ITL samples are those since its last admission (preemption discards earlier ones,
as BLIS does), so runs that started before it are ignored.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from blis_jax.engine import results
from blis_jax.engine.dims import EngineDims
from blis_jax.engine.state import EngineState


def record_step(state: EngineState, step_sample, dims: EngineDims, rows, r, decoded, sample, active):
    """Log step `state.steps`. Every decoding request of a step gets the same ITL sample, so the
    log keeps one value per step and, per request, the runs of consecutive steps it decoded in: memory
    O(steps + requests), not O(tokens). A run broken by a gap (a running request that got no
    token this step) goes to the run log; the open run is written with the request's record."""
    state = record_runs(state, dims, rows, r, decoded, active)
    at_step = jnp.where(active, state.steps % dims.step_log, dims.step_log)
    return state, step_sample.at[at_step].set(sample.astype(jnp.int32), mode="drop")


def record_runs(state: EngineState, dims: EngineDims, rows, r, decoded, active) -> EngineState:
    """`record_step` without the sample: the decode runs of step `state.steps`."""
    now_step = state.steps
    first, last = state.row_run_first[rows], state.row_run_last[rows]
    gap = decoded & (first >= 0) & (last != now_step - 1)
    at = state.run_len + jnp.cumsum(gap) - 1
    log_at = jnp.where(gap, at, dims.run_log)
    run_full = jnp.any(gap & (at >= dims.run_log))
    log_full = active & (now_step - state.step_log_base >= dims.step_log)
    drop_row = jnp.where(decoded, rows, dims.rows)
    state = dataclasses.replace(
        state,
        run_req=state.run_req.at[log_at].set(r.astype(jnp.int32), mode="drop"),
        run_first=state.run_first.at[log_at].set(first, mode="drop"),
        run_last=state.run_last.at[log_at].set(last, mode="drop"),
        run_len=state.run_len + jnp.sum(gap).astype(jnp.int32),
        row_run_first=state.row_run_first.at[drop_row].set(jnp.where((first < 0) | gap, now_step, first), mode="drop"),
        row_run_last=state.row_run_last.at[drop_row].set(now_step, mode="drop"),
        result=state.result | jnp.where(run_full, results.RUN_LOG_FULL, 0).astype(jnp.int32)
        | jnp.where(log_full, results.STEP_LOG_FULL, 0).astype(jnp.int32),
    )
    return state


class ItlLogReader:
    """Accumulates the step samples and gap-closed runs read from successive states."""

    def __init__(self) -> None:
        self._samples: list[np.ndarray] = []
        self._runs: list[np.ndarray] = []
        self._trace: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._read_steps = 0

    def read(self, state: EngineState) -> EngineState:
        """Copy what the loop logged since the last read; returns `state` with it marked read."""
        self.collect(state)
        return dataclasses.replace(state, step_log_base=jnp.asarray(self._read_steps, jnp.int64),
                                   run_len=jnp.asarray(0, jnp.int32))

    def collect(self, state) -> None:
        """Copy what the loop logged since the last read from `state`, or from any object with
        its log fields (a host copy of one instance's); the caller then marks the log read
        (`step_log_base` = steps, `run_len` = 0), as `read` does."""
        steps, logged = int(state.steps), int(state.step_log_base)
        if logged != self._read_steps:
            raise RuntimeError("ItlLogReader: the state was not the one returned by the last read()")
        size = state.step_sample.shape[0]
        if steps > logged:
            self._samples.append(np.asarray(state.step_sample)[np.arange(logged, steps) % size])
            trace_size = state.step_start.shape[0]
            if trace_size > 1:  # step trace on (dims.trace_steps)
                at = np.arange(logged, steps) % trace_size
                self._trace.append((np.asarray(state.step_start)[at], np.asarray(state.step_dur)[at],
                                    np.asarray(state.step_basis)[at]))
        k = int(state.run_len)
        if k:
            # host copies first: slicing a device array would compile a program per slice shape
            self._runs.append(np.stack([np.asarray(state.run_req)[:k].astype(np.int64), np.asarray(state.run_first)[:k],
                                        np.asarray(state.run_last)[:k]], axis=1))
        self._read_steps = steps

    def step_trace(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start µs [S], duration µs [S], latency basis [S, 11]) of every step read so far."""
        if not self._trace:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 11))
        return tuple(np.concatenate(parts) for parts in zip(*self._trace))

    def finish(self, s, num_requests: int, completed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(`itl_step_us`, `itl_runs`) of the completed requests, from the final host state `s`."""
        self.collect(s)
        n = num_requests
        step_us = np.concatenate(self._samples) if self._samples else np.zeros(0, np.int32)
        admit = np.asarray(s.out_admit_step[:n])
        open_first, open_last = np.asarray(s.out_run_first[:n]), np.asarray(s.out_run_last[:n])
        final = np.flatnonzero(completed & (open_first >= 0))
        runs = [np.stack([final, open_first[final], open_last[final]], axis=1)] + self._runs
        runs = np.concatenate(runs).astype(np.int64)
        req = runs[:, 0]
        keep = completed[req] & (runs[:, 1] >= admit[req])
        return step_us, runs[keep]
