"""BLIS's multi-tier KV offload configuration (`--kv-offload-config`, a TraceV2 header's
`kv_offload` block; blis-features §2.10): a CPU staging tier and `fs` secondary tiers, resolved to
the figures the engine simulates (engine/offload.py).

Parsing and validation of the YAML and of the header block live here; the engine takes only
the resolved `OffloadConfig`.
"""

from __future__ import annotations

import dataclasses


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
