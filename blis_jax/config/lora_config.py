"""`--lora-config` files and flags → `LoraConfig` (blis-features §3.12).

The file is YAML with a top-level `lora:` block: `adapter_capacity`, `load_base_latency_us`,
`load_bandwidth_bytes_us`, `footprint_bytes_per_rank`, `step_overhead_tiers` ({rank: {k6, k7}})
and `adapters` ([{id, rank, base_model}]). Cost values it leaves out take BLIS's defaults.yaml
values; a `--lora-*` flag (a `LoraSettings` field that is not None) overrides the file's value
(BLIS: flags win when set). Without adapters LoRA is inert (None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from blis_jax.engine.lora import (
    DEFAULT_FOOTPRINT_BYTES_PER_RANK,
    DEFAULT_LOAD_BANDWIDTH_BYTES_US,
    DEFAULT_LOAD_BASE_LATENCY_US,
    DEFAULT_STEP_OVERHEAD_TIERS,
    LoraConfig,
)
from blis_jax.errors import ConfigError
from blis_jax.naming import name

_KEYS = ("adapter_capacity", "load_base_latency_us", "load_bandwidth_bytes_us", "footprint_bytes_per_rank",
         "step_overhead_tiers", "adapters")


def _number(where: str, value, *, positive: bool) -> float:
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x) or (x <= 0 if positive else x < 0):
        raise ConfigError(f"{where} {value!r}: must be a finite number {'> 0' if positive else '>= 0'}")
    return x


def _int(where: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where} {value!r}: must be an integer >= {low}")
    return value


def _block(source) -> tuple[str, Mapping]:
    """(where, the `lora:` mapping) of a path or a mapping."""
    if isinstance(source, Mapping):
        where, raw = name("lora.config"), source
    else:
        import yaml

        where = f"{name('lora.config')} {source}"
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{where}: no such file; give the LoRA YAML (top-level `lora:`)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with a top-level `lora:` block")
    block = raw.get("lora", raw)
    if not isinstance(block, Mapping):
        raise ConfigError(f"{where}: `lora:` must be a mapping of {', '.join(_KEYS)}")
    unknown = sorted(set(map(str, block)) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key lora.{unknown[0]}; the keys are {', '.join(_KEYS)}")
    return where, block


def _adapters(where: str, raw) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: lora.adapters must be a list of {{id, rank}}")
    out, seen = [], set()
    for i, entry in enumerate(raw):
        at = f"{where}: lora.adapters[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str) or not entry["id"].strip():
            raise ConfigError(f"{at}: give an id (a non-empty string) and a rank")
        if entry["id"] in seen:
            raise ConfigError(f"{at}: id {entry['id']!r} appears twice; adapter ids must be unique")
        rank = entry.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ConfigError(f"{at}.rank {rank!r}: must be an integer > 0")
        seen.add(entry["id"])
        out.append((entry["id"], rank))
    return tuple(out)


def _tiers(where: str, raw) -> tuple[tuple[int, float, float], ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{where}: lora.step_overhead_tiers must map ranks to {{k6, k7}}, "
                          "e.g. 8: {k6: 0.02, k7: 1}")
    out = []
    for rank, tier in raw.items():
        try:
            r = int(rank)
        except (TypeError, ValueError):
            r = 0
        if r <= 0 or not isinstance(tier, Mapping):
            raise ConfigError(f"{where}: lora.step_overhead_tiers.{rank}: give a rank > 0 mapping to {{k6, k7}}")
        out.append((r, _number(f"{where}: lora.step_overhead_tiers.{rank}.k6", tier.get("k6", 0.0), positive=False),
                    _number(f"{where}: lora.step_overhead_tiers.{rank}.k7", tier.get("k7", 1.0), positive=False)))
    return tuple(sorted(out))


def resolve_lora(settings) -> LoraConfig | None:
    """The `LoraConfig` of a `LoraSettings` (file values, overridden by the fields set), or None
    when no adapters are configured."""
    where, block = _block(settings.config) if settings.config is not None else (name("lora.config"), {})
    adapters = _adapters(where, block["adapters"]) if "adapters" in block else ()
    if not adapters:
        return None
    flag_or_file = lambda key: (getattr(settings, key) if getattr(settings, key) is not None  # noqa: E731
                                else block.get(key))
    capacity = flag_or_file("adapter_capacity")
    if capacity is None:
        raise ConfigError(f"{where}: no adapter capacity; set lora.adapter_capacity or "
                          f"{name('lora.adapter_capacity')} (resident adapters per instance, >= 1)")
    at = name("lora.adapter_capacity") if settings.adapter_capacity is not None else f"{where}: lora.adapter_capacity"
    capacity = _int(at, capacity, 1)
    costs = {}
    for key, default, positive in (("load_base_latency_us", DEFAULT_LOAD_BASE_LATENCY_US, False),
                                   ("load_bandwidth_bytes_us", DEFAULT_LOAD_BANDWIDTH_BYTES_US, True),
                                   ("footprint_bytes_per_rank", DEFAULT_FOOTPRINT_BYTES_PER_RANK, True)):
        value = flag_or_file(key)
        at = name(f"lora.{key}") if getattr(settings, key) is not None else f"{where}: lora.{key}"
        costs[key] = default if value is None else _number(at, value, positive=positive)
    tiers = (_tiers(where, block["step_overhead_tiers"]) if "step_overhead_tiers" in block
             else tuple((r, k6, k7) for r, (k6, k7) in DEFAULT_STEP_OVERHEAD_TIERS.items()))
    return LoraConfig(adapters=adapters, capacity=capacity, step_overhead_tiers=tiers, **costs)
