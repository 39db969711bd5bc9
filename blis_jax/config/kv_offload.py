"""BLIS's multi-tier KV offload configuration (`--kv-offload-config`, a TraceV2 header's
`kv_offload` block; blis-features §2.10): a CPU staging tier and `fs` secondary tiers, resolved to
the figures the engine simulates (engine/offload.py).

Parsing and validation of the YAML and of the header block live here; the engine takes only
the resolved `OffloadConfig`. Two forms are read:

* the `--kv-offload-config` YAML (`load_offload_config`): top-level `kv_offload:`, device classes
  by name (BLIS's defaults.yaml `kv_offload_devices`, shipped as
  configs/presets/kv_offload_devices.yaml), figures a tier gives itself overriding its class
  field by field; `per_block_bytes` comes from the deployment (KV bytes of one GPU block at its TP);
* the resolved block BLIS writes into a trace header (`from_header_block`), which a replay takes
  as it is (the header is authoritative, blis-features §1.2). `to_header_block` writes it back
  in BLIS's key order, so a resolved configuration round-trips through a trace.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from blis_jax.errors import ConfigError
from blis_jax.io_safety import short

# Figures of a device class / a tier, and the buffered-I/O variant of each (direct_io: false).
FIGURES = ("read_bandwidth", "write_bandwidth", "base_latency", "saturation_queue_depth",
           "single_transfer_fraction", "latency_jitter_stddev")
BUFFERED = tuple(f"buffered_{f}" for f in FIGURES)
# What a figure is when neither the tier nor its class gives it (the triple has no default).
FIGURE_DEFAULTS = {"saturation_queue_depth": 1, "single_transfer_fraction": 1.0, "latency_jitter_stddev": 0.0}
TRIPLE = ("read_bandwidth", "write_bandwidth", "base_latency")

CONFIG_KEYS = ("cpu_bytes_to_use", "block_size", "blocks_per_chunk", "tokens_per_hash", "eviction_policy",
               "offload_prompt_only", "self_describing_kv_events", "secondary_tiers")
TIER_KEYS = ("type", "root_dir", "n_read_threads", "n_write_threads", "locality", "enable_kv_events", "direct_io",
             "device_class", *FIGURES)
# The resolved header block, in BLIS's order (G03's trace.yaml)
HEADER_KEYS = ("cpu_bytes_to_use", "per_block_bytes", "block_size", "blocks_per_chunk", "tokens_per_hash",
               "eviction_policy", "offload_prompt_only", "self_describing_kv_events", "secondary_tiers")
HEADER_TIER_KEYS = ("type", "root_dir", "n_read_threads", "n_write_threads", "enable_kv_events", "direct_io",
                    "device_class", *FIGURES)
TIER_TYPES = ("fs",)
EVICTION_POLICIES = ("lru",)
# YAML 1.2 numbers PyYAML (YAML 1.1) leaves as strings, such as BLIS's `7.0e3`; Go reads them as numbers
_YAML12_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


@dataclasses.dataclass(frozen=True)
class OffloadTier:
    """One secondary (`fs`) tier, resolved: bandwidths in bytes/µs, latency in µs (a
    `device_class` resolved to its figures, explicit figures winning over the class)."""

    n_read_threads: int = 16
    n_write_threads: int = 16
    read_bandwidth: float = 1.0
    write_bandwidth: float = 1.0
    base_latency: float = 0.0
    saturation_queue_depth: int = 1      # Q_sat: the bandwidth ramp is on when >= 2 and f1 < 1
    single_transfer_fraction: float = 1.0  # f1: fraction of the bandwidth at depth 1
    latency_jitter_stddev: float = 0.0   # sigma of the factor max(0.05, 1 + N(0, sigma)) per job
    # carried for the trace header only (they change no figure)
    type: str = "fs"
    root_dir: str = ""
    direct_io: bool = True
    enable_kv_events: bool = False
    device_class: str = ""


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """The resolved offload chain of one instance. CPU staging capacity in blocks =
    cpu_bytes_to_use // per_block_bytes (per_block_bytes: KV bytes of one GPU block at the
    deployment's TP)."""

    cpu_bytes_to_use: int
    per_block_bytes: int
    offload_prompt_only: bool = True
    tiers: tuple[OffloadTier, ...] = ()
    # carried for the trace header only
    block_size: int = 16
    blocks_per_chunk: int = 1
    tokens_per_hash: int = 16
    eviction_policy: str = "lru"
    self_describing_kv_events: bool = False

    @property
    def cpu_blocks(self) -> int:
        return self.cpu_bytes_to_use // self.per_block_bytes


# ------------------------------------------------------------------------------ device classes


def device_classes(path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """Device classes by name: the shipped table (BLIS's defaults.yaml `kv_offload_devices`), or
    those of a YAML file with a top-level `kv_offload_devices:` mapping (BLIS's defaults.yaml
    shape) — pass `{**device_classes(), **device_classes(path)}` to add classes to BLIS's."""
    if path is None:
        return {k: dict(v) for k, v in _shipped_classes().items()}
    from blis_jax.config.yaml_files import read_yaml_file

    where = f"device classes {path}"
    try:
        raw = read_yaml_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    return _parse_classes(raw, where)


@functools.cache
def _shipped_classes() -> Mapping[str, Mapping[str, float]]:
    from blis_jax.config.bundled import bundled_dir
    from blis_jax.config.yaml_files import read_yaml_file

    path = bundled_dir("presets") / "kv_offload_devices.yaml"
    return _parse_classes(read_yaml_file(path), str(path))


def _parse_classes(raw: Any, where: str) -> dict[str, dict[str, float]]:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("kv_offload_devices"), Mapping):
        raise ConfigError(f"{where}: expected a top-level `kv_offload_devices:` mapping of device classes "
                          "(name: {read_bandwidth, write_bandwidth, base_latency, ...})")
    classes = {}
    for cls, figures in raw["kv_offload_devices"].items():
        at = f"{where}: kv_offload_devices.{cls}"
        if not isinstance(figures, Mapping):
            raise ConfigError(f"{at}: expected a mapping of figures (read_bandwidth, write_bandwidth, base_latency)")
        _unknown(figures, (*FIGURES, *BUFFERED), at)
        missing = [k for k in TRIPLE if k not in figures]
        if missing:
            raise ConfigError(f"{at}: {', '.join(missing)} missing; a device class gives read_bandwidth, "
                              "write_bandwidth (bytes/µs) and base_latency (µs)")
        classes[str(cls)] = {k: _figure(figures[k], f"{at}.{k}", k.removeprefix("buffered_")) for k in figures}
    return classes


# ------------------------------------------------------------------------------ the YAML


def load_offload_config(path: str | Path, per_block_bytes: int, block_size: int, *,
                        devices: Mapping[str, Mapping[str, float]] | None = None,
                        source: str | None = None) -> OffloadConfig:
    """The resolved configuration of a `--kv-offload-config` YAML. `per_block_bytes`: KV bytes
    of one GPU block at the deployment's TP; `block_size`: the GPU block size in tokens;
    `devices`: device classes by name (default: BLIS's, `device_classes()`). `source` starts
    error messages (default: the path)."""
    from blis_jax.config.yaml_files import read_yaml_file

    where = source or str(path)
    try:
        raw = read_yaml_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; give the multi-tier KV offload YAML (top-level kv_offload:)") \
            from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a directory; give the multi-tier KV offload YAML") from None
    return parse_offload_config(raw, per_block_bytes, block_size, devices=devices, source=where)


def parse_offload_config(raw: Any, per_block_bytes: int, block_size: int, *,
                         devices: Mapping[str, Mapping[str, float]] | None = None,
                         source: str = "kv offload config") -> OffloadConfig:
    """`load_offload_config` of an already parsed YAML document."""
    if not isinstance(raw, Mapping) or "kv_offload" not in raw:
        raise ConfigError(f"{source}: expected a top-level `kv_offload:` mapping (cpu_bytes_to_use, "
                          "secondary_tiers, ...)")
    _unknown(raw, ("kv_offload",), source)
    block = raw["kv_offload"]
    at = f"{source}: kv_offload"
    if not isinstance(block, Mapping):
        raise ConfigError(f"{at}: expected a mapping (cpu_bytes_to_use, secondary_tiers, ...)")
    _unknown(block, CONFIG_KEYS, at)
    if block.get("cpu_bytes_to_use") is None:
        raise ConfigError(f"{at}.cpu_bytes_to_use: missing; give the CPU staging tier's size in bytes "
                          "(e.g. 3221225472 for 3 GiB)")
    _check_int(per_block_bytes, f"{source}: KV bytes per GPU block", 1)
    _check_int(block_size, f"{source}: GPU block size", 1)
    chunk = _int(block.get("blocks_per_chunk", 1), f"{at}.blocks_per_chunk", 1)
    if chunk != 1:
        raise ConfigError(f"{at}.blocks_per_chunk {chunk}: only 1 is supported (one offload chunk per GPU block, "
                          "as in BLIS); remove it or set 1")
    if "block_size" in block:
        offload_block = _int(block["block_size"], f"{at}.block_size", 1)
        if offload_block != block_size * chunk:
            raise ConfigError(f"{at}.block_size {offload_block}: must be the GPU block size ({block_size} tokens; "
                              "only one GPU block per offload chunk is supported); remove it or set "
                              f"{block_size}")
    tokens_per_hash = _int(block.get("tokens_per_hash", block_size), f"{at}.tokens_per_hash", 1)
    if tokens_per_hash != block_size:
        # chunk keys hashed at another granularity are not modelled: refuse rather than differ
        raise ConfigError(f"{at}.tokens_per_hash {tokens_per_hash}: only the GPU block size ({block_size} tokens) "
                          f"is simulated; remove it or set {block_size}")
    policy = block.get("eviction_policy", "lru")
    if policy == "arc":
        raise ConfigError(f"{at}.eviction_policy arc: not supported (BLIS rejects it too); use lru")
    if policy not in EVICTION_POLICIES:
        raise ConfigError(f"{at}.eviction_policy {short(policy)}: use lru")
    tiers = block.get("secondary_tiers")
    if tiers is None:
        tiers = []
    if not isinstance(tiers, list):
        raise ConfigError(f"{at}.secondary_tiers: expected a list of tiers (- type: fs ...)")
    classes = device_classes() if devices is None else devices
    cfg = OffloadConfig(
        cpu_bytes_to_use=_int(block["cpu_bytes_to_use"], f"{at}.cpu_bytes_to_use", 1),
        per_block_bytes=int(per_block_bytes),
        offload_prompt_only=_bool(block.get("offload_prompt_only", True), f"{at}.offload_prompt_only"),
        tiers=tuple(_yaml_tier(t, f"{at}.secondary_tiers[{i}]", classes) for i, t in enumerate(tiers)),
        block_size=block_size * chunk, blocks_per_chunk=chunk, tokens_per_hash=tokens_per_hash,
        eviction_policy=policy,
        self_describing_kv_events=_bool(block.get("self_describing_kv_events", False),
                                        f"{at}.self_describing_kv_events"))
    _check_cpu_blocks(cfg, at)
    return cfg


def _yaml_tier(raw: Any, at: str, classes: Mapping[str, Mapping[str, float]]) -> OffloadTier:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{at}: expected a mapping (type: fs, root_dir, direct_io, device_class, ...)")
    _unknown(raw, TIER_KEYS, at)
    _check_type(raw, at)
    if raw.get("direct_io") is None:
        raise ConfigError(f"{at}.direct_io: missing; set true (O_DIRECT) or false (buffered I/O)")
    direct_io = _bool(raw["direct_io"], f"{at}.direct_io")
    cls = raw.get("device_class")
    figures: dict[str, float] = {}
    if cls is not None:
        if cls not in classes:
            raise ConfigError(f"{at}.device_class {short(cls)}: unknown; known classes: "
                              f"{', '.join(sorted(classes))} (or give read_bandwidth, write_bandwidth and "
                              "base_latency instead)")
        entry = classes[cls]
        for f in FIGURES:
            # the buffered regime's figure where the class has one, else the O_DIRECT one
            value = entry.get(f if direct_io else f"buffered_{f}", entry.get(f))
            if value is not None:
                figures[f] = value
    else:
        missing = [k for k in TRIPLE if raw.get(k) is None]
        if missing:
            raise ConfigError(f"{at}: {', '.join(missing)} missing; give a device_class (one of "
                              f"{', '.join(sorted(classes))}) or all of read_bandwidth, write_bandwidth "
                              "(bytes/µs) and base_latency (µs)")
    figures.update({f: raw[f] for f in FIGURES if raw.get(f) is not None})  # the tier's own win
    return _tier(raw, figures, at, direct_io, "" if cls is None else str(cls))


# ------------------------------------------------------------------------------ the trace header


def from_header_block(block: Any, source: str = "trace header kv_offload") -> OffloadConfig:
    """The configuration of a trace header's resolved `kv_offload` block (BLIS writes every field;
    a missing optional one takes the YAML's default)."""
    if not isinstance(block, Mapping):
        raise ConfigError(f"{source}: expected a mapping (cpu_bytes_to_use, per_block_bytes, ...)")
    _unknown(block, HEADER_KEYS, source)
    for key in ("cpu_bytes_to_use", "per_block_bytes"):
        if block.get(key) is None:
            raise ConfigError(f"{source}.{key}: missing; the resolved block a generating run writes has it "
                              "(write the block again with --trace-output)")
    chunk = _int(block.get("blocks_per_chunk", 1), f"{source}.blocks_per_chunk", 1)
    if chunk != 1:
        raise ConfigError(f"{source}.blocks_per_chunk {chunk}: only 1 is supported; set 1")
    block_size = _int(block.get("block_size", 16), f"{source}.block_size", 1)
    tokens_per_hash = _int(block.get("tokens_per_hash", block_size), f"{source}.tokens_per_hash", 1)
    if tokens_per_hash != block_size:
        raise ConfigError(f"{source}.tokens_per_hash {tokens_per_hash}: only the block size ({block_size} tokens) "
                          f"is simulated; set {block_size}")
    policy = block.get("eviction_policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise ConfigError(f"{source}.eviction_policy {short(policy)}: use lru")
    tiers = block.get("secondary_tiers") or []
    if not isinstance(tiers, list):
        raise ConfigError(f"{source}.secondary_tiers: expected a list of tiers")
    cfg = OffloadConfig(
        cpu_bytes_to_use=_int(block["cpu_bytes_to_use"], f"{source}.cpu_bytes_to_use", 1),
        per_block_bytes=_int(block["per_block_bytes"], f"{source}.per_block_bytes", 1),
        offload_prompt_only=_bool(block.get("offload_prompt_only", True), f"{source}.offload_prompt_only"),
        tiers=tuple(_header_tier(t, f"{source}.secondary_tiers[{i}]") for i, t in enumerate(tiers)),
        block_size=block_size, blocks_per_chunk=chunk, tokens_per_hash=tokens_per_hash, eviction_policy=policy,
        self_describing_kv_events=_bool(block.get("self_describing_kv_events", False),
                                        f"{source}.self_describing_kv_events"))
    _check_cpu_blocks(cfg, source)
    return cfg


def _header_tier(raw: Any, at: str) -> OffloadTier:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{at}: expected a mapping (type, root_dir, read_bandwidth, ...)")
    _unknown(raw, HEADER_TIER_KEYS, at)
    _check_type(raw, at)
    missing = [k for k in TRIPLE if raw.get(k) is None]
    if missing:
        raise ConfigError(f"{at}: {', '.join(missing)} missing; the resolved block gives every tier's figures")
    direct_io = _bool(raw.get("direct_io", True), f"{at}.direct_io")
    cls = raw.get("device_class") or ""
    if not isinstance(cls, str):
        raise ConfigError(f"{at}.device_class {short(cls)}: expected a name")
    return _tier(raw, {f: raw[f] for f in FIGURES if raw.get(f) is not None}, at, direct_io, cls)


def to_header_block(cfg: OffloadConfig) -> dict[str, Any]:
    """The resolved block BLIS writes into a trace header, in its key order (G03's trace.yaml);
    Go writes a float with an integral value bare (7000, not 7000.0)."""
    return {
        "cpu_bytes_to_use": cfg.cpu_bytes_to_use, "per_block_bytes": cfg.per_block_bytes,
        "block_size": cfg.block_size, "blocks_per_chunk": cfg.blocks_per_chunk,
        "tokens_per_hash": cfg.tokens_per_hash, "eviction_policy": cfg.eviction_policy,
        "offload_prompt_only": cfg.offload_prompt_only, "self_describing_kv_events": cfg.self_describing_kv_events,
        "secondary_tiers": [_header_tier_block(t) for t in cfg.tiers],
    }


def _header_tier_block(t: OffloadTier) -> dict[str, Any]:
    block: dict[str, Any] = {"type": t.type, "root_dir": t.root_dir, "n_read_threads": t.n_read_threads,
                             "n_write_threads": t.n_write_threads, "enable_kv_events": t.enable_kv_events,
                             "direct_io": t.direct_io}
    if t.device_class:   # informational; a tier given by its figures has none
        block["device_class"] = t.device_class
    block.update({f: _go_number(getattr(t, f)) for f in FIGURES})
    return block


def _go_number(value: float | int) -> float | int:
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


# ------------------------------------------------------------------------------ checks


def _tier(raw: Mapping, figures: Mapping[str, Any], at: str, direct_io: bool, device_class: str) -> OffloadTier:
    values = {**FIGURE_DEFAULTS, **figures}
    root = raw.get("root_dir", "")
    if root is None:
        root = ""
    if not isinstance(root, str):
        raise ConfigError(f"{at}.root_dir {short(root)}: expected a directory path")
    qsat = values["saturation_queue_depth"]
    if isinstance(qsat, float) and qsat.is_integer():
        qsat = int(qsat)
    return OffloadTier(
        n_read_threads=_int(raw.get("n_read_threads", 16), f"{at}.n_read_threads", 1, "threads"),
        n_write_threads=_int(raw.get("n_write_threads", 16), f"{at}.n_write_threads", 1, "threads"),
        read_bandwidth=_figure(values["read_bandwidth"], f"{at}.read_bandwidth", "read_bandwidth"),
        write_bandwidth=_figure(values["write_bandwidth"], f"{at}.write_bandwidth", "write_bandwidth"),
        base_latency=_figure(values["base_latency"], f"{at}.base_latency", "base_latency"),
        saturation_queue_depth=_int(qsat, f"{at}.saturation_queue_depth", 1, "transfers"),
        single_transfer_fraction=_figure(values["single_transfer_fraction"], f"{at}.single_transfer_fraction",
                                         "single_transfer_fraction"),
        latency_jitter_stddev=_figure(values["latency_jitter_stddev"], f"{at}.latency_jitter_stddev",
                                      "latency_jitter_stddev"),
        type="fs", root_dir=root, direct_io=direct_io,
        enable_kv_events=_bool(raw.get("enable_kv_events", False), f"{at}.enable_kv_events"),
        device_class=device_class)


def _figure(value: Any, at: str, kind: str) -> float:
    """One device figure, checked for its kind (bandwidths > 0, latency and sigma >= 0, f1 in (0, 1])."""
    if kind == "saturation_queue_depth":
        return _int(value, at, 1, "transfers")
    value = _yaml12(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{at} {short(value)}: expected a finite number")
    value = float(value)
    if kind.endswith("bandwidth") and value <= 0:
        raise ConfigError(f"{at} {value:g}: a bandwidth must be > 0 (bytes per µs, e.g. 7000 for 7 GB/s)")
    if kind == "base_latency" and value < 0:
        raise ConfigError(f"{at} {value:g}: a latency must be >= 0 µs")
    if kind == "latency_jitter_stddev" and value < 0:
        raise ConfigError(f"{at} {value:g}: the jitter sigma must be >= 0 (0 = no jitter)")
    if kind == "single_transfer_fraction" and not 0 < value <= 1:
        raise ConfigError(f"{at} {value:g}: must be in (0, 1] (1 = full bandwidth at queue depth 1, no ramp)")
    return value


def _check_type(raw: Mapping, at: str) -> None:
    kind = raw.get("type")
    if kind is None:
        raise ConfigError(f"{at}.type: missing; set type: fs (the only secondary tier type)")
    if kind not in TIER_TYPES:
        raise ConfigError(f"{at}.type {short(kind)}: only fs is supported; set type: fs")


def _check_cpu_blocks(cfg: OffloadConfig, at: str) -> None:
    if cfg.cpu_blocks < 1:
        raise ConfigError(f"{at}.cpu_bytes_to_use {cfg.cpu_bytes_to_use}: smaller than one KV block "
                          f"({cfg.per_block_bytes} bytes at this model and TP); give at least {cfg.per_block_bytes}")


def _unknown(raw: Mapping, known: tuple[str, ...], at: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ConfigError(f"{at}: unknown key(s) {short(', '.join(unknown))}; known: {', '.join(known)}")


def _check_int(value: Any, at: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{at} {short(value)}: must be an integer >= {low}")


def _int(value: Any, at: str, low: int, what: str = "") -> int:
    """A whole number >= low (an integral float such as 3.0e9 is taken, as YAML writes big sizes)."""
    value = _yaml12(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{at} {short(value)}: expected a whole number")
    if value < low:
        unit = f" {what}" if what else ""
        raise ConfigError(f"{at} {value}: must be >= {low}{unit}")
    if value >= 2**63:
        raise ConfigError(f"{at} {value}: beyond 64-bit integers")
    return value


def _yaml12(value: Any) -> Any:
    if isinstance(value, str) and _YAML12_NUMBER.fullmatch(value.strip()):
        text = value.strip()
        return float(text) if any(c in text for c in ".eE") else int(text)
    return value


def _bool(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{at} {short(value)}: expected true or false")
    return value
