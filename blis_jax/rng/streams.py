"""BLIS's partitioned random streams (blis-rng.md §2).

A `PartitionedRNG` built from a 64-bit seed K hands out one Go source per subsystem name,
created on first use and cached: `workload` is seeded with K, every other name with
K XOR fnv1a64(name) (64-bit FNV-1a over the UTF-8 bytes, as signed int64).
"""

from __future__ import annotations

from blis_jax.rng.go_rand import GoRand

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1

WORKLOAD = "workload"
WORKLOAD_GEN = "workload-gen"
ROUTER = "router"
PREFILL_ROUTER = "prefill-router"
DECODE_ROUTER = "decode-router"
KV_OFFLOAD = "kv-offload"
AUTOSCALER = "autoscaler"  # HPA scrape delays of scaling actuations (blis-infra §1.3)
NODE_PROVISIONING = "node-provisioning"  # provisioning delays of nodes (blis-infra §1.3; a library feature)
INSTANCE_LOADING = "instance-loading"  # loading delays of instances placed on node pools (blis-infra §1.3)


def to_int64(x: int) -> int:
    """Two's-complement reinterpretation of x mod 2⁶⁴ as a signed int64 (Go's int64 wrap)."""
    x &= _U64
    return x - (1 << 64) if x >= 1 << 63 else x


def fnv1a64(name: str | bytes) -> int:
    """64-bit FNV-1a of `name`, as a signed int64."""
    h = _FNV_OFFSET
    for b in name.encode() if isinstance(name, str) else name:
        h = ((h ^ b) * _FNV_PRIME) & _U64
    return to_int64(h)


def subsystem_seed(seed: int, name: str) -> int:
    """Seed of subsystem `name`'s stream for run/workload seed `seed`."""
    return int(seed) if name == WORKLOAD else to_int64(int(seed) ^ fnv1a64(name))


class PartitionedRNG:
    """BLIS `sim.PartitionedRNG`: one lazily created, cached Go source per subsystem."""

    def __init__(self, seed: int):
        self.seed = to_int64(int(seed))
        self._streams: dict[str, GoRand] = {}

    def for_subsystem(self, name: str) -> GoRand:
        s = self._streams.get(name)
        if s is None:
            s = self._streams[name] = GoRand(subsystem_seed(self.seed, name))
        return s
