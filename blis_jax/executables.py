"""Compiled programs kept on disk, so that a later process skips tracing and lowering them too.

JAX's persistent compilation cache (`blis_jax.compile_cache`) skips XLA's compilation, but every
process still traces the engine and lowers it to StableHLO before it can look the program up
(the 200-scenario benchmark grid, four program shapes: 18.2 s warm with that alone, 16.5 s
with this cache). Here the compiled executable
itself is stored (`jax.experimental.serialize_executable`), under a key made of everything the
program depends on: the source of the whole `blis_jax` package, the jax and jaxlib versions,
the XLA flags and x64 setting, the devices of the mesh, the lane program and its dims and mode,
and the tree structure, shapes, dtypes and shardings of its inputs. Any edit of the package
therefore misses every entry. The directory is `compile_cache.executable_dir()`: on exactly
when the CLI's compilation cache is. An entry that cannot be read is recompiled and rewritten.
Used by the sweep's batch programs and by the engine and cluster drivers of `run` and `replay`.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import hashlib
import io
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

import blis_jax
from blis_jax import compile_cache

try:  # equinox's "no value" sentinel in module tree definitions, compared by identity
    from equinox._module._flatten import MISSING as _EQX_MISSING
except ImportError:  # another equinox: the disk cache is off (tree definitions would not round-trip)
    _EQX_MISSING = None

# The directory keeps the most recently used entries up to this size (an entry is a few MB;
# every edit of the package makes new ones).
MAX_BYTES = 2 << 30

_LOADED: dict[str, Callable] = {}   # key → compiled program, for this process
stats = {"loaded": 0, "stored": 0}  # disk hits and writes in this process (tests, benchmarks)


@functools.cache
def source_digest() -> str:
    """sha256 over the package's Python sources (path and content of each, in path order)."""
    root = Path(blis_jax.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def program_key(name: str, args) -> str:
    """The cache key of program `name` (lane program, dims, mode) called with device arrays `args`."""
    import jaxlib

    leaves, tree = jax.tree.flatten(args)
    devices = sorted({(d.platform, d.device_kind, d.id, d.process_index)
                      for leaf in leaves for d in leaf.sharding.device_set})
    parts = [source_digest(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""),
             str(jax.config.jax_enable_x64), name, str(tree), repr(devices)]
    parts += [f"{leaf.shape}{leaf.dtype.str}{leaf.sharding}" for leaf in leaves]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def call(program: Callable, name: str, *args):
    """`program(*args)` (a jitted function of pytrees), through the on-disk cache when it is on.

    `name` must identify everything the program closes over (its static settings): the key
    adds only the inputs' structure, shapes, dtypes and shardings."""
    directory = compile_cache.executable_dir()
    if directory is None or _EQX_MISSING is None:
        return program(*args)
    key = program_key(name, args)
    compiled = _LOADED.get(key)
    if compiled is None:
        compiled = _load(directory / key)
        if compiled is None:
            executable, storable = _compile(program, args)
            compiled = _store(directory / key, executable) if storable else _as_flat_call(executable)
        _LOADED[key] = compiled
    return compiled(*jax.tree.leaves(args))


def _compile(program: Callable, args) -> tuple[object, bool]:
    """`program` compiled for `args`, and whether that executable may be written to disk.

    JAX's persistent compilation cache is bypassed for this compilation: XLA:CPU serializes an
    executable it read back from that cache without the object code of its fused kernels, and
    a later process that loads it fails on its first call ("Function ... fusion not found").
    That cache is keyed on the program, not on this package's source, so after any edit of
    the package it would answer every program, and no entry here would ever be written again.
    Should the bypass not take (another JAX), a cache hit is detected and nothing is written."""
    hits_before = _persistent_cache_hits()
    with _persistent_cache_bypassed():
        compiled = program.lower(*args).compile()
    return compiled, _persistent_cache_hits() == hits_before


@contextlib.contextmanager
def _persistent_cache_bypassed():
    try:
        from jax.experimental.compilation_cache.compilation_cache import reset_cache
    except ImportError:  # another JAX: the hit detection above still keeps bad entries out
        yield
        return
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()   # JAX decides once per process whether its cache is used: decide again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)
        reset_cache()


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hits = [0]


def _count_cache_hit(event: str, **_) -> None:
    if event == _CACHE_HIT_EVENT:
        _cache_hits[0] += 1


@functools.cache
def _listen_for_cache_hits() -> None:
    jax.monitoring.register_event_listener(_count_cache_hit)


def _persistent_cache_hits() -> int:
    """JAX persistent-cache hits in this process since this module first asked."""
    _listen_for_cache_hits()
    return _cache_hits[0]


def _load(path: Path) -> Callable | None:
    from jax.experimental import serialize_executable

    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        serialized, num_inputs, out_tree = pickle.loads(blob)
        compiled = serialize_executable.deserialize_and_load(serialized, _flat_inputs(num_inputs), out_tree)
    except Exception:  # noqa: BLE001 - a stale or damaged entry: compile again and overwrite it
        return None
    stats["loaded"] += 1
    try:
        os.utime(path)   # recently used: pruned last
    except OSError:
        pass
    return compiled


def _store(path: Path, compiled):
    """Write `compiled` to `path` (if it can be serialized); returns it, called like a loaded one."""
    from jax.experimental import serialize_executable

    in_tree = compiled.in_tree
    try:
        serialized, _, out_tree = serialize_executable.serialize(compiled)
        blob = _dumps((serialized, in_tree.num_leaves, out_tree))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)   # atomic: a concurrent reader sees the old entry or the whole new one
        stats["stored"] += 1
        _prune(path.parent, MAX_BYTES)
    except Exception:  # noqa: BLE001 - e.g. XLA cannot serialize some programs: only the next process pays
        pass
    return _as_flat_call(compiled)


def _as_flat_call(compiled):
    """`compiled` called with its input leaves as positional arguments, as a loaded entry is."""
    in_tree = compiled.in_tree
    return lambda *leaves: compiled(*jax.tree.unflatten(in_tree, leaves)[0])


def _prune(directory: Path, max_bytes: int) -> None:
    """Delete the least recently used entries until the directory holds at most `max_bytes`."""
    entries = []
    for path in directory.iterdir():
        try:
            info = path.stat()
        except OSError:
            continue
        entries.append((info.st_mtime_ns, info.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        try:
            path.unlink()
            total -= size
        except OSError:
            pass


def _dumps(obj) -> bytes:
    """pickle.dumps, with equinox's sentinel pickled by reference (a copy would not be it)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer)
    pickler.dispatch_table = {**copyreg.dispatch_table, type(_EQX_MISSING): lambda _: "MISSING"}
    pickler.dump(obj)
    return buffer.getvalue()


def _flat_inputs(n: int):
    """The input tree of a program called with its n input leaves as positional arguments, as
    every program of this cache is: an entry then needs no pickled tree of equinox modules."""
    return jax.tree.structure((tuple(range(n)), {}))


def loaded_programs() -> int:
    """Programs compiled or loaded through this cache in this process."""
    return len(_LOADED)


def forget() -> None:
    """Drop this process's loaded programs (the disk entries stay)."""
    _LOADED.clear()
