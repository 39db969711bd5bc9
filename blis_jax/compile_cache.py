"""JAX's persistent compilation cache for the `blis-jax` command.

Compiling the engine takes seconds to tens of seconds per program shape; the cache keeps
compiled programs on disk, so a later process with the same shapes (the same sweep run again,
a `run` with similar sizes) skips compilation. The CLI enables it by default in
`$XDG_CACHE_HOME/blis-jax/jax-cache` (`~/.cache/blis-jax/jax-cache`). The environment variable
`BLIS_JAX_COMPILE_CACHE` names another directory, or disables the cache with `0`/`off`;
`blis-jax --no-compile-cache ...` disables it for one command. Library use is unaffected:
only the CLI entry point calls `enable_compile_cache`.

With the cache on, sweep batch programs are also kept whole, compiled, in the sibling directory
`<cache>-executables` (`blis_jax.executables`), which skips their tracing and lowering too; so
are the engine and cluster programs of `run` and `replay`.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "BLIS_JAX_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no", "none", "")
# Programs that compile faster than this are not worth a disk round trip.
MIN_COMPILE_SECONDS = 1.0
EXECUTABLES_SUFFIX = "-executables"   # sibling of the cache directory: whole compiled programs

_executable_dir: Path | None = None


def executable_dir() -> Path | None:
    """Where compiled programs are kept (None: the CLI's cache is off, or a library call)."""
    return _executable_dir


def set_executable_dir(path: Path | None) -> None:
    """Keep compiled programs in `path` (None: do not keep them)."""
    global _executable_dir
    _executable_dir = None if path is None else Path(path)


def cache_dir() -> Path | None:
    """The cache directory the CLI uses, or None when the environment disables it."""
    value = os.environ.get(ENV_VAR)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "blis-jax" / "jax-cache"


def enable_compile_cache(diag=None) -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()`; returns it (None: disabled
    or the directory cannot be created, which `diag.warn`s and runs without a cache)."""
    path = cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if diag is not None:
            diag.warn(f"compile cache {path}: cannot create it ({e.strerror or e}); running without it "
                      f"(set {ENV_VAR} to another directory, or to 0 to silence this)")
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    set_executable_dir(path.with_name(path.name + EXECUTABLES_SUFFIX))
    return path
