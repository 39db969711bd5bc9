"""Weight-precision detection: bytes per weight parameter (spec latency-models §3.3).

The chain, first nonzero answer wins:

1. ``quantization_config``: ``bits`` (number or numeric string) → bits/8; ``quant_method``
   ``fp8`` (any case) → 1.0; ``compressed-tensors`` → first group (sorted keys) whose
   ``weights.num_bits`` > 0 → num_bits/8.
2. model-name convention: a ``wXaY`` token bounded by ``. - _ /`` or the string ends → X/8,
   else an ``fp8`` token → 1.0.
3. ``torch_dtype`` (or ``dtype``) bytes.

Pure Python, no jax.
"""

import math
import re
from collections.abc import Mapping
from typing import Any

from blis_jax.errors import ConfigError

# torch dtype name → bytes per element. int4/nf4 count as 1 byte, as in the reference.
_DTYPE_BYTES = {
    "float32": 4.0,
    "fp32": 4.0,
    "float": 4.0,
    "float16": 2.0,
    "fp16": 2.0,
    "half": 2.0,
    "bfloat16": 2.0,
    "bf16": 2.0,
    "int8": 1.0,
    "uint8": 1.0,
    "fp8": 1.0,
    "float8_e4m3fn": 1.0,
    "float8_e5m2": 1.0,
    "int4": 1.0,
    "nf4": 1.0,
}

# Separators that bound a name token; the token may also start or end the string.
_SEP = r"[._/\-]"
_WA_TOKEN = re.compile(rf"(?:^|{_SEP})w(\d+)a(\d+)(?={_SEP}|$)")
_FP8_TOKEN = re.compile(rf"(?:^|{_SEP})fp8(?={_SEP}|$)")


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element of a torch dtype name (``"torch.bfloat16"`` allowed); 0.0 if unknown."""
    if not isinstance(dtype, str):
        return 0.0
    name = dtype.strip().lower().removeprefix("torch.")
    return _DTYPE_BYTES.get(name, 0.0)


def _positive_number(value: Any, field: str, model: str) -> float:
    """A finite number >= 0 from a JSON number or numeric string, else ConfigError."""
    if isinstance(value, bool):
        value = None  # true/false is not a bit count
    elif isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            value = None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"model {model!r}: {field} = {value!r} is not a bit count; "
            f'set it to a number such as 4 or 8 (a numeric string like "4" is accepted)'
        )
    return float(value)


def quantization_config_bytes(qc: Any, model: str = "<config>") -> float:
    """Rule 1: bytes/param from a HF ``quantization_config``; 0.0 when it says nothing.

    Raises ConfigError naming the field for malformed content.
    """
    return _quantization_config_rule(qc, model)[0]


def _quantization_config_rule(qc: Any, model: str) -> tuple[float, str]:
    """Rule 1 with the name of the field that decided."""
    if qc is None:
        return 0.0, ""
    if not isinstance(qc, Mapping):
        raise ConfigError(
            f"model {model!r}: quantization_config must be a JSON object, got {type(qc).__name__}"
        )
    if "bits" in qc and qc["bits"] is not None:
        bits = _positive_number(qc["bits"], "quantization_config.bits", model)
        if bits > 0:
            return bits / 8.0, f"quantization_config.bits={qc['bits']!r}"
    method = qc.get("quant_method")
    if method is not None and not isinstance(method, str):
        raise ConfigError(
            f"model {model!r}: quantization_config.quant_method = {method!r} must be a string"
        )
    method = (method or "").lower()
    if method == "fp8":
        return 1.0, f"quantization_config.quant_method={qc['quant_method']!r}"
    if method == "compressed-tensors":
        return _compressed_tensors_bytes(qc, model)
    return 0.0, ""


def _compressed_tensors_bytes(qc: Mapping, model: str) -> tuple[float, str]:
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ConfigError(
            f"model {model!r}: quantization_config.config_groups is missing or empty; "
            "compressed-tensors configs need at least one group with weights.num_bits"
        )
    for key in sorted(groups):
        group = groups[key]
        where = f"quantization_config.config_groups.{key}"
        if not isinstance(group, Mapping):
            raise ConfigError(f"model {model!r}: {where} must be a JSON object")
        if "weights" not in group:
            raise ConfigError(
                f"model {model!r}: {where}.weights is missing; add a weights block "
                "with num_bits (or weights: null for an activation-only group)"
            )
        weights = group["weights"]
        if weights is None:
            continue  # activation-only group: says nothing about weight precision
        if not isinstance(weights, Mapping) or "num_bits" not in weights:
            raise ConfigError(
                f"model {model!r}: {where}.weights.num_bits is missing; "
                "set it to the weight bit width (e.g. 8)"
            )
        bits = _positive_number(weights["num_bits"], f"{where}.weights.num_bits", model)
        if bits > 0:
            return (
                bits / 8.0,
                f"{where}.weights.num_bits={weights['num_bits']!r} (compressed-tensors)",
            )
    return 0.0, ""


def name_convention_bytes(name: str | None) -> float:
    """Rule 2: bytes/param from a model name (``w4a16`` → 0.5, ``fp8`` → 1.0); 0.0 if none."""
    if not name:
        return 0.0
    lowered = name.lower()
    match = _WA_TOKEN.search(lowered)
    if match and int(match.group(1)) > 0:
        return int(match.group(1)) / 8.0
    if _FP8_TOKEN.search(lowered):
        return 1.0
    return 0.0


def detect_weight_bytes(config: Mapping, name: str | None = None) -> tuple[float, str]:
    """Run the full chain on a (text_config-merged) HF config.

    Returns ``(weight_bytes_per_param, source)`` where ``source`` says which rule decided.
    Raises ConfigError if nothing yields a precision (unknown or missing dtype).
    """
    model = name or "<config>"
    from_qc, detail = _quantization_config_rule(config.get("quantization_config"), model)
    if from_qc > 0:
        return from_qc, detail
    from_name = name_convention_bytes(name)
    if from_name > 0:
        return from_name, f"model-name convention ({name})"
    dtype_key, dtype = torch_dtype_of(config)
    b = dtype_bytes(dtype)
    if b <= 0:
        raise ConfigError(_dtype_message(model, dtype_key, dtype))
    return b, f"{dtype_key} {dtype}"


def torch_dtype_of(config: Mapping) -> tuple[str, Any]:
    """The (key, value) of the activation dtype: ``torch_dtype``, else ``dtype``."""
    if config.get("torch_dtype") is not None:
        return "torch_dtype", config["torch_dtype"]
    return "dtype", config.get("dtype")


def activation_bytes(config: Mapping, name: str | None = None) -> float:
    """Bytes per element of activations and KV (``torch_dtype``); ConfigError if unknown."""
    dtype_key, dtype = torch_dtype_of(config)
    b = dtype_bytes(dtype)
    if b <= 0:
        raise ConfigError(_dtype_message(name or "<config>", dtype_key, dtype))
    return b


def _dtype_message(model: str, key: str, dtype: Any) -> str:
    if dtype is None:
        return (
            f"model {model!r}: torch_dtype (or dtype) is missing; add e.g. "
            '"torch_dtype": "bfloat16" to the config'
        )
    known = ", ".join(sorted(_DTYPE_BYTES))
    return f"model {model!r}: {key} = {dtype!r} is not a known dtype; use one of: {known}"
