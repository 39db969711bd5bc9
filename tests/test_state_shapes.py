"""`EngineState` and `RequestArrays` field annotations name their dimensions with one vocabulary
(engine/state.py's docstring): every field's shape and dtype is what its annotation says, with
each name standing for one `EngineDims` capacity. Dims are chosen so that no two capacities
coincide, so a field annotated with the wrong name cannot pass."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from blis_jax.engine.dims import choose_dims
from blis_jax.engine.simulate import request_arrays, start
from blis_jax.engine.state import EngineState, RequestArrays
from blis_jax.workload.requests import make_request_set
from engine_helpers import latency_model, params_from  # noqa: E402

NAMES = {"N": "num_requests", "W": "window", "U": "sessions", "S": "batch_slots", "R": "rows",
         "B": "blocks_per_request", "P": "preempted_slots", "Q": "wait_slots", "E": "exit_log", "K": "kv_blocks",
         "F": "free_ring", "G": "prefix_groups", "PB": "prefix_blocks", "L": "step_log", "RL": "run_log",
         "T": "trace_log", "C": "lora_slots", "A": "lora_adapters",
         "CB": "cpu_blocks", "KS": "cpu_keys", "RA": "cpu_rows"}


def _distinct_dims():
    n = 40
    requests = make_request_set(request_id=np.arange(n), arrival_us=np.arange(n) * 1000, input_len=np.full(n, 100),
                                output_len=np.full(n, 20))
    dims = choose_dims(input_len=requests.input_len, output_len=requests.output_len,
                       prefix_group=requests.prefix_group, prefix_len=requests.prefix_len, max_num_seqs=8,
                       max_num_batched_tokens=512, total_kv_blocks=700, block_size=16, scheduler="priority-fcfs",
                       step_log=96, trace_steps=True)
    dims = dataclasses.replace(dims, num_requests=48, window=256, sessions=3, batch_slots=8, preempted_slots=9,
                               blocks_per_request=12, wait_slots=24, exit_log=5, kv_blocks=1024, free_ring=640,
                               prefix_groups=2, prefix_blocks=1, run_log=72, lora_slots=6, lora_adapters=7,
                               cpu_blocks=32, cpu_keys=200)
    return requests, dims


def _check(module, dims) -> list[str]:
    problems = []
    for field in dataclasses.fields(module):
        spec = _annotation(type(module), field.name)
        value = getattr(module, field.name)
        if spec is None or not hasattr(value, "shape"):
            continue
        want = []
        for dim in spec.dims:
            want.append(dim.size if hasattr(dim, "size") else getattr(dims, NAMES[dim.name]))
        if tuple(value.shape) != tuple(want):
            problems.append(f"{field.name}: shape {value.shape}, annotated {spec.dim_str!r} = {tuple(want)}")
        if str(value.dtype) not in spec.dtypes:
            problems.append(f"{field.name}: dtype {value.dtype}, annotated {spec.dtypes}")
    return problems


def _annotation(cls, name: str):
    import typing

    hints = typing.get_type_hints(cls)
    hint = hints.get(name)
    return hint if hasattr(hint, "dims") else None


def test_every_field_has_the_shape_and_dtype_its_annotation_names():
    requests, dims = _distinct_dims()
    # T (the step trace) has the step log's length by construction, RA (CPU tier) the rows'
    sizes = {letter: getattr(dims, attr) for letter, attr in NAMES.items() if letter not in ("T", "RA")}
    assert len(set(sizes.values())) == len(sizes), f"dims must differ pairwise to tell the names apart: {sizes}"
    settings = dict(max_num_seqs=8, max_num_batched_tokens=512, total_kv_blocks=700)
    req = request_arrays(requests, dims)
    state = jax.jit(start, static_argnums=0)(dims, params_from(settings), req, latency_model())
    assert isinstance(req, RequestArrays) and isinstance(state, EngineState)
    problems = _check(req, dims) + _check(state, dims)
    assert not problems, "\n".join(problems)
