"""LoRA adapters (blis-features §3.12; engine/lora.py, config/lora_config.py).

BLIS parity: J01 (one instance, 4 adapters on 2 slots), J02 (4 instances, lora-affinity) and J03
(--lora-adapter-capacity 1 over the file's 3) replay byte for byte in tests/test_cli.py (-m slow),
and their generating runs in tests/test_run_blis_diff.py. Here: the configuration (file values,
flag precedence, BLIS's defaults, errors that name the field), the cost formulas against the
figures the case notes give, and the resident-set invariants along a small run (INV-L2 resident
≤ capacity, L3 one load per cold transition, L5 a running request's adapter stays loaded).
"""

from __future__ import annotations

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import latency_model, params_from

from blis_jax.cli import main
from blis_jax.config.lora_config import resolve_lora
from blis_jax.engine import lora
from blis_jax.engine import simulate as sim
from blis_jax.engine.state import QUEUED, RUNNING
from blis_jax.errors import ConfigError
from blis_jax.scenario import LoraSettings
from blis_jax.workload.requests import make_request_set
from shared_data import BLIS_DIFF, needs_blis_diff


def _case_file(prefix: str):
    return next(BLIS_DIFF.glob(f"{prefix}_*")) / "lora.yaml"


@needs_blis_diff
def test_j01_file_takes_blis_defaults_and_cost_formulas():
    cfg = resolve_lora(LoraSettings(config=_case_file("J01")))
    assert cfg.ids == ("sql-r8", "chat-r16", "code-r32", "math-r64") and cfg.capacity == 2
    # J01 notes: a cold load takes 1500 + rank µs; rank 64 maps to the nearest tier, 32
    assert [cfg.load_time_us(r) for _, r in cfg.adapters] == [1508, 1516, 1532, 1564]
    assert cfg.tier(64) == (0.06, 1.0) and cfg.tier(8) == (0.02, 1.0)
    # reservation 2 slots x 2e6 bytes/rank x rank 64 (26190 blocks instead of 26312: test_kv_capacity)
    assert cfg.reservation_gib == 2 * 2e6 * 64 / 2**30


@needs_blis_diff
def test_j03_flag_overrides_the_file_capacity():
    path = _case_file("J03")
    assert resolve_lora(LoraSettings(config=path)).capacity == 3
    cfg = resolve_lora(LoraSettings(config=path, adapter_capacity=1))
    assert cfg.capacity == 1
    # file costs (YAML 1.1 reads 5.0e5 as a string): 8000 + 2 x rank µs, per the case notes
    assert [cfg.load_time_us(r) for _, r in cfg.adapters] == [8016, 8032, 8128]
    assert cfg.tier(64) == (0.15, 1.0) and cfg.tier(16) == (0.08, 1.0)
    costs = resolve_lora(LoraSettings(config=path, load_base_latency_us=100.0, load_bandwidth_bytes_us=1e6,
                                      footprint_bytes_per_rank=1e6))
    assert costs.load_time_us(8) == 108


def test_step_factor_counts_distinct_adapters_and_the_highest_rank():
    cfg = lora.LoraConfig(adapters=(("a", 8), ("b", 16), ("c", 64)), capacity=2)
    params = params_from({"max_num_seqs": 8, "max_num_batched_tokens": 256, "total_kv_blocks": 100})
    params = dataclasses.replace(params, lora=lora.lora_params(cfg, 4))
    factor = lambda adapters, scheduled: float(lora.step_factor(params, jnp.asarray(adapters, jnp.int32),  # noqa: E731
                                                                jnp.asarray(scheduled)))
    assert factor([-1, -1], [True, True]) == 1.0
    assert factor([0, 0, -1], [True, True, True]) == 1.0 + 0.02 * 1
    assert factor([0, 1, 1], [True, True, True]) == 1.0 + 0.035 * 2
    assert factor([0, 2, 1], [True, True, False]) == 1.0 + 0.06 * 2   # rank 64: the 32 tier; b not scheduled


def _settings_error(tmp_path, text: str, **flags) -> str:
    path = tmp_path / "lora.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        resolve_lora(LoraSettings(config=path, **flags))
    return str(e.value)


def test_bad_configurations_name_the_field(tmp_path):
    one = "  adapters: [{id: a, rank: 8}]\n"
    assert "rank" in _settings_error(tmp_path, "lora:\n  adapter_capacity: 1\n  adapters: [{id: a, rank: 0}]\n")
    assert "adapter_capacity 0" in _settings_error(tmp_path, "lora:\n  adapter_capacity: 0\n" + one)
    assert "no adapter capacity" in _settings_error(tmp_path, "lora:\n" + one)
    assert "twice" in _settings_error(tmp_path, "lora:\n  adapter_capacity: 1\n"
                                                "  adapters: [{id: a, rank: 8}, {id: a, rank: 16}]\n")
    assert "lora.capacity" in _settings_error(tmp_path, "lora:\n  capacity: 1\n" + one)
    assert "load_bandwidth_bytes_us" in _settings_error(tmp_path, "lora:\n  adapter_capacity: 1\n"
                                                                  "  load_bandwidth_bytes_us: 0\n" + one)
    with pytest.raises(ConfigError, match="adapter_capacity"):
        LoraSettings(adapter_capacity=0)
    with pytest.raises(ConfigError, match="no such file"):
        resolve_lora(LoraSettings(config=tmp_path / "missing.yaml"))
    cfg = lora.LoraConfig(adapters=(("a", 8),), capacity=1)
    with pytest.raises(ConfigError, match="'zz' is not in the LoRA registry"):
        cfg.adapter_index(["a", "", "zz"])
    assert cfg.adapter_index(["a", "", "a"]).tolist() == [0, -1, 0]
    assert resolve_lora(LoraSettings()) is None   # no registry: inert


def test_cli_names_the_flag(tmp_path):
    err = io.StringIO()
    rc = main(["run", "--num-requests", "1", "--lora-config", str(tmp_path / "none.yaml")], stdout=io.StringIO(),
              stderr=err)
    assert rc == 2 and "error: --lora-config" in err.getvalue() and "Traceback" not in err.getvalue()
    (tmp_path / "l.yaml").write_text("lora:\n  adapter_capacity: 2\n  adapters: [{id: a, rank: 8}]\n")
    err = io.StringIO()
    rc = main(["run", "--num-requests", "1", "--lora-config", str(tmp_path / "l.yaml"), "--lora-adapter-capacity",
               "0"], stdout=io.StringIO(), stderr=err)
    assert rc == 2 and "error: --lora-adapter-capacity 0" in err.getvalue()


# ------------------------------------------------------------------------ resident-set invariants


def _lora_scenario():
    n = 48
    rng = np.random.default_rng(3)
    requests = make_request_set(request_id=np.arange(n), arrival_us=np.cumsum(rng.integers(2_000, 40_000, n)),
                                input_len=rng.integers(20, 200, n), output_len=rng.integers(1, 40, n))
    adapters = rng.integers(-1, 4, n).astype(np.int32)   # 4 adapters and the base model on 2 slots
    cfg = lora.LoraConfig(adapters=(("a", 8), ("b", 16), ("c", 32), ("d", 64)), capacity=2)
    settings = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "total_kv_blocks": 400}
    params = dataclasses.replace(params_from(settings), lora=lora.lora_params(cfg, 4))
    dims = sim.with_lora(sim.choose_dims(input_len=requests.input_len, output_len=requests.output_len,
                                         prefix_group=requests.prefix_group, prefix_len=requests.prefix_len,
                                         max_num_seqs=8, max_num_batched_tokens=256, total_kv_blocks=400,
                                         block_size=16), cfg)
    return requests, adapters, cfg, params, dims


@pytest.mark.slow   # compiles a LoRA engine program of its own (~20 s on 2 cores)
def test_resident_adapters_never_exceed_capacity():
    requests, adapters, cfg, params, dims = _lora_scenario()
    req = sim.request_arrays(requests, dims, adapters=adapters)
    model = latency_model()
    state = sim.start(dims, params, req, model)
    step = jax.jit(lambda s, limit: sim.run_until(dims, s, params, req, model, limit))
    n, limit, loads_seen = len(requests), 0, 0
    while True:
        limit += 7
        state = step(state, jnp.int64(limit))
        s = jax.device_get(state)
        occupied = s.lora_slot >= 0
        assert occupied.sum() <= cfg.capacity                                   # INV-L2
        assert np.all(s.lora_pins >= 0)
        # every cold load either filled a free slot or evicted one (L3: one load per transition)
        assert int(s.lora_loads.sum()) - int(s.lora_evictions.sum()) == int(occupied.sum())
        assert int(s.lora_loads.sum()) >= loads_seen
        loads_seen = int(s.lora_loads.sum())
        # L5: the adapter of every running request is loaded, and pinned
        _, slot, r = sim.in_flight(s, n)
        running = r[np.asarray(s.win_status)[slot] == RUNNING]
        for a in adapters[running]:
            if a >= 0:
                assert np.any((s.lora_slot == a) & s.lora_ready) and s.lora_pins[a] > 0
        queued = r[np.asarray(s.win_status)[slot] == QUEUED]
        assert len(queued) == int(s.wait_len)
        if bool(sim.finished(state, params, req)):
            break
    out = sim.to_output(state, dims, params, requests, int(state.result))
    assert out.completed_mask().all()
    assert np.all(jax.device_get(state.lora_pins) == 0)
    assert loads_seen >= 4   # 4 adapters through 2 slots: cold loads and evictions happened
    # an idle instance's first request waits its queueing delay plus its adapter's cold load
    first = int(np.argmin(requests.arrival_us))
    if adapters[first] >= 0:
        load = cfg.load_time_us(cfg.adapters[adapters[first]][1])
        assert out.sched_delay_us[first] == int(sim.latency.queueing_time_us(model, requests.input_len[first])) + load
