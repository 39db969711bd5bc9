"""LoRA adapters on one instance (blis-features §3.12): a capacity-bounded resident set with LRU
eviction of unpinned adapters, the head-of-line cold-load gate, and the step-time overhead.

Host side, `LoraConfig` is the resolved registry and cost coefficients (ids, ranks, capacity,
load costs, overhead tiers). In the engine the resident set is a few arrays of
`dims.lora_slots` slots (adapter id, ready flag, LRU stamp) plus per-adapter pin counts and
load/eviction counters, so LoRA runs stay jitted and vmappable. `dims.lora_slots == 0` (no
adapters configured) traces none of this: the program is the one without LoRA.

BLIS's order within a step: the gate runs after the wait queue is ordered and before batch
formation; while a load is in flight no second load starts, the gated head blocks admission
(head-of-line), and an idle instance schedules no step until the load completes (the load
completion event, ordered after enqueues and before steps, starts one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float64, Int64

from blis_jax.engine.params import INF_TIME
from blis_jax.errors import ConfigError

GIB = float(1 << 30)
# defaults.yaml `lora:` (BLIS's cost defaults; the registry and capacity come per run)
DEFAULT_LOAD_BASE_LATENCY_US = 1500.0
DEFAULT_LOAD_BANDWIDTH_BYTES_US = 2.0e6
DEFAULT_FOOTPRINT_BYTES_PER_RANK = 2.0e6
DEFAULT_STEP_OVERHEAD_TIERS: Mapping[int, tuple[float, float]] = {8: (0.02, 1.0), 16: (0.035, 1.0), 32: (0.06, 1.0)}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """A resolved LoRA configuration: adapters (id, rank) in registry order, slots per instance,
    load costs and step-overhead tiers {rank: (k6, k7)}."""

    adapters: tuple[tuple[str, int], ...]
    capacity: int
    load_base_latency_us: float = DEFAULT_LOAD_BASE_LATENCY_US
    load_bandwidth_bytes_us: float = DEFAULT_LOAD_BANDWIDTH_BYTES_US
    footprint_bytes_per_rank: float = DEFAULT_FOOTPRINT_BYTES_PER_RANK
    step_overhead_tiers: tuple[tuple[int, float, float], ...] = tuple(
        (r, k6, k7) for r, (k6, k7) in DEFAULT_STEP_OVERHEAD_TIERS.items())

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.adapters)

    @property
    def max_rank(self) -> int:
        return max(r for _, r in self.adapters)

    def load_time_us(self, rank: int) -> int:
        """max(1, ceil(base + ceil(rank·footprint / bandwidth))) µs."""
        transfer = math.ceil(rank * self.footprint_bytes_per_rank / self.load_bandwidth_bytes_us)
        return max(1, math.ceil(self.load_base_latency_us + transfer))

    def tier(self, rank: int) -> tuple[float, float]:
        """(k6, k7) of the tier nearest to `rank` (the lower tier on a tie)."""
        _, k6, k7 = min(self.step_overhead_tiers, key=lambda t: (abs(t[0] - rank), t[0]))
        return k6, k7

    @property
    def reservation_gib(self) -> float:
        """Static HBM reservation subtracted before the KV auto-sizing: capacity·footprint·max rank."""
        return self.capacity * self.footprint_bytes_per_rank * self.max_rank / GIB

    def adapter_index(self, labels) -> np.ndarray:
        """Registry index of each request's adapter label (-1: the base model). An unknown label
        is an error naming it."""
        index = {a: i for i, a in enumerate(self.ids)}
        out = np.full(len(labels), -1, np.int32)
        for i, label in enumerate(labels):
            if label:
                if label not in index:
                    raise ConfigError(f"request adapter {label!r} is not in the LoRA registry "
                                      f"({', '.join(self.ids)}); add it to lora.adapters of --lora-config")
                out[i] = index[label]
        return out


class LoraParams(eqx.Module):
    """The engine's LoRA numbers, per adapter (A = dims.lora_adapters, padded)."""

    capacity: Int64[Array, ""]
    load_us: Int64[Array, " A"]
    rank: Int64[Array, " A"]
    k6: Float64[Array, " A"]
    k7: Float64[Array, " A"]


def lora_params(cfg: LoraConfig, num_adapters: int) -> LoraParams:
    pad = num_adapters - len(cfg.adapters)
    ranks = [r for _, r in cfg.adapters] + [0] * pad
    tiers = [cfg.tier(r) for _, r in cfg.adapters] + [(0.0, 1.0)] * pad
    return LoraParams(
        capacity=jnp.asarray(cfg.capacity, jnp.int64),
        load_us=jnp.asarray([cfg.load_time_us(r) for r in ranks], jnp.int64),
        rank=jnp.asarray(ranks, jnp.int64),
        k6=jnp.asarray([t[0] for t in tiers], jnp.float64),
        k7=jnp.asarray([t[1] for t in tiers], jnp.float64),
    )


def with_params(params, cfg: LoraConfig):
    """EngineParams with the LoRA numbers of `cfg`."""
    return dataclasses.replace(params, lora=lora_params(cfg, engine_sizes(cfg)["lora_adapters"]))


def engine_sizes(cfg: LoraConfig) -> dict:
    """EngineDims fields for `cfg`: slots and registry size (buckets), decode runs not coasted."""
    from blis_jax.engine.dims import bucket

    return dict(lora_slots=bucket(cfg.capacity, 1), lora_adapters=bucket(len(cfg.adapters), 1), coast_steps=1)


def adapter_labels(requests) -> list[str]:
    """The `adapter` trace column of a request set ('' each when absent)."""
    column = getattr(requests, "trace_columns", {}).get("adapter")
    return [""] * len(requests) if column is None else [str(v) for v in column]


# ------------------------------------------------------------------------ engine (traced)


def resident_ready(state, a):
    """Whether adapter `a` (-1: none) is resident and loaded (True for the base model)."""
    return (a < 0) | jnp.any((state.lora_slot == a) & state.lora_ready)


def gate(state, params, a, active):
    """Cold-load gate for a wait-queue head needing adapter `a`: when it is neither resident
    nor loading and no load is in flight, take a free slot (the first), else evict the least
    recently used ready adapter no running request pins, and start the load; with every slot
    pinned nothing happens (the head waits for a pinning request to finish)."""
    lp = params.lora
    c = state.lora_slot.shape[0]
    idx = jnp.arange(c)
    in_cap = idx < lp.capacity
    need = active & (a >= 0) & ~jnp.any(state.lora_slot == a) & (state.lora_loading < 0)
    free = in_cap & (state.lora_slot < 0)
    pinned = state.lora_pins[jnp.maximum(state.lora_slot, 0)] > 0
    evictable = in_cap & (state.lora_slot >= 0) & state.lora_ready & ~pinned
    lru = jnp.argmin(jnp.where(evictable, state.lora_used, jnp.iinfo(jnp.int64).max))
    slot = jnp.where(jnp.any(free), jnp.argmax(free), lru)
    start = need & (jnp.any(free) | jnp.any(evictable))
    old = state.lora_slot[slot]
    evict = start & (old >= 0)
    na = state.lora_loads.shape[0]
    at_slot = jnp.where(start, slot, c)
    safe_a = jnp.maximum(a, 0)
    return dataclasses.replace(
        state,
        lora_slot=state.lora_slot.at[at_slot].set(a.astype(jnp.int32), mode="drop"),
        lora_ready=state.lora_ready.at[at_slot].set(False, mode="drop"),
        lora_loading=jnp.where(start, slot, state.lora_loading).astype(jnp.int32),
        lora_done=jnp.where(start, state.now + lp.load_us[safe_a], state.lora_done),
        lora_loads=state.lora_loads.at[jnp.where(start, safe_a, na)].add(1, mode="drop"),
        lora_evictions=state.lora_evictions.at[jnp.where(evict, jnp.maximum(old, 0), na)].add(1, mode="drop"),
    )


def touch(state, a, active):
    """Mark adapter `a` most recently used (LRU order)."""
    hit = active & (a >= 0) & (state.lora_slot == a)
    return dataclasses.replace(state, lora_used=jnp.where(hit, state.lora_tick, state.lora_used),
                               lora_tick=state.lora_tick + jnp.any(hit))


def pin(state, a, delta, active):
    """A request using adapter `a` enters (+1) or leaves (-1) the instance's running set."""
    na = state.lora_pins.shape[0]
    at = jnp.where(active & (a >= 0), jnp.maximum(a, 0), na)
    return dataclasses.replace(state, lora_pins=state.lora_pins.at[at].add(delta, mode="drop"))


def load_done(state, active):
    """AdapterLoadCompletionEvent: the loading adapter becomes resident."""
    c = state.lora_slot.shape[0]
    on = active & (state.lora_loading >= 0)
    at = jnp.where(on, state.lora_loading, c)
    state = dataclasses.replace(
        state,
        lora_ready=state.lora_ready.at[at].set(True, mode="drop"),
        lora_used=state.lora_used.at[at].set(state.lora_tick, mode="drop"),
        lora_tick=state.lora_tick + on,
        lora_loading=jnp.where(on, -1, state.lora_loading).astype(jnp.int32),
        lora_done=jnp.where(on, INF_TIME, state.lora_done),
    )
    return state


def step_factor(params, adapters, scheduled):
    """1 + k6(r)·A^k7(r): A distinct adapters among the step's scheduled requests, r the
    highest rank among them (its nearest tier); 1 when none uses an adapter."""
    lp = params.lora
    na = lp.rank.shape[0]
    present = jnp.zeros(na, bool).at[jnp.where(scheduled & (adapters >= 0), adapters, na)].set(True, mode="drop")
    count = jnp.sum(present).astype(jnp.float64)
    top = jnp.argmax(jnp.where(present, lp.rank, -1))
    return jnp.where(count > 0, 1.0 + lp.k6[top] * count ** lp.k7[top], 1.0)
