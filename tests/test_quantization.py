"""Weight-precision detection chain (spec latency-models §3.3)."""

import json

import pytest

from blis_jax.config.model import arch_from_hf_config
from blis_jax.config.quantization import (
    detect_weight_bytes,
    dtype_bytes,
    name_convention_bytes,
    quantization_config_bytes,
)
from blis_jax.errors import ConfigError

from shared_data import BLIS_REF, needs  # noqa: E402

SCOUT = BLIS_REF / "model_configs/llama-4-scout-17b-16e-instruct-fp8-dynamic/config.json"

BASE = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "torch_dtype": "bfloat16",
}


def _ct(groups):
    return {"quant_method": "compressed-tensors", "config_groups": groups}


@pytest.mark.parametrize(
    "qc, expected",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, 0.5),  # GPTQ
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, 0.5),  # AWQ
        ({"quant_method": "gptq", "bits": "4"}, 0.5),  # numeric string
        ({"quant_method": "gptq", "bits": 8}, 1.0),
        ({"quant_method": "FP8", "activation_scheme": "dynamic"}, 1.0),  # case-insensitive
        ({"quant_method": "fp8"}, 1.0),
        (_ct({"group_0": {"weights": {"num_bits": 4}}}), 0.5),
        # sorted keys: group_0 (weights null → skipped) before group_1
        (_ct({"group_1": {"weights": {"num_bits": 8}}, "group_0": {"weights": None}}), 1.0),
        (_ct({"b": {"weights": {"num_bits": 8}}, "a": {"weights": {"num_bits": 4}}}), 0.5),
        ({"quant_method": "bitsandbytes"}, 0.0),  # says nothing: fall through
        (None, 0.0),
    ],
)
def test_quantization_config_rule(qc, expected):
    assert quantization_config_bytes(qc) == expected


@needs(SCOUT, "Scout reference config")
def test_compressed_tensors_scout_config_is_one_byte():
    config = json.loads(SCOUT.read_text())
    w, source = detect_weight_bytes(config, "some-unrelated-name")
    assert w == 1.0
    assert "config_groups.group_0.weights.num_bits" in source


@pytest.mark.parametrize(
    "name, expected",
    [
        ("RedHatAI/Llama-3.3-70B-Instruct-quantized.w4a16", 0.5),
        ("RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8", 1.0),
        ("redhatai/phi-4-quantized.w8a8", 1.0),
        ("org/model_w4a16_extra", 0.5),
        ("RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic", 1.0),
        ("RedHatAI/phi-4-FP8", 1.0),
        ("org/w4a16", 0.5),  # bounded by "/" and the string end
        ("org/modelw4a16", 0.0),  # not a bounded token
        ("org/model-fp8x", 0.0),
        ("org/model-fp16", 0.0),
        ("meta-llama/Llama-3.1-8B-Instruct", 0.0),
        ("", 0.0),
    ],
)
def test_name_convention(name, expected):
    assert name_convention_bytes(name) == expected


def test_chain_order_quant_config_then_name_then_dtype():
    gptq = dict(BASE, quantization_config={"quant_method": "gptq", "bits": 4})
    assert detect_weight_bytes(gptq, "org/model-fp8")[0] == 0.5  # rule 1 beats the name
    assert detect_weight_bytes(BASE, "org/model-w4a16")[0] == 0.5  # rule 2
    assert detect_weight_bytes(BASE, "org/model-FP8-dynamic")[0] == 1.0
    w, source = detect_weight_bytes(BASE, "org/plain-model")  # rule 3
    assert (w, source) == (2.0, "torch_dtype bfloat16")
    assert detect_weight_bytes(dict(BASE, torch_dtype="float32"), "m")[0] == 4.0
    no_torch = {k: v for k, v in BASE.items() if k != "torch_dtype"}
    assert detect_weight_bytes(dict(no_torch, dtype="float16"), "m")[0] == 2.0  # `dtype` key


def test_dtype_bytes_table():
    assert [dtype_bytes(x) for x in ("float32", "float16", "bfloat16", "int8", "fp8", "int4")] == [
        4.0,
        2.0,
        2.0,
        1.0,
        1.0,
        1.0,
    ]
    assert dtype_bytes("torch.bfloat16") == 2.0
    assert dtype_bytes("complex64") == 0.0


def test_arch_weight_vs_activation_bytes():
    arch = arch_from_hf_config(
        dict(BASE, quantization_config={"quant_method": "awq", "bits": 4}), "org/m"
    )
    assert arch.weight_bytes_per_param == 0.5
    assert arch.bytes_per_param == 2.0  # KV and activations keep torch_dtype


@pytest.mark.parametrize(
    "qc, field",
    [
        ({"quant_method": "gptq", "bits": "four"}, "quantization_config.bits"),
        ({"quant_method": "gptq", "bits": -4}, "quantization_config.bits"),
        ({"quant_method": "gptq", "bits": True}, "quantization_config.bits"),
        ({"quant_method": "compressed-tensors"}, "config_groups"),
        (_ct({}), "config_groups"),
        (_ct({"group_0": {"targets": ["Linear"]}}), "config_groups.group_0.weights"),
        (_ct({"group_0": {"weights": {"type": "float"}}}), "group_0.weights.num_bits"),
        (_ct({"group_0": {"weights": {"num_bits": "eight"}}}), "group_0.weights.num_bits"),
        ({"quant_method": 8}, "quant_method"),
        ("fp8", "quantization_config"),
    ],
)
def test_malformed_quantization_config(qc, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        detect_weight_bytes(dict(BASE, quantization_config=qc), "org/bad-model")
    assert "org/bad-model" in str(err.value)


def test_unknown_or_missing_dtype_is_an_error():
    with pytest.raises(ConfigError, match="torch_dtype = 'complex64' is not a known dtype"):
        detect_weight_bytes(dict(BASE, torch_dtype="complex64"), "m")
    no_dtype = {k: v for k, v in BASE.items() if k != "torch_dtype"}
    with pytest.raises(ConfigError, match="torch_dtype .* is missing"):
        arch_from_hf_config(no_dtype, "m")
