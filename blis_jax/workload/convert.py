"""`convert preset`, `convert inference-perf` and `compose` (spec §1.5), plus spec YAML output.

Each function returns a plain spec mapping (`spec.spec_to_dict` form) that `parse_spec` reads
back; `dump_spec` renders one as YAML (`write_spec` to a file).

* `convert_preset(name, rate, num_requests)`: one client `distribution` with constant
  arrivals at `rate` and the preset's clamped-Gaussian lengths — the same synthesis as
  `run --workload NAME`, including its default 300 s client timeout, so the generated arrival
  times and deadlines equal `generate_preset`'s exactly (lengths match in distribution).
* `convert_inference_perf(spec)`: the explicit clients of an `inference_perf` spec
  (`inference_perf.expand_inference_perf`).
* `compose(specs)`: aggregate_rate = Σ rates; client and cohort rate_fractions of spec s become
  f / Σf_s · rate_s / total, so each input keeps its own rate and mix. (BLIS multiplies by
  rate_s / total without dividing by Σf_s first; the two agree whenever each spec's fractions
  sum to 1, and only this form keeps the rates when they do not.) With total rate 0
  (absolute-rate specs) clients are concatenated unchanged; mixing absolute-rate and
  proportional specs is an error. Seed and category come from the first spec, num_requests is
  summed, horizon is the largest, goodput targets are merged (conflicts are errors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from blis_jax.errors import ConfigError
from blis_jax.workload.distribution import DEFAULT_TIMEOUT_S, DISTRIBUTION_CLIENT
from blis_jax.workload.inference_perf import expand_inference_perf
from blis_jax.workload.presets import PRESETS
from blis_jax.workload.spec import (
    WorkloadSpec,
    load_spec,
    parse_spec,
    spec_to_dict,
    validate_spec,
)

SpecLike = WorkloadSpec | Mapping[str, Any] | str | Path


def as_spec(spec: SpecLike) -> WorkloadSpec:
    """WorkloadSpec from a spec object, a parsed mapping, or a YAML file path."""
    if isinstance(spec, WorkloadSpec):
        return validate_spec(spec)
    if isinstance(spec, (str, Path)):
        return load_spec(spec)
    return parse_spec(spec)


def convert_preset(name: str, rate: float = 1.0, num_requests: int = 100, *, seed: int | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Spec of preset `name` (chatbot, contentgen, summarization, multidoc) at `rate` req/s."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"--name: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 or rate == float("inf"):
        raise ConfigError(f"--rate: {rate!r} must be a finite number of requests/s > 0")
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ConfigError(f"--num-requests: {num_requests!r} must be an integer ≥ 1")

    def gaussian(g) -> dict[str, Any]:
        return {"type": "gaussian", "params": {"mean": g.mean, "std_dev": g.std, "min": g.min, "max": g.max}}

    client: dict[str, Any] = {"id": DISTRIBUTION_CLIENT, "rate_fraction": 1.0, "arrival": {"process": "constant"},
                              "input_distribution": gaussian(preset.prompt),
                              "output_distribution": gaussian(preset.output)}
    if preset.prefix_tokens > 0:
        client.update(prefix_group="shared", prefix_length=preset.prefix_tokens)
    if timeout_s > 0:
        client["timeout"] = round(timeout_s * 1e6)
    out: dict[str, Any] = {"version": "2"}
    if seed is not None:
        out["seed"] = seed
    out.update(category="language", aggregate_rate=float(rate), num_requests=num_requests, clients=[client])
    return spec_to_dict(parse_spec(out))   # validated, canonical form


def convert_inference_perf(spec: SpecLike) -> dict[str, Any]:
    """Explicit-client spec of an inference-perf spec (spec §4.11)."""
    s = as_spec(spec)
    if s.inference_perf is None:
        raise ConfigError("inference_perf: missing; convert inference-perf needs a spec with an "
                          "inference_perf section (stages + shared_prefix)")
    return spec_to_dict(expand_inference_perf(s))


def compose(specs: Sequence[SpecLike]) -> dict[str, Any]:
    """Merge specs into one (spec §1.5; see the module docstring for the rules)."""
    parsed = [expand_inference_perf(as_spec(s)) for s in specs]
    if not parsed:
        raise ConfigError("compose: no specs given; pass at least one --from")
    for i, s in enumerate(parsed):
        if s.servegen_data is not None:
            raise ConfigError(f"compose: from[{i}].servegen_data cannot be composed; convert it first")
    total = sum(s.aggregate_rate for s in parsed)
    if total > 0:
        absolute = [i for i, s in enumerate(parsed) if s.aggregate_rate == 0]
        if absolute:
            raise ConfigError(f"compose: from[{absolute[0]}] is an absolute-rate spec (aggregate_rate 0, rates "
                              "from window trace_rate) and cannot be mixed with proportional specs; give it an "
                              "aggregate_rate")
    clients, cohorts = [], []
    for s in parsed:
        fractions = sum(c.rate_fraction or 0.0 for c in (*s.clients, *s.cohorts))
        scale = s.aggregate_rate / total / fractions if total > 0 and fractions > 0 else 1.0

        def rescale(c, scale=scale):
            if total == 0 or c.rate_fraction is None:
                return c
            return dataclasses.replace(c, rate_fraction=c.rate_fraction * scale)
        clients.extend(rescale(c) for c in s.clients)
        cohorts.extend(rescale(c) for c in s.cohorts)
    goodput: dict[str, dict[str, float]] = {}
    for i, s in enumerate(parsed):
        for cls, dims in (s.goodput_slo_targets or {}).items():
            for dim, value in dims.items():
                prior = goodput.setdefault(cls, {}).setdefault(dim, value)
                if prior != value:
                    raise ConfigError(f"compose: from[{i}].goodput_slo_targets.{cls}.{dim} is {value:g} but an "
                                      f"earlier spec sets {prior:g}; make them agree")
    horizons = [s.horizon for s in parsed if s.horizon]
    merged = WorkloadSpec(
        version="2", seed=parsed[0].seed, category=parsed[0].category, aggregate_rate=total,
        num_requests=sum(s.num_requests for s in parsed), horizon=max(horizons) if horizons else None,
        clients=tuple(clients), cohorts=tuple(cohorts),
        goodput_slo_targets={k: dict(v) for k, v in goodput.items()} if goodput else None)
    return spec_to_dict(validate_spec(merged))


# ------------------------------------------------------------------------------ YAML out


def _tidy(value: Any) -> Any:
    """Plain containers, and integral floats as ints (`mean: 256`, not `mean: 256.0`)."""
    if isinstance(value, Mapping):
        return {str(k): _tidy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tidy(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def dump_spec(spec: SpecLike | Mapping[str, Any]) -> str:
    """YAML text of a spec (object or mapping): block style, small leaf mappings inline."""
    data = spec_to_dict(spec) if isinstance(spec, WorkloadSpec) else dict(spec)
    return yaml.safe_dump(_tidy(data), sort_keys=False, default_flow_style=None, allow_unicode=True, width=110)


def write_spec(path: str | Path, spec: SpecLike | Mapping[str, Any]) -> Path:
    path = Path(path)
    path.write_text(dump_spec(spec))
    return path
