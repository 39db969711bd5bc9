"""GPU, model and coefficient loading and validation."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from blis_jax.config import (
    Coefficients,
    GPUSpec,
    ModelArch,
    _import_hf,
    arch_from_hf_config,
    bundled_gpu_names,
    bundled_model_ids,
    load_coefficients,
    load_gpu,
    load_model,
)
from blis_jax.config import coefficients
from blis_jax.config.model import MODELS_DIR, arch_to_dict
from blis_jax.errors import ConfigError
from blis_jax.latency import build_latency_model

from shared_data import BLIS_REF as REF  # noqa: E402
from shared_data import needs_blis_ref as needs_ref  # noqa: E402

H100_FIELDS = dict(
    name="H100",
    tflops_peak=989.5,
    tflops_fp8=1979.0,
    hbm_bandwidth_tbs=3.35,
    mfu_prefill=0.45,
    mfu_decode=0.30,
    memory_gib=80.0,
)


# --------------------------------------------------------------------------- GPUs


def test_bundled_gpus_and_case_insensitive_lookup():
    assert bundled_gpu_names() == ["A100-80", "A100-SXM", "H100", "L40S"]
    h100 = load_gpu("h100")
    assert h100 == load_gpu("H100")
    # spec latency-models §4.1
    assert (h100.tflops_peak, h100.tflops_fp8, h100.hbm_bandwidth_tbs) == (989.5, 1979.0, 3.35)
    assert (h100.mfu_prefill, h100.mfu_decode, h100.memory_gib) == (0.45, 0.30, 80.0)
    assert load_gpu("a100-80").tflops_fp8 == 0.0  # no FP8 rate is allowed
    assert load_gpu("l40s").memory_gib == 48.0
    assert h100.source


@needs_ref
def test_bundled_gpu_figures_match_reference_table():
    table = json.loads((REF / "hardware_config.json").read_text())
    keys = {
        "TFlopsPeak": "tflops_peak",
        "TFlopsFP8": "tflops_fp8",
        "BwPeakTBs": "hbm_bandwidth_tbs",
        "mfuPrefill": "mfu_prefill",
        "mfuDecode": "mfu_decode",
        "MemoryGiB": "memory_gib",
    }
    assert sorted(table) == bundled_gpu_names()
    for name, entry in table.items():
        gpu = load_gpu(name)
        for ref_key, ours in keys.items():
            assert getattr(gpu, ours) == entry[ref_key], (name, ours)


def test_gpu_from_user_yaml(tmp_path):
    path = tmp_path / "my_gpu.yaml"
    path.write_text(yaml.safe_dump(dict(H100_FIELDS, name="B200-ish", tflops_peak=2250.0)))
    gpu = load_gpu(path)
    assert gpu.name == "B200-ish" and gpu.tflops_peak == 2250.0
    assert load_gpu(str(path)) == gpu


@pytest.mark.parametrize(
    "field, value",
    [
        ("tflops_peak", float("nan")),
        ("tflops_peak", 0.0),
        ("tflops_peak", -1.0),
        ("hbm_bandwidth_tbs", float("inf")),
        ("hbm_bandwidth_tbs", 0),
        ("tflops_fp8", -1.0),
        ("tflops_fp8", float("nan")),
        ("mfu_prefill", 0.0),
        ("mfu_decode", 1.5),
        ("memory_gib", -80.0),
        ("memory_gib", "eighty"),
    ],
)
def test_gpu_validation_names_gpu_and_field(field, value, tmp_path):
    with pytest.raises(ConfigError) as err:
        GPUSpec(**dict(H100_FIELDS, name="MyGPU", **{field: value}))
    message = str(err.value)
    assert "MyGPU" in message and field in message and "set it to" in message
    # Same through a user YAML file (YAML's .nan / .inf reach the same check).
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(dict(H100_FIELDS, name="MyGPU", **{field: value})))
    with pytest.raises(ConfigError, match=field):
        load_gpu(path)


def test_gpu_file_errors(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump({"name": "X", "tflops_peak": 1.0}))
    with pytest.raises(ConfigError, match="missing field"):
        load_gpu(path)
    path.write_text(yaml.safe_dump(dict(H100_FIELDS, tflops=1.0)))
    with pytest.raises(ConfigError, match="unknown field"):
        load_gpu(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_gpu(tmp_path / "nope.yaml")


def test_unknown_gpu_lists_available():
    with pytest.raises(ConfigError) as err:
        load_gpu("B300")
    message = str(err.value)
    assert "B300" in message
    for name in ("H100", "A100-SXM", "A100-80", "L40S"):
        assert name in message


# --------------------------------------------------------------------------- models

# spec latency-models §4.2: key → (L, d, H, H_kv, d_ff, vocab)
SPEC_MODELS = {
    "codellama-34b-instruct-hf": (48, 8192, 64, 8, 22016, 32000),
    "deepseek-v2-lite": (27, 2048, 16, 16, 10944, 102400),
    "glm-5.2-fp8": (78, 6144, 64, 64, 12288, 154880),
    "llama-2-7b-hf": (32, 4096, 32, 32, 11008, 32000),
    "llama-3.1-70b-instruct": (80, 8192, 64, 8, 28672, 128256),
    "llama-3.1-8b-instruct": (32, 4096, 32, 8, 14336, 128256),
    "llama-4-scout-17b-16e-instruct-fp8-dynamic": (48, 5120, 40, 8, 8192, 202048),
    "mistral-nemo-instruct-2407": (40, 5120, 32, 8, 14336, 131072),
    "mixtral-8x7b-v0.1": (32, 4096, 32, 8, 14336, 32000),
    "qwen2.5-7b-instruct": (28, 3584, 28, 4, 18944, 152064),
    "qwen3-14b": (40, 5120, 40, 8, 17408, 151936),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 6144, 151936),
    "yi-34b": (60, 7168, 56, 8, 20480, 64000),
}


def test_all_fourteen_architectures_bundled():
    ids = bundled_model_ids()
    assert len(ids) == 14
    assert all("/" in i for i in ids)
    keys = {i.split("/")[1].lower() for i in ids}
    assert keys == set(SPEC_MODELS) | {"llama-2-70b-hf"}


@pytest.mark.parametrize("key", sorted(SPEC_MODELS))
def test_bundled_architecture_figures(key):
    arch = load_model(key)
    got = (
        arch.num_layers,
        arch.hidden_size,
        arch.num_heads,
        arch.num_kv_heads,
        arch.intermediate_size,
        arch.vocab_size,
    )
    assert got == SPEC_MODELS[key]
    assert arch.hidden_act == "silu"
    assert arch.source


def test_moe_and_precision_fields():
    scout = load_model("RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic")
    assert (scout.num_experts, scout.num_experts_per_tok, scout.interleave_moe_layer_step) == (
        16,
        1,
        1,
    )
    assert (scout.num_moe_layers, scout.num_dense_layers) == (24, 24)
    assert (scout.moe_ffn_dim, scout.dense_ffn_dim, scout.head_dim) == (8192, 16384, 128)
    assert (scout.weight_bytes_per_param, scout.bytes_per_param) == (1.0, 2.0)
    ds = load_model("deepseek-ai/DeepSeek-V2-Lite")
    assert (ds.num_experts, ds.num_experts_per_tok, ds.moe_ffn_dim) == (64, 6, 1408)
    assert (ds.shared_ffn_dim, ds.first_k_dense_replace) == (2 * 1408, 1)
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.num_moe_layers) == (512, 64, 27)
    assert (ds.rope_scaling_type, ds.rope_scaling_factor) == ("yarn", 40.0)
    glm = load_model("zai-org/GLM-5.2-FP8")
    assert (glm.weight_bytes_per_param, glm.bytes_per_param, glm.num_experts) == (1.0, 2.0, 256)
    mixtral = load_model("mistralai/Mixtral-8x7B-v0.1")
    assert (mixtral.num_experts, mixtral.num_moe_layers, mixtral.moe_ffn_dim) == (8, 32, 14336)
    qwen_moe = load_model("Qwen/Qwen3-30B-A3B")
    assert (qwen_moe.num_experts, qwen_moe.moe_ffn_dim) == (128, 768)
    llama2 = load_model("meta-llama/Llama-2-7b-hf")
    assert (llama2.torch_dtype, llama2.bytes_per_param, llama2.is_moe) == ("float16", 2.0, False)


def test_model_lookup_is_case_insensitive_on_part_after_slash():
    a = load_model("meta-llama/llama-3.1-8b-instruct")
    assert a == load_model("Meta-Llama/Llama-3.1-8B-Instruct")
    assert a == load_model("llama-3.1-8b-instruct")
    assert a.hf_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert a.name == "llama-3.1-8b-instruct"


def test_hf_ids_use_known_orgs():
    ids = set(bundled_model_ids())
    for expected in (
        "meta-llama/Llama-3.1-8B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "mistralai/Mixtral-8x7B-v0.1",
        "01-ai/Yi-34B",
        "codellama/CodeLlama-34b-Instruct-hf",
        "deepseek-ai/DeepSeek-V2-Lite",
        "RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic",
    ):
        assert expected in ids
    assert any(i.startswith("zai-org/") for i in ids)


def test_unknown_model_summarises_bundled_ids_and_path_hint():
    with pytest.raises(ConfigError) as err:
        load_model("acme/Imaginary-9B")
    message = str(err.value)
    assert "acme/Imaginary-9B" in message
    assert f"{len(bundled_model_ids())} bundled models" in message and "`blis-jax models`" in message
    assert "config.json" in message and len(message) <= 200


@needs_ref
def test_load_from_config_json_path_and_directory():
    directory = REF / "model_configs" / "llama-3.1-8b-instruct"
    from_file = load_model(directory / "config.json")
    from_dir = load_model(directory)
    bundled = load_model("meta-llama/Llama-3.1-8B-Instruct")
    assert from_file == from_dir
    ignore = {"hf_id", "name", "source"}
    for f in dataclasses.fields(ModelArch):
        if f.name not in ignore:
            assert getattr(from_file, f.name) == getattr(bundled, f.name), f.name
    assert from_file.name == "llama-3.1-8b-instruct"


@needs_ref
def test_generator_reproduces_bundled_yaml(tmp_path):
    written = _import_hf.generate(REF, tmp_path)
    assert len(written) == 14
    for path in written:
        assert path.read_text() == (MODELS_DIR / path.name).read_text(), path.name


def test_own_yaml_round_trip(tmp_path):
    arch = load_model("Qwen/Qwen3-14B")
    path = tmp_path / "qwen.yaml"
    path.write_text(yaml.safe_dump(arch_to_dict(arch), sort_keys=False))
    assert load_model(path) == arch
    bad = arch_to_dict(arch) | {"num_layer": 3}
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="unknown field"):
        load_model(path)


def test_multimodal_text_config_merged():
    config = {
        "model_type": "llava",
        "torch_dtype": "bfloat16",
        "text_config": {
            "num_hidden_layers": 40,
            "hidden_size": 5120,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 131072,
        },
    }
    arch = arch_from_hf_config(config, "org/Pixel-12B")
    assert (arch.num_layers, arch.hidden_size, arch.num_kv_heads) == (40, 5120, 8)
    assert arch.bytes_per_param == 2.0


def test_kv_head_fallbacks():
    base = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "torch_dtype": "float16",
    }
    assert arch_from_hf_config(base, "m").num_kv_heads == 8  # falls back to H
    assert arch_from_hf_config(base | {"num_kv_heads": 4}, "m").num_kv_heads == 4
    assert arch_from_hf_config(base | {"multi_query_group_num": 2}, "m").num_kv_heads == 2
    assert arch_from_hf_config(base | {"ffn_hidden_size": 256}, "m").intermediate_size == 256
    # expert count: first key >= 2 wins; 1 expert is not MoE
    assert arch_from_hf_config(base | {"num_experts": 1}, "m").is_moe is False
    assert (
        arch_from_hf_config(base | {"num_experts": 1, "n_routed_experts": 4}, "m").num_experts == 4
    )


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers"),
        ({"intermediate_size": -5}, "intermediate_size"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ],
)
def test_malformed_model_config(change, field):
    config = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "intermediate_size": 14336,
        "torch_dtype": "bfloat16",
    }
    config = {k: v for k, v in (config | change).items() if v is not None}
    with pytest.raises(ConfigError, match=field) as err:
        arch_from_hf_config(config, "org/broken")
    assert "org/broken" in str(err.value)


def test_missing_model_paths(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(tmp_path)


# --------------------------------------------------------------------------- coefficients


def test_blis_coefficients_are_iter29():
    c = load_coefficients("iter29")
    # spec latency-models §2.3 / §2.4 (defaults.yaml iter29)
    assert c.alpha == (15563.199579, 777.3455, 45.907545)
    assert c.beta == (
        0.152128,
        0.0,
        1.36252915,
        0.752037,
        32.09546717,
        4.41684444,
        126.024825,
        481.8613888,
        0.0,
        1.94710771,
        0.752037,
    )
    assert "defaults.yaml" in c.provenance["source"]
    assert c.provenance["loss"]["reported_pct"] == 34.5675
    assert c.provenance["fitted"]
    assert Path(c.provenance["path"]) == coefficients.BLIS_FIT


@needs_ref
def test_blis_coefficients_match_reference_defaults():
    ref = yaml.safe_load((REF / "defaults.yaml").read_text())["trained_physics_coefficients"]
    c = load_coefficients(coefficients.BLIS_FIT)
    assert list(c.alpha) == ref["alpha_coeffs"] and list(c.beta) == ref["beta_coeffs"]


def test_the_default_is_the_open_loop_lag_fit_unless_the_environment_names_another(monkeypatch):
    monkeypatch.delenv(coefficients.DEFAULT_ENV_VAR, raising=False)
    default = load_coefficients()
    assert Path(default.provenance["path"]).name == "trained-physics-fit-trainval15-open-loop-lag.yaml"
    assert len(default.alpha) == 4 and default.alpha[3] > 0          # the first-token lag
    # a scenario without coefficients resolves the default, and follows the environment
    built = build_latency_model("trained-physics", load_model("meta-llama/llama-3.1-8b-instruct"), load_gpu("H100"))
    np.testing.assert_array_equal(np.asarray(built.alpha), default.alpha)
    monkeypatch.setenv(coefficients.DEFAULT_ENV_VAR, "iter29")
    built = build_latency_model("trained-physics", load_model("meta-llama/llama-3.1-8b-instruct"), load_gpu("H100"))
    np.testing.assert_array_equal(np.asarray(built.alpha), list(load_coefficients("iter29").alpha) + [0.0])
    monkeypatch.setenv(coefficients.DEFAULT_ENV_VAR, "iter30")
    with pytest.raises(ConfigError, match=r"\$BLIS_JAX_COEFFICIENTS: coefficient file 'iter30' does not exist; give "
                                          r"a coefficient YAML or a shipped name \(.*trained-physics-iter29"):
        load_coefficients()


def test_shipped_coefficients_by_name():
    for name in coefficients.shipped_names():
        assert load_coefficients(name).provenance["path"] == str(coefficients.FITS_DIR / f"{name}.yaml")
    assert load_coefficients("fit-trainval15-open-loop") == load_coefficients(
        coefficients.FITS_DIR / "trained-physics-fit-trainval15-open-loop.yaml")
    with pytest.raises(ConfigError, match=r"coefficient file 'nope.yaml' does not exist"):
        load_coefficients("nope.yaml")


def test_coefficient_file_validation(tmp_path):
    path = tmp_path / "fit.yaml"
    path.write_text("alpha: [1, 2, 3]\nbeta: [1, 2, 3, 4, 5, 6, 7]\nsource: test\n")
    c = load_coefficients(path)
    assert c.beta == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0) and c.provenance["source"] == "test"
    path.write_text("alpha: [1, 2, 3]\nbeta: [1, 2, 3, .nan, 5, 6, 7]\n")
    with pytest.raises(ConfigError, match=r"beta\[3\] = nan"):
        load_coefficients(path)
    path.write_text("alpha: [1, .inf, 3]\nbeta: [1, 2, 3, 4, 5, 6, 7]\n")
    with pytest.raises(ConfigError, match=r"alpha\[1\] = inf"):
        load_coefficients(path)
    path.write_text("alpha: [1, 2, 3]\nbeta: [1, 2, 3, 4, 5, 6]\n")
    with pytest.raises(ConfigError, match="7 to 11"):
        load_coefficients(path)
    path.write_text("alpha: [1, 2]\nbeta: [1, 2, 3, 4, 5, 6, 7]\n")
    with pytest.raises(ConfigError, match="give 3"):
        load_coefficients(path)
    path.write_text("alpha: [1, 2, 3, -0.5]\nbeta: [1, 2, 3, 4, 5, 6, 7]\n")
    with pytest.raises(ConfigError, match=r"alpha\[3\] = -0.5: the first-token lag"):
        load_coefficients(path)
    path.write_text("alpha: [1, 2, 3, 0.5]\nbeta: [1, 2, 3, 4, 5, 6, 7]\n")
    assert load_coefficients(path).alpha == (1.0, 2.0, 3.0, 0.5)
    path.write_text("beta: [1, 2, 3, 4, 5, 6, 7]\n")
    with pytest.raises(ConfigError, match="alpha"):
        load_coefficients(path)
    with pytest.raises(ConfigError, match=r"beta\[0\]"):
        Coefficients(alpha=(0, 0, 0), beta=(math.nan,) * 10)


def test_model_arch_validates_fields():
    llama = load_model("meta-llama/Llama-3.1-8B-Instruct")
    for field, value in [
        ("bytes_per_param", 0.0),
        ("weight_bytes_per_param", math.nan),
        ("num_layers", 0),
        ("vocab_size", -1),
        ("num_heads", 32.5),
        ("tie_word_embeddings", "yes"),
    ]:
        with pytest.raises(ConfigError, match=field):
            dataclasses.replace(llama, **{field: value})
