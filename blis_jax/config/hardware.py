"""GPU figures (`GPUSpec`) and their YAML files (``configs/hardware/<NAME>.yaml``).

A GPU is added by writing a YAML file with the keys of `GPUSpec` and passing its path to
`load_gpu`, or by dropping it into ``configs/hardware/``. Pure Python, no jax.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from blis_jax.config.bundled import bundled_dir
from blis_jax.config.yaml_files import read_yaml_file
from blis_jax.io_safety import short
from blis_jax.errors import ConfigError

HARDWARE_DIR = bundled_dir("hardware")

# field → (must be > 0, fix hint). tflops_fp8 may be 0: "this GPU has no FP8 rate".
_FIELDS = {
    "tflops_peak": (True, "dense BF16/FP16 peak in TFLOP/s, e.g. 989.5 for H100"),
    "tflops_fp8": (False, "FP8 peak in TFLOP/s, or 0 if the GPU has no FP8 rate"),
    "hbm_bandwidth_tbs": (True, "peak HBM bandwidth in TB/s, e.g. 3.35 for H100"),
    "mfu_prefill": (True, "roofline prefill MFU in (0, 1], e.g. 0.45"),
    "mfu_decode": (True, "roofline decode MFU in (0, 1], e.g. 0.30"),
    "memory_gib": (True, "GPU memory in GiB, e.g. 80; omit it to disable auto KV sizing"),
}


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU type. Validated on construction (ConfigError names GPU, field and fix)."""

    name: str
    tflops_peak: float  # TFLOP/s, dense BF16/FP16
    tflops_fp8: float  # TFLOP/s, 0 = no FP8 compute rate
    hbm_bandwidth_tbs: float  # TB/s
    mfu_prefill: float  # roofline only
    mfu_decode: float  # roofline only
    memory_gib: float | None = None  # None: auto KV-capacity sizing unavailable
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("GPU spec: field name must be a non-empty string")
        for field, (positive, hint) in _FIELDS.items():
            value = getattr(self, field)
            if field == "memory_gib" and value is None:
                continue
            object.__setattr__(self, field, _check_number(self.name, field, value, positive, hint))
        for field in ("mfu_prefill", "mfu_decode"):
            if getattr(self, field) > 1.0:
                raise ConfigError(
                    f"GPU {self.name!r}: field {field} = {getattr(self, field)} is above 1; "
                    f"set it to the {_FIELDS[field][1]}"
                )


def _check_number(gpu: str, field: str, value: Any, positive: bool, hint: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise ConfigError(
            f"GPU {gpu!r}: field {field} = {value!r} must be {need}; set it to the {hint}"
        )
    return value


def bundled_gpu_names() -> list[str]:
    """Names of the GPUs shipped in ``configs/hardware/``."""
    return sorted(_read_yaml(p)["name"] for p in HARDWARE_DIR.glob("*.yaml"))


def load_gpu(name_or_path: str | Path) -> GPUSpec:
    """A bundled GPU by name (case-insensitive), or a GPU YAML file by path."""
    path = Path(name_or_path)
    if path.suffix.lower() in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"GPU file {str(path)!r} does not exist")
        return gpu_from_dict(_read_yaml(path), where=str(path))
    wanted = str(name_or_path).lower()
    for candidate in HARDWARE_DIR.glob("*.yaml"):
        data = _read_yaml(candidate)
        if str(data.get("name", "")).lower() == wanted:
            return gpu_from_dict(data, where=str(candidate))
    if not str(name_or_path).strip():
        raise ConfigError("--hardware: empty GPU name; give a bundled GPU (e.g. H100) or a GPU YAML path")
    raise ConfigError(
        f"unknown GPU {short(str(name_or_path))}; bundled GPUs: {', '.join(bundled_gpu_names())}; "
        "or pass the path of a GPU YAML (keys: see configs/hardware/H100.yaml)"
    )


def gpu_from_dict(data: Any, where: str = "<dict>") -> GPUSpec:
    """Build a `GPUSpec` from a mapping in our YAML format (unknown keys are an error)."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"GPU file {where}: expected a mapping of fields, got {type(data).__name__}"
        )
    allowed = {f.name for f in dataclasses.fields(GPUSpec)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"GPU file {where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}"
        )
    required = [f for f in ("name", *_FIELDS) if f != "memory_gib"]
    missing = [f for f in required if f not in data]
    if missing:
        gpu = data.get("name", where)
        raise ConfigError(f"GPU {gpu!r} ({where}): missing field(s) {missing}")
    return GPUSpec(**data)


def _read_yaml(path: Path) -> Any:
    try:
        return read_yaml_file(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"GPU file {path}: not valid YAML ({e})") from e
