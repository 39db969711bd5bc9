"""Per-instance deployments (blis_jax/cluster/deployments.py): PD pools on their own hardware
and TP (`--prefill-hardware`, `--prefill-tp`, `--decode-hardware`, `--decode-tp`,
`--prefill-max-model-len`, `--decode-max-model-len`; blis-features §3.10).

Fast checks of the stacking and of the CLI resolution. The simulations with pool deployments
(prefill-pool TP against the mirrored decode-pool TP, and a decode pool on other hardware
against a plain cluster of that hardware) are in test_cluster_pd_loop.py (`-m slow`, they
share E05's compiled program).
"""

from __future__ import annotations

import numpy as np
import pytest

from blis_jax.cli.app import build_parser, resolve_scenario
from blis_jax.cluster.deployments import PoolDeployment, lane_params, largest_kv_blocks, stack_deployments
from blis_jax.config import load_gpu, load_model
from blis_jax.config.kv_capacity import auto_kv_blocks, kv_bytes_per_token
from blis_jax.engine.params import make_engine_params
from blis_jax.errors import ConfigError
from blis_jax.latency import build_latency_model

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


class _Diag:
    def __init__(self):
        self.warnings = []

    def warn(self, text):
        self.warnings.append(text)


def pool(tp: int, hardware: str = "H100", blocks: int = 5000, mml: int = 4096, kind="trained-physics"):
    arch, gpu = load_model(LLAMA), load_gpu(hardware)
    return PoolDeployment(latency_model=build_latency_model(kind, arch, gpu, tp), total_kv_blocks=blocks,
                          max_model_len=mml, hardware=gpu.name, tp=tp, kv_bytes_per_token=kv_bytes_per_token(arch, tp))


def test_slots_take_their_pool_deployment():
    base = pool(1)
    params = make_engine_params(total_kv_blocks=3000, max_model_len=2048)
    prefill = np.array([True, True, False, False, False, False])
    decode = np.array([False, False, True, True, False, False])
    stacked = stack_deployments(base.latency_model, params, 6, prefill, decode,
                                prefill=pool(2, blocks=7000, mml=8192), decode=pool(4, "A100-80", blocks=9000, mml=1024))
    np.testing.assert_array_equal(np.asarray(stacked.model.tp), [2, 2, 4, 4, 1, 1])
    a100, h100 = load_gpu("A100-80"), load_gpu("H100")
    np.testing.assert_array_equal(np.asarray(stacked.model.bandwidth_tbs),
                                  [h100.hbm_bandwidth_tbs] * 2 + [a100.hbm_bandwidth_tbs] * 2
                                  + [h100.hbm_bandwidth_tbs] * 2)
    np.testing.assert_array_equal(np.asarray(stacked.total_kv_blocks), [7000, 7000, 9000, 9000, 3000, 3000])
    np.testing.assert_array_equal(np.asarray(stacked.max_model_len), [8192, 8192, 1024, 1024, 2048, 2048])
    assert largest_kv_blocks(params, pool(2, blocks=7000), None, pool(4, blocks=9000)) == 9000

    lanes = lane_params(params, stacked.total_kv_blocks, stacked.max_model_len)
    np.testing.assert_array_equal(np.asarray(lanes.total_kv_blocks), [7000, 7000, 9000, 9000, 3000, 3000])
    np.testing.assert_array_equal(np.asarray(lanes.max_num_seqs), [256] * 6)


def test_a_pool_without_a_deployment_runs_the_base_and_shared_slots_take_the_decode_one():
    base = pool(1)
    params = make_engine_params(total_kv_blocks=3000)
    both = np.array([False, True, False])  # slot 1 serves both roles
    stacked = stack_deployments(base.latency_model, params, 3, both, both | np.array([False, False, True]),
                                prefill=pool(2), decode=pool(4))
    np.testing.assert_array_equal(np.asarray(stacked.model.tp), [1, 4, 4])
    plain = stack_deployments(base.latency_model, params, 3, both, ~both)
    np.testing.assert_array_equal(np.asarray(plain.model.tp), [1, 1, 1])


def test_a_pool_with_another_latency_backend_runs_its_own_backend():
    """--decode-latency-model roofline beside a trained-physics cluster: one structure for all
    slots (`PerSlotKindModel`) that picks each slot's backend."""
    from blis_jax.latency.model import PerSlotKindModel

    stacked = stack_deployments(pool(1).latency_model, make_engine_params(total_kv_blocks=100), 2,
                                np.array([True, False]), np.array([False, True]), decode=pool(1, kind="roofline"))
    assert isinstance(stacked.model, PerSlotKindModel)
    assert np.asarray(stacked.model.roofline).tolist() == [False, True]


def resolve(*flags: str):
    diag = _Diag()
    return resolve_scenario(build_parser().parse_args(["run", "--model", LLAMA, "--hardware", "H100", "--tp", "1",
                                                       *flags]), diag, None)


PD = ("--num-instances", "4", "--prefill-instances", "2", "--decode-instances", "2", "--pd-decider", "always")


def test_cli_pool_flags_build_the_pool_deployment():
    arch = load_model(LLAMA)
    s = resolve(*PD, "--decode-hardware", "A100-80", "--decode-tp", "2")
    assert s.prefill_pool is None
    d = s.decode_pool
    assert (d.hardware, d.tp) == (load_gpu("A100-80").name, 2)
    assert d.total_kv_blocks == auto_kv_blocks(arch, load_gpu("A100-80"), 2)  # re-derived for the pool
    assert s.total_kv_blocks == auto_kv_blocks(arch, load_gpu("H100"), 1)
    assert float(d.latency_model.tp) == 2 and float(s.latency_model.tp) == 1
    assert d.kv_bytes_per_token == kv_bytes_per_token(arch, 2)

    explicit = resolve(*PD, "--prefill-tp", "2", "--total-kv-blocks", "4000", "--prefill-max-model-len", "8192")
    p = explicit.prefill_pool
    assert (p.tp, p.total_kv_blocks, p.max_model_len) == (2, 4000, 8192)  # an explicit block count is kept
    assert explicit.decode_pool is None


@pytest.mark.parametrize("flags, message", [
    (("--decode-tp", "2"), "--decode-hardware/--decode-tp/--decode-max-model-len/--decode-latency-model configure a "
                           "PD pool"),
    ((*PD, "--decode-tp", "3"), "--decode-tp / --decode-hardware / --decode-latency-model: .*not divisible by tp 3"),
    ((*PD, "--prefill-tp", "-1"), "--prefill-tp -1"),
    ((*PD, "--decode-hardware", "B999"), "B999"),
    ((*PD, "--total-kv-blocks", "100", "--decode-max-model-len", "4096"), "--decode-max-model-len 4096 needs 256"),
])
def test_cli_pool_flags_errors_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve(*flags)
