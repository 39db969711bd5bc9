"""Latency-coefficient axes: `alpha[i]` / `beta[i]` (one entry) and `alpha-scale` / `beta-scale`.

A scenario with coefficient axes is turned into explicit `alpha-coeffs` / `beta-coeffs`
settings (the same run flags a user would type), starting from the scenario's own
coefficients: its `alpha-coeffs`/`beta-coeffs`, else its `coefficients` file, else the shipped
default fit. Scales multiply that base; entry axes then set one value outright.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from blis_jax.config import load_coefficients
from blis_jax.config.coefficients import MAX_BETA, NUM_ALPHA, padded_alpha
from blis_jax.errors import ConfigError

SCALE_KEYS = ("alpha-scale", "beta-scale")
_ENTRY = re.compile(r"^(alpha|beta)\[(\d+)\]$")


def is_coefficient_axis(key: str) -> bool:
    return key in SCALE_KEYS or _ENTRY.match(key) is not None


def check_axis(key: str, values, where: str) -> None:
    """Index range and number type of a coefficient axis (the error names the axis)."""
    m = _ENTRY.match(key)
    if m is not None:
        limit = NUM_ALPHA if m.group(1) == "alpha" else MAX_BETA
        if int(m.group(2)) >= limit:
            raise ConfigError(f"{where}.{key}: index {m.group(2)} is out of range; {m.group(1)} has "
                              f"{limit} entries at most (indices 0..{limit - 1})")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{where}.{key}: {v!r} must be a finite number")
        if key in SCALE_KEYS and v < 0:
            raise ConfigError(f"{where}.{key}: {v!r} must be >= 0 (a factor on every coefficient)")


def apply(settings: Mapping[str, Any], values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Settings with the coefficient axes of `values` folded into alpha-coeffs/beta-coeffs."""
    axes = {k: v for k, v in values.items() if is_coefficient_axis(k)}
    out = dict(settings)
    if not axes:
        return out
    if out.get("latency-model", "trained-physics") != "trained-physics":
        raise ConfigError(f"{where}: coefficient axes ({', '.join(axes)}) need latency-model "
                          "trained-physics; roofline has no fitted coefficients")
    alpha, beta = _base_coefficients(out, where)
    for name, coeffs in (("alpha", alpha), ("beta", beta)):
        scale = axes.get(f"{name}-scale")
        if scale is not None:
            coeffs[:] = [c * float(scale) for c in coeffs]
    for key, value in axes.items():
        m = _ENTRY.match(key)
        if m is None:
            continue
        coeffs, index = (alpha if m.group(1) == "alpha" else beta), int(m.group(2))
        if coeffs is alpha and index == NUM_ALPHA - 1:
            alpha[:] = padded_alpha(alpha)   # BLIS's three alphas: the first-token lag starts at 0
        if index >= len(coeffs):
            raise ConfigError(f"{where}.{key}: the scenario's {m.group(1)} has {len(coeffs)} entries "
                              f"(indices 0..{len(coeffs) - 1})")
        coeffs[index] = float(value)
    out.pop("coefficients", None)
    out["alpha-coeffs"] = tuple(alpha)
    out["beta-coeffs"] = tuple(beta)
    return out


def _base_coefficients(settings: Mapping[str, Any], where: str) -> tuple[list[float], list[float]]:
    if "alpha-coeffs" in settings and "beta-coeffs" in settings:
        return list(settings["alpha-coeffs"]), list(settings["beta-coeffs"])
    if "alpha-coeffs" in settings or "beta-coeffs" in settings:
        raise ConfigError(f"{where}: give both alpha-coeffs and beta-coeffs, or neither")
    try:
        coeffs = load_coefficients(settings.get("coefficients"))
    except ConfigError as e:
        raise ConfigError(f"{where}.coefficients: {e}") from None
    return list(coeffs.alpha), list(coeffs.beta)
