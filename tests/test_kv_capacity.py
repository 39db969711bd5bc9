"""KV-capacity auto-sizing and max-model-len (spec latency-models §3.1-§3.4, features §2.14)."""

import dataclasses
import json

import pytest

from blis_jax.config import (
    GPUSpec,
    auto_kv_blocks,
    auto_max_model_len,
    load_gpu,
    load_model,
    model_weight_bytes,
)
from blis_jax.config.lora_config import resolve_lora
from blis_jax.errors import ConfigError
from blis_jax.scenario import LoraSettings

from shared_data import BLIS_DIFF, needs_blis_diff  # noqa: E402
GIB = 2**30


# spec latency-models §3.4 (H100, utilisation 0.9, block 16): blocks and weights (GiB).
@pytest.mark.parametrize(
    "model, tp, blocks, weights_gib",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", 1, 26312, 14.96),
        ("meta-llama/Llama-2-7b-hf", 1, 6886, 12.55),
        ("Qwen/Qwen2.5-7B-Instruct", 1, 61048, 14.18),
        ("mistralai/Mistral-Nemo-Instruct-2407", 1, 17512, 23.59),
        ("01-ai/Yi-34B", 2, 40001, 64.05),
        ("meta-llama/Llama-3.1-70B-Instruct", 4, 121801, 131.42),
        ("meta-llama/Llama-2-70b-hf", 4, 124207, 128.48),
        ("codellama/CodeLlama-34b-Instruct-hf", 2, 50822, 62.85),
        ("mistralai/Mixtral-8x7B-v0.1", 2, 48956, 86.99),
    ],
)
def test_spec_capacity_table(model, tp, blocks, weights_gib):
    arch = load_model(model)
    assert auto_kv_blocks(arch, load_gpu("H100"), tp) == blocks
    assert round(model_weight_bytes(arch) / GIB, 2) == weights_gib


def test_reference_unit_test_convention_tp2_tp4():
    # BLIS kv_capacity_test.go "empirical" Llama-3.1-8B values (spec §3.4). They reproduce
    # with zero activation and non-torch reservations, i.e. the test's own overhead settings.
    arch, h100 = load_model("meta-llama/Llama-3.1-8B-Instruct"), load_gpu("H100")
    kw = dict(activation_gib=0.0, non_torch_gib=0.0)
    assert auto_kv_blocks(arch, h100, 2, **kw) == 132139
    assert auto_kv_blocks(arch, h100, 4, **kw) == 559190


def _auto_cases():
    if not BLIS_DIFF.is_dir():
        return []
    cases = []
    for path in sorted(BLIS_DIFF.glob("*/case.json")):
        case = json.loads(path.read_text())
        if case["total_kv_blocks_source"].startswith("auto"):
            case = {**case, "folder": path.parent}
            cases.append(pytest.param(case, id=case["id"]))
    return cases


@needs_blis_diff
@pytest.mark.parametrize("case", _auto_cases())
def test_blis_diff_auto_capacity(case):
    # Every auto-sized case of the BLIS differential set: blocks and derived max-model-len.
    arch = load_model(case["model"])
    other = case.get("other_flags", {})
    # LoRA reserves HBM for its adapters (capacity x footprint x max rank) before the KV cache is sized
    lora = resolve_lora(LoraSettings(config=case["folder"] / other["lora_config"],
                                     adapter_capacity=other.get("lora_adapter_capacity"))) \
        if "lora_config" in other else None
    blocks = auto_kv_blocks(
        arch, load_gpu(case["hardware"]), case["tp"], block_size=case["block_size"],
        lora_reserve_gib=lora.reservation_gib if lora else 0.0,
    )
    assert blocks == case["total_kv_blocks"]
    if case["max_model_len_source"].startswith("auto"):
        assert auto_max_model_len(arch, blocks, case["block_size"]) == case["max_model_len"]


def test_blocks_grow_about_tp_squared():
    # Memory is multiplied by TP while per-block bytes are already per GPU (spec §3.4).
    arch, h100 = load_model("meta-llama/Llama-3.1-8B-Instruct"), load_gpu("H100")
    b1, b2 = auto_kv_blocks(arch, h100, 1), auto_kv_blocks(arch, h100, 2)
    assert 4 * b1 < b2 < 5 * b1


def test_mla_and_moe_dp():
    ds, h100 = load_model("deepseek-ai/DeepSeek-V2-Lite"), load_gpu("H100")
    # MLA: per-token bytes L·(kv_lora_rank + rope)·b, not divided by TP.
    from blis_jax.config import kv_bytes_per_token

    assert kv_bytes_per_token(ds, 1) == kv_bytes_per_token(ds, 4) == 27 * (512 + 64) * 2
    mixtral = load_model("mistralai/Mixtral-8x7B-v0.1")
    assert auto_kv_blocks(mixtral, h100, 2, dp=2) == 2 * auto_kv_blocks(mixtral, h100, 2)
    llama = load_model("meta-llama/Llama-3.1-8B-Instruct")
    assert auto_kv_blocks(llama, h100, 1, dp=2) == auto_kv_blocks(llama, h100, 1)  # dense


def test_does_not_fit_reports_minimum_tp():
    # Llama-3.1-70B: 131.42 GiB of weights > 72 GiB at TP1; TP2 has 144 GiB.
    with pytest.raises(ConfigError, match=r"tp >= 2"):
        auto_kv_blocks(load_model("meta-llama/Llama-3.1-70B-Instruct"), load_gpu("H100"), 1)
    with pytest.raises(
        ConfigError, match=r"tp >= 4"
    ):  # 48 GiB L40S: 86.4 GiB < 138.1 GiB needed at TP2
        auto_kv_blocks(load_model("meta-llama/Llama-3.1-70B-Instruct"), load_gpu("L40S"), 2)


def test_capacity_errors():
    h100 = load_gpu("H100")
    llama = load_model("meta-llama/Llama-3.1-8B-Instruct")
    no_mem = dataclasses.replace(h100, memory_gib=None)
    with pytest.raises(ConfigError, match="memory_gib"):
        auto_kv_blocks(llama, no_mem, 1)
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        auto_kv_blocks(dataclasses.replace(llama, hidden_act="gelu"), h100, 1)
    with pytest.raises(ConfigError, match="vocab_size"):
        auto_kv_blocks(dataclasses.replace(llama, vocab_size=0), h100, 1)
    with pytest.raises(ConfigError, match="intermediate_size"):
        auto_kv_blocks(dataclasses.replace(llama, intermediate_size=0), h100, 1)
    with pytest.raises(ConfigError, match="total expert count"):
        auto_kv_blocks(dataclasses.replace(llama, num_experts_per_tok=2), h100, 1)
    with pytest.raises(ConfigError, match="not divisible by tp 3"):
        auto_kv_blocks(llama, h100, 3)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        auto_kv_blocks(llama, h100, 1, gpu_memory_utilization=1.5)
    assert isinstance(h100, GPUSpec)


def test_max_model_len_rules():
    llama = load_model("meta-llama/Llama-3.1-8B-Instruct")  # no rope_scaling
    assert auto_max_model_len(llama, 26312) == 131072
    assert auto_max_model_len(llama, 1200) == 19200  # capped at blocks × block size
    l70 = load_model("meta-llama/Llama-3.1-70B-Instruct")  # llama3 rope: not scaled
    assert auto_max_model_len(l70, 10**6) == 131072
    ds = load_model("deepseek-ai/DeepSeek-V2-Lite")  # yarn: original 4096 × 40
    assert auto_max_model_len(ds, 10**6) == 4096 * 40
    linear = dataclasses.replace(
        llama, max_position_embeddings=4096, rope_scaling_type="linear", rope_scaling_factor=2.0
    )
    assert auto_max_model_len(linear, 10**6) == 8192
    for unscaled in ("su", "longrope", "llama3"):
        assert (
            auto_max_model_len(dataclasses.replace(linear, rope_scaling_type=unscaled), 10**6)
            == 4096
        )
    gemma3 = dataclasses.replace(linear, model_type="gemma3")
    assert auto_max_model_len(gemma3, 10**6) == 4096
    assert auto_max_model_len(linear, 10**6, block_size=32) == 8192
    assert auto_max_model_len(linear, 100, block_size=32) == 3200
