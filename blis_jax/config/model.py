"""Model architecture (`ModelArch`): every field the step-time and KV-capacity maths read.

Sources, all through `load_model`:

* a HuggingFace id (``org/name``, case-insensitive; like BLIS the lookup key is the
  lower-cased part after the slash) of a bundled ``configs/models/<key>.yaml``;
* a path to a HF ``config.json`` (or a directory holding one), parsed by
  `arch_from_hf_config`, the same function that generated the bundled YAML files;
* a path to one of our own model YAML files.

Pure Python, no jax.
"""

import dataclasses
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from blis_jax.config.bundled import bundled_dir
from blis_jax.config.quantization import activation_bytes, detect_weight_bytes, torch_dtype_of
from blis_jax.config.yaml_files import read_yaml_file
from blis_jax.io_safety import load_json_text, read_text, short, summarise
from blis_jax.errors import ConfigError

MODELS_DIR = bundled_dir("models")

# HF keys that may hold the total expert count, in lookup order (the first >= 2 wins).
_EXPERT_COUNT_KEYS = (
    "num_experts",
    "moe_num_experts",
    "n_routed_experts",
    "num_local_experts",
    "num_routed_experts",
)


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """Architecture figures of one model. Integers are counts; 0 means "absent"."""

    name: str  # lookup key: lower-cased part of hf_id after the slash
    hf_id: str  # org/name
    num_layers: int  # L
    hidden_size: int  # d
    num_heads: int  # H
    num_kv_heads: int  # H_kv (falls back to H)
    bytes_per_param: float  # b: activations and KV, from torch_dtype
    weight_bytes_per_param: float  # w: weights (quantisation-aware)
    head_dim: int = 0  # explicit head_dim; KV capacity only (step time uses d/H)
    intermediate_size: int = 0  # d_ff (0: roofline uses 4d, trained-physics refuses)
    moe_intermediate_size: int = 0  # per-expert FFN dim (0: d_ff, Mixtral convention)
    intermediate_size_mlp: int = 0  # dense-layer FFN dim of interleaved MoE (0: d_ff)
    num_experts: int = 0  # N, total routed experts (MoE iff >= 2)
    num_experts_per_tok: int = 0  # k
    shared_expert_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0  # KV capacity only
    interleave_moe_layer_step: int = 0  # q: every (q+1)-th layer is MoE
    kv_lora_rank: int = 0  # MLA latent rank (KV capacity only)
    qk_rope_head_dim: int = 0  # MLA rope dim (KV capacity only)
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    hidden_act: str = ""
    max_position_embeddings: int = 0
    rope_scaling_type: str = ""  # "" = no rope_scaling
    rope_scaling_factor: float = 0.0
    rope_original_max_position_embeddings: int = 0
    model_type: str = ""
    torch_dtype: str = ""
    quantization_source: str = ""  # which detection rule set weight_bytes_per_param
    source: str = ""  # provenance

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type is int:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
                need = "an integer >= 0"
            elif f.type is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and math.isfinite(value) and value >= 0
                need = "a finite number >= 0"
            elif f.type is bool:
                ok, need = isinstance(value, bool), "true or false"
            else:
                ok, need = isinstance(value, str), "a string"
            if not ok:
                raise ConfigError(f"model {self.name!r}: field {f.name} = {value!r} must be {need}")
            if f.type is float:
                object.__setattr__(self, f.name, float(value))
        required = ("num_layers", "hidden_size", "num_heads", "num_kv_heads")
        for field in required + ("bytes_per_param", "weight_bytes_per_param"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model {self.name!r}: field {field} must be > 0")
        # Fields the step-time and KV maths divide by (d / H, H / H_kv).
        if self.num_kv_heads > self.num_heads:
            raise ConfigError(f"model {self.name!r}: num_key_value_heads {self.num_kv_heads} is more than "
                              f"num_attention_heads {self.num_heads}; it must be at most that (and divide it)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model {self.name!r}: num_key_value_heads {self.num_kv_heads} does not divide "
                              f"num_attention_heads {self.num_heads}; each KV head serves a whole group")
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise ConfigError(f"model {self.name!r}: num_attention_heads {self.num_heads} does not divide "
                              f"hidden_size {self.hidden_size}; fix them or give head_dim")

    # Derived quantities (spec latency-models §0 notation).
    @property
    def is_moe(self) -> bool:
        return self.num_experts >= 2

    @property
    def is_interleaved_moe(self) -> bool:
        return self.is_moe and self.interleave_moe_layer_step > 0

    @property
    def num_moe_layers(self) -> int:
        if self.is_interleaved_moe:
            return self.num_layers // (self.interleave_moe_layer_step + 1)
        return self.num_layers if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def moe_ffn_dim(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def dense_ffn_dim(self) -> int:
        return self.intermediate_size_mlp or self.intermediate_size

    @property
    def shared_ffn_dim(self) -> int:
        if self.shared_expert_intermediate_size > 0:
            return self.shared_expert_intermediate_size
        return self.num_shared_experts * self.moe_ffn_dim

    @property
    def capacity_head_dim(self) -> int:
        """Head dim for KV capacity and weight bytes: explicit ``head_dim``, else d // H.
        (Step time ignores ``head_dim``.)"""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0


# ---------------------------------------------------------------------------------------
# HuggingFace config.json → ModelArch


def lookup_key(model_id: str) -> str:
    """BLIS's lookup key: the lower-cased part after the (last) slash."""
    return model_id.rsplit("/", 1)[-1].lower()


def merge_text_config(config: Mapping) -> dict:
    """Multimodal configs: ``text_config`` keys are merged over the top level."""
    merged = dict(config)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        merged.update(text)
    return merged


def arch_from_hf_config(
    config: Mapping, name: str, *, hf_id: str | None = None, source: str = ""
) -> ModelArch:
    """Parse a HF ``config.json`` dict. ``name`` (or ``hf_id``) also feeds the name-based
    quantisation fallback. Raises ConfigError naming the field for malformed content."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"model {name!r}: config must be a JSON object")
    hf_id = hf_id or name
    label = hf_id
    cfg = merge_text_config(config)

    def integer(key: str, required: bool = False) -> int:
        value = cfg.get(key)
        if value is None:
            if required:
                raise ConfigError(
                    f"model {label!r}: required field {key} is missing from the config"
                )
            return 0
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 2**53:
            raise ConfigError(f"model {label!r}: field {key} = {short(value)} must be an integer in [0, 2^53]")
        if required and value == 0:
            raise ConfigError(f"model {label!r}: field {key} must be > 0")
        return value

    def first_integer(*keys: str) -> int:
        for key in keys:
            if cfg.get(key) is not None:
                return integer(key)
        return 0

    num_heads = integer("num_attention_heads", required=True)
    num_experts = 0
    for key in _EXPERT_COUNT_KEYS:
        if cfg.get(key) is not None and integer(key) >= 2:
            num_experts = integer(key)
            break

    rope = cfg.get("rope_scaling")
    if rope is not None and not isinstance(rope, Mapping):
        raise ConfigError(f"model {label!r}: rope_scaling must be an object or null")
    rope = rope or {}
    rope_type = rope.get("rope_type", rope.get("type")) or ""
    factor = rope.get("factor") or 0.0
    if (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not math.isfinite(factor)
    ):
        raise ConfigError(f"model {label!r}: rope_scaling.factor = {factor!r} must be a number")
    original = rope.get("original_max_position_embeddings") or 0
    if not isinstance(original, int) or isinstance(original, bool):
        raise ConfigError(
            f"model {label!r}: rope_scaling.original_max_position_embeddings = {original!r} "
            "must be an integer"
        )

    hidden_act = cfg.get("hidden_act", cfg.get("hidden_activation")) or ""
    if not isinstance(hidden_act, str):
        raise ConfigError(f"model {label!r}: hidden_act = {hidden_act!r} must be a string")
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"model {label!r}: tie_word_embeddings = {tie!r} must be true or false")

    w, quant_source = detect_weight_bytes(cfg, label)
    return ModelArch(
        name=lookup_key(hf_id),
        hf_id=hf_id,
        num_layers=integer("num_hidden_layers", required=True),
        hidden_size=integer("hidden_size", required=True),
        num_heads=num_heads,
        num_kv_heads=first_integer("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
        or num_heads,
        bytes_per_param=activation_bytes(cfg, label),
        weight_bytes_per_param=w,
        head_dim=integer("head_dim"),
        intermediate_size=first_integer("intermediate_size", "ffn_hidden_size"),
        moe_intermediate_size=integer("moe_intermediate_size"),
        intermediate_size_mlp=integer("intermediate_size_mlp"),
        num_experts=num_experts,
        num_experts_per_tok=integer("num_experts_per_tok"),
        shared_expert_intermediate_size=integer("shared_expert_intermediate_size"),
        num_shared_experts=integer("n_shared_experts"),
        first_k_dense_replace=integer("first_k_dense_replace"),
        interleave_moe_layer_step=integer("interleave_moe_layer_step"),
        kv_lora_rank=integer("kv_lora_rank"),
        qk_rope_head_dim=integer("qk_rope_head_dim"),
        vocab_size=integer("vocab_size"),
        tie_word_embeddings=tie,
        hidden_act=hidden_act,
        max_position_embeddings=integer("max_position_embeddings"),
        rope_scaling_type=str(rope_type),
        rope_scaling_factor=float(factor),
        rope_original_max_position_embeddings=original,
        model_type=str(cfg.get("model_type") or ""),
        torch_dtype=str(torch_dtype_of(cfg)[1]),
        quantization_source=quant_source,
        source=source,
    )


# ---------------------------------------------------------------------------------------
# Our YAML format: the ModelArch fields, flat, minus the derived `name`.


def arch_to_dict(arch: ModelArch) -> dict:
    """The YAML mapping of a `ModelArch` (``name`` is derived from ``hf_id`` on load)."""
    data = dataclasses.asdict(arch)
    data.pop("name")
    head = {k: data.pop(k) for k in ("hf_id", "source")}
    return head | data


def arch_from_dict(data: Any, where: str = "<dict>") -> ModelArch:
    """Build a `ModelArch` from our YAML mapping; unknown or missing keys are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"model file {where}: expected a mapping of fields")
    fields = {f.name: f for f in dataclasses.fields(ModelArch)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"model file {where}: unknown field(s) {unknown}; allowed: {sorted(fields)}"
        )
    if "hf_id" not in data:
        raise ConfigError(f"model file {where}: missing field hf_id (org/name)")
    required = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and name not in ("name",)
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"model file {where}: missing field(s) {missing}")
    values = dict(data)
    values.setdefault("name", lookup_key(values["hf_id"]))
    if values.get("source") is None:
        values["source"] = ""
    return ModelArch(**values)


# ---------------------------------------------------------------------------------------
# Lookup


def bundled_model_ids() -> list[str]:
    """HF ids (org/name) of the models shipped in ``configs/models/``."""
    return list(_bundled_model_ids())


@functools.cache
def _bundled_model_ids() -> tuple[str, ...]:
    # read once per process: every `run` parser lists them in its help
    return tuple(sorted(_read_yaml(p)["hf_id"] for p in MODELS_DIR.glob("*.yaml")))


def load_model(id_or_path: str | Path, *, name: str | None = None) -> ModelArch:
    """A bundled model by HF id, or a HF ``config.json`` / directory / our YAML by path.

    ``name`` overrides the model name used for a ``config.json`` (defaults to its
    directory name); it matters for the name-based quantisation fallback.
    """
    path = Path(id_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model directory {str(id_or_path)!r} has no config.json")
    suffix = path.suffix.lower()
    if path.is_file() or suffix in (".json", ".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"model file {str(path)!r} does not exist")
        if suffix in (".yaml", ".yml"):
            return arch_from_dict(_read_yaml(path), where=str(path))
        return _load_hf_json(path, name)
    key = lookup_key(str(id_or_path))
    candidate = MODELS_DIR / f"{key}.yaml"
    if candidate.is_file():
        return arch_from_dict(_read_yaml(candidate), where=str(candidate))
    raise ConfigError(
        f"unknown model {short(str(id_or_path))}; "
        f"{summarise(bundled_model_ids(), 'bundled models', '`blis-jax models` lists them')}; "
        "or pass the path to a HF config.json or a blis-jax model YAML"
    )


def _load_hf_json(path: Path, name: str | None) -> ModelArch:
    config = load_json_text(read_text(path, f"model config {path}"), f"model config {path}")
    label = name or path.resolve().parent.name
    return arch_from_hf_config(config, label, source=f"HuggingFace config {path}")


def _read_yaml(path: Path) -> Any:
    try:
        return read_yaml_file(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"model file {path}: not valid YAML ({e})") from e
