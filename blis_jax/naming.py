"""How configuration fields are named in error messages.

The library names a field by its path in `ScenarioConfig` (``engine.max_num_seqs``). A client
with its own vocabulary installs a table for the duration of a call (`naming`): the CLI maps
each path to its flag (``--max-num-seqs``), a sweep grid to its setting key. Messages are built
with `name(path)`, so one message serves every client.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

_TABLE: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("blis_jax_field_names", default={})


def name(path: str) -> str:
    """The caller's name of the configuration field at `path`."""
    return _TABLE.get().get(path, path)


@contextlib.contextmanager
def naming(table: Mapping[str, str]) -> Iterator[None]:
    """Within the block, `name(path)` answers `table[path]` (paths it lacks keep their own name)."""
    token = _TABLE.set(table)
    try:
        yield
    finally:
        _TABLE.reset(token)
