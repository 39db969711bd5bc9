"""Where the bundled data lives: model and GPU configs, coefficient sets, example sweep grids.

The repository keeps them at its top level (``configs/models``, ``configs/hardware``,
``configs/sweeps``, ``fits``); the build maps those folders into the package as
``blis_jax/data/<kind>`` (``[tool.setuptools.package-dir]`` in ``pyproject.toml``), so an
installed wheel carries them and reads them through `importlib.resources`. An editable install
or a checkout run with ``python -m blis_jax`` has no ``blis_jax/data``; it reads the repository's
folders themselves. One copy of every file either way.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# kind -> folder in the repository (relative to its root); the package folder is data/<kind>
REPOSITORY_FOLDERS = {
    "models": "configs/models",
    "hardware": "configs/hardware",
    "sweeps": "configs/sweeps",
    "presets": "configs/presets",
    "observed": "configs/observed",
    "fits": "fits",
}


def bundled_dir(kind: str) -> Path:
    """The folder holding the bundled files of ``kind`` (one of `REPOSITORY_FOLDERS`)."""
    if kind not in REPOSITORY_FOLDERS:
        raise KeyError(f"unknown bundled data kind {kind!r}; known: {', '.join(REPOSITORY_FOLDERS)}")
    # A file-system install: files() is a pathlib.Path (zip imports are not supported: the
    # loaders glob and open plain files, and a wheel always installs unpacked).
    packaged = Path(str(resources.files("blis_jax") / "data" / kind))
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / REPOSITORY_FOLDERS[kind]
