"""Latency coefficients as data: ``fits/*.yaml`` → `Coefficients(alpha, beta, provenance)`.

Pure Python, no jax. `blis_jax.latency.build_latency_model` turns them into arrays.
"""

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from blis_jax.config.bundled import bundled_dir
from blis_jax.config.yaml_files import read_yaml_file
from blis_jax.errors import ConfigError
from blis_jax.io_safety import short

FITS_DIR = bundled_dir("fits")
# BLIS's own trained-physics coefficients (its defaults.yaml): what every BLIS reference output used.
BLIS_FIT = FITS_DIR / "trained-physics-iter29.yaml"
# The default, chosen by leave-one-model-out over the 15 observed experiments (docs/FITTING.md).
DEFAULT_FIT = FITS_DIR / "trained-physics-fit-trainval15-open-loop-lag.yaml"
# A coefficient file or shipped name that replaces DEFAULT_FIT for every command (e.g. `iter29`,
# for BLIS's outputs without --coefficients on each command).
DEFAULT_ENV_VAR = "BLIS_JAX_COEFFICIENTS"

BLIS_NUM_ALPHA = 3  # BLIS's alpha: queueing, post-decode, per output token
NUM_ALPHA = 4  # plus blis-jax's optional alpha[3], the first-token lag (see check_alpha)
MIN_BETA, MAX_BETA = 7, 11  # trained-physics modes are set by the number of betas


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """``alpha`` (3 values in µs, BLIS's; or 4 with blis-jax's first-token lag) and ``beta``
    (7..11 values; the count selects the mode)."""

    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", check_alpha(self.alpha))
        object.__setattr__(self, "beta", check_beta(self.beta))


def _finite_values(values: Any, what: str) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        try:
            values = list(values)  # numpy arrays
        except TypeError:
            raise ConfigError(f"{what} must be a list of numbers, got {values!r}") from None
    out = []
    for i, v in enumerate(values):
        # A string ("1.5") or a boolean is not a number, even where float() would accept it;
        # numpy scalars (a fitted vector) are.
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        try:
            ok = ok and math.isfinite(float(v))
        except OverflowError:
            ok = False
        if not ok:
            raise ConfigError(f"{what}[{i}] = {short(v)} must be a finite number"
                              + (f", not {type(v).__name__}" if isinstance(v, (str, bool)) else ""))
        out.append(float(v))
    return tuple(out)


def check_alpha(alpha: Any) -> tuple[float, ...]:
    """Validate alpha: 3 finite numbers (BLIS's α₀ queueing µs, α₁ post-decode µs, α₂ per output
    token µs), or 4 with blis-jax's α₃ ≥ 0, the first-token lag: the first token reaches the
    client α₃ × (duration of the step that produced it) after that step ends. BLIS has no such
    term (α₃ = 0); the README (fit) has the measurement. ConfigError names the index."""
    values = _finite_values(alpha, "alpha")
    if len(values) not in (BLIS_NUM_ALPHA, NUM_ALPHA):
        raise ConfigError(f"alpha has {len(values)} values; give {BLIS_NUM_ALPHA} (BLIS: queueing, post-decode, "
                          f"per output token) or {NUM_ALPHA} (plus the first-token lag)")
    if len(values) == NUM_ALPHA and values[3] < 0:
        raise ConfigError(f"alpha[3] = {values[3]!r}: the first-token lag is a multiple of a step time and "
                          "must be >= 0")
    return values


def padded_alpha(alpha: Sequence[float]) -> tuple[float, ...]:
    """All NUM_ALPHA slots: a BLIS (3-value) alpha gets the first-token lag 0."""
    alpha = tuple(float(a) for a in alpha)
    return alpha + (0.0,) * (NUM_ALPHA - len(alpha))


def check_beta(beta: Any, min_len: int = MIN_BETA) -> tuple[float, ...]:
    """Validate beta: 7..11 finite numbers (ConfigError names the index)."""
    values = _finite_values(beta, "beta")
    negative = [i for i, v in enumerate(values) if v < 0]
    if negative:
        # A negative beta would make some step times negative, which the latency model would
        # clamp into plausible-looking but meaningless latencies.
        raise ConfigError(f"beta[{negative[0]}] = {values[negative[0]]!r} is negative; every beta is a time "
                          "per unit of work and must be >= 0")
    if not min_len <= len(values) <= MAX_BETA:
        raise ConfigError(
            f"beta has {len(values)} values; trained-physics needs {min_len} to {MAX_BETA} "
            "(7/8: max-form prefill and decode, 9: split prefill, 10: split decode, "
            "11: explicit MoE-dispatch coefficient)"
        )
    return values


def shipped_names() -> list[str]:
    """Names of the shipped coefficient files (`iter29` = `trained-physics-iter29`)."""
    return sorted(p.stem for p in FITS_DIR.glob("*.yaml"))


def coefficient_path(name_or_path: str | Path) -> Path:
    """An existing file as given, else a shipped file by name: ``fits/NAME.yaml`` or
    ``fits/trained-physics-NAME.yaml`` (so ``iter29`` is BLIS's coefficients)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = str(name_or_path)
    if "/" not in text and not text.endswith((".yaml", ".yml")):
        for candidate in (FITS_DIR / f"{text}.yaml", FITS_DIR / f"trained-physics-{text}.yaml"):
            if candidate.is_file():
                return candidate
    raise ConfigError(f"coefficient file {text!r} does not exist; give a coefficient YAML or a shipped name "
                      f"({', '.join(shipped_names())}, or iter29 for BLIS's)")


def default_coefficient_path() -> Path:
    """DEFAULT_FIT, or the file or name in $BLIS_JAX_COEFFICIENTS."""
    override = os.environ.get(DEFAULT_ENV_VAR, "").strip()
    if not override:
        return DEFAULT_FIT
    try:
        return coefficient_path(override)
    except ConfigError as e:
        raise ConfigError(f"${DEFAULT_ENV_VAR}: {e}") from None


def load_coefficients(path: str | Path | None = None) -> Coefficients:
    """Read a coefficient YAML (keys ``alpha``, ``beta``, anything else is provenance), by
    path or shipped name (`coefficient_path`); ``None`` loads the default
    (`default_coefficient_path`)."""
    path = coefficient_path(path) if path is not None else default_coefficient_path()
    try:
        data = read_yaml_file(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"coefficient file {path}: not valid YAML ({e})") from e
    if not isinstance(data, Mapping):
        raise ConfigError(f"coefficient file {path}: expected a mapping with alpha and beta")
    missing = [k for k in ("alpha", "beta") if k not in data]
    if missing:
        raise ConfigError(f"coefficient file {path}: missing key(s) {missing}")
    try:
        return Coefficients(
            alpha=data["alpha"],
            beta=data["beta"],
            provenance={k: v for k, v in data.items() if k not in ("alpha", "beta")}
            | {"path": str(path)},
        )
    except ConfigError as e:
        raise ConfigError(f"coefficient file {path}: {e}") from None
