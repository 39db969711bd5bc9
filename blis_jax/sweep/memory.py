"""How many scenarios fit in one batch: the memory budget (by default a share of what the
devices, or the host for CPU, have free) and the copies of a lane's state a batch holds."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from blis_jax.errors import ConfigError

# One lane holds its request arrays and engine state; the while loop keeps an input and an
# output carry, and the host receives a copy of the final state: three copies in all.
COPIES_PER_LANE = 3
BUDGET_SHARE = 0.5  # of the free memory, by default
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def default_budget(devices: Sequence) -> int:
    """Bytes a batch may use on `devices` together: half the free memory of each accelerator,
    or half the host's available memory for CPU devices (which share it)."""
    accel = [d for d in devices if d.platform != "cpu"]
    if accel:
        total = 0
        for d in accel:
            stats = d.memory_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            total += int(BUDGET_SHARE * free) if free > 0 else 2**30
        return total
    return int(BUDGET_SHARE * host_available_bytes())


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def parse_bytes(text: str, flag: str = "--memory-budget") -> int:
    """'512M', '2GiB', '1e9' → bytes (the error names the flag)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{flag} {text!r}: give a size such as 512M, 2G or 2GiB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{flag} {text!r}: must be > 0")
    return value
