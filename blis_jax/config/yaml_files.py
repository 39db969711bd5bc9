"""Bundled and user YAML files, parsed once per process.

A sweep resolves every scenario the way `blis-jax run` does, which reads the model, GPU and
coefficient files again for each one; parsing them dominated resolving a 1,000-scenario grid.
The cache is keyed by the file's path, size and modification time, so an edited file is
read again, and callers get their own copy of the parsed data.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from blis_jax.io_safety import load_yaml_text, read_text


def read_yaml_file(path: str | Path) -> Any:
    """`yaml.safe_load` of the file (raises ConfigError for an unreadable or malformed file)."""
    path = Path(path).resolve()
    stat = path.stat()
    return copy.deepcopy(_parsed(path, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=256)
def _parsed(path: Path, size: int, mtime_ns: int) -> Any:
    del size, mtime_ns  # part of the cache key only
    # UTF-8 only, bounded size, nesting and alias expansion (errors: one ConfigError line).
    return load_yaml_text(read_text(path, str(path)), str(path))
