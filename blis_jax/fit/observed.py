"""Observed vLLM measurements (``trainval15.json``) and the BLIS fit loss.

The file (``../shared/reference/observed/README.md``) holds, per experiment, the engine and
workload configuration, the observed summary means and BLIS's predictions. Only the mean TTFT and
mean E2E enter the loss (BLIS ``training/run_blis_and_compute_loss.py``, ``compute_overall_loss``):

    APE  = 100 · |pred − obs| / obs                       (per experiment, on the summary means)
    loss = sqrt(mean_e APE(ttft_mean_ms)²) + sqrt(mean_e APE(e2e_mean_ms)²)      (percent)

`loss_terms` is written with jax.numpy so that the fitting driver differentiates the same
function that reports the loss; it accepts numpy input too.

Pure loading code raises `ConfigError` naming the file and the field (``experiments[3].observed
.ttft_mean_ms``); nothing here runs a simulation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from blis_jax.errors import ConfigError
from blis_jax.io_safety import load_json_text, read_text

PREDICTION_BLOCKS = ("blis_trained_physics", "blis_roofline")
LOSS_DEFINITION = "RMSE over experiments of APE(mean TTFT) + RMSE of APE(mean E2E), in percent"


@dataclasses.dataclass(frozen=True)
class ObservedExperiment:
    """One experiment: the configuration to simulate and the observed means (ms)."""

    id: str
    model: str                    # HF id
    hardware: str
    tp: int
    max_num_seqs: int
    max_num_batched_tokens: int
    total_kv_blocks: int
    cpu_kv_blocks: int            # recorded only: blis-jax has no CPU KV tier
    workload: dict                # workload spec v2 (inference_perf or clients)
    ttft_mean_ms: float
    e2e_mean_ms: float
    predictions: Mapping[str, tuple[float, float]]   # block name → (ttft_mean_ms, e2e_mean_ms)
    output_len_mean: float | None = None   # generated tokens per request, as observed (None: not given)


@dataclasses.dataclass(frozen=True)
class ObservedSet:
    path: str
    sha256: str
    experiments: tuple[ObservedExperiment, ...]
    stated_loss: Mapping[str, Mapping[str, float]]   # the file's "loss" block (may be empty)

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.experiments]

    def select(self, ids: Sequence[str] | None, flag: str = "--experiments") -> list[ObservedExperiment]:
        """The experiments named in `ids` (in that order), all of them for None."""
        if ids is None:
            return list(self.experiments)
        by_id = {e.id: e for e in self.experiments}
        seen, out = set(), []
        for i in ids:
            if i not in by_id:
                raise ConfigError(f"{flag}: unknown experiment id {i!r}; {self.path} has "
                                  f"{', '.join(self.ids)}")
            if i in seen:
                raise ConfigError(f"{flag}: experiment id {i!r} is listed twice")
            seen.add(i)
            out.append(by_id[i])
        if not out:
            raise ConfigError(f"{flag}: no experiment ids given")
        return out


# ------------------------------------------------------------------------------- the loss


def _safe_sqrt(x):
    # sqrt with a zero (not NaN) gradient at 0: the loss of a perfect fit is differentiable
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def loss_terms(pred_ttft, pred_e2e, obs_ttft, obs_e2e):
    """(TTFT RMSE, E2E RMSE, loss), all in percent, over the experiments along axis 0.

    Inputs are mean latencies in any one unit (pred and obs alike). Differentiable (jnp)."""
    pred_ttft, pred_e2e = jnp.asarray(pred_ttft, jnp.float64), jnp.asarray(pred_e2e, jnp.float64)
    obs_ttft, obs_e2e = jnp.asarray(obs_ttft, jnp.float64), jnp.asarray(obs_e2e, jnp.float64)
    ttft = _safe_sqrt(jnp.mean((100.0 * (pred_ttft - obs_ttft) / obs_ttft) ** 2, axis=0))
    e2e = _safe_sqrt(jnp.mean((100.0 * (pred_e2e - obs_e2e) / obs_e2e) ** 2, axis=0))
    return ttft, e2e, ttft + e2e


def loss_pct(pred_ttft, pred_e2e, obs_ttft, obs_e2e) -> float:
    return float(loss_terms(pred_ttft, pred_e2e, obs_ttft, obs_e2e)[2])


def ape_pct(pred: float, obs: float) -> float:
    return 100.0 * abs(pred - obs) / obs


def prediction_loss(experiments: Sequence[ObservedExperiment], block: str) -> dict[str, float]:
    """The loss of a prediction block of the file (e.g. blis_trained_physics) over `experiments`."""
    missing = [e.id for e in experiments if block not in e.predictions]
    if missing:
        raise ConfigError(f"prediction block {block!r} is missing for experiment(s) {', '.join(missing)}")
    pred = [e.predictions[block] for e in experiments]
    ttft, e2e, loss = loss_terms([p[0] for p in pred], [p[1] for p in pred],
                                 [e.ttft_mean_ms for e in experiments], [e.e2e_mean_ms for e in experiments])
    return {"ttft_rmse": float(ttft), "e2e_rmse": float(e2e), "loss": float(loss), "n": len(experiments)}


# ------------------------------------------------------------------------------- loading


def _where(path: Any, field: str) -> str:
    return f"observed file {path}: {field}"


def _need(mapping: Mapping, key: str, path: Any, field: str) -> Any:
    if key not in mapping:
        raise ConfigError(f"{_where(path, field + '.' + key if field else key)} is missing")
    return mapping[key]


def _mapping(value: Any, path: Any, field: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_where(path, field)} must be a mapping, got {type(value).__name__}")
    return value


def _positive_number(value: Any, path: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{_where(path, field)} = {value!r} must be a finite number > 0")
    return float(value)


def _int(value: Any, path: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{_where(path, field)} = {value!r} must be an integer >= {minimum}")
    return value


def _text(value: Any, path: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{_where(path, field)} = {value!r} must be a non-empty string")
    return value


def _means(block: Any, path: Any, field: str) -> tuple[float, float]:
    block = _mapping(block, path, field)
    return (_positive_number(_need(block, "ttft_mean_ms", path, field), path, f"{field}.ttft_mean_ms"),
            _positive_number(_need(block, "e2e_mean_ms", path, field), path, f"{field}.e2e_mean_ms"))


def _experiment(raw: Any, path: Any, where: str) -> ObservedExperiment:
    raw = _mapping(raw, path, where)
    exp_id = _need(raw, "id", path, where)
    if isinstance(exp_id, bool) or not isinstance(exp_id, (str, int)) or not str(exp_id).strip():
        raise ConfigError(f"{_where(path, where + '.id')} = {exp_id!r} must be a non-empty string")
    exp_id = str(exp_id)
    cfg_where = f"{where}.config"
    cfg = _mapping(_need(raw, "config", path, where), path, cfg_where)
    observed = _mapping(_need(raw, "observed", path, where), path, f"{where}.observed")
    ttft, e2e = _means(observed, path, f"{where}.observed")
    output_len = observed.get("output_len_mean")
    if output_len is not None:
        output_len = _positive_number(output_len, path, f"{where}.observed.output_len_mean")
    predictions = {name: _means(raw[name], path, f"{where}.{name}") for name in PREDICTION_BLOCKS if name in raw}
    workload = _mapping(_need(cfg, "workload", path, cfg_where), path, f"{cfg_where}.workload")
    cpu = cfg.get("cpu_kv_blocks", 0)
    return ObservedExperiment(
        id=exp_id,
        model=_text(_need(cfg, "model", path, cfg_where), path, f"{cfg_where}.model"),
        hardware=_text(_need(cfg, "hardware", path, cfg_where), path, f"{cfg_where}.hardware"),
        tp=_int(_need(cfg, "tp", path, cfg_where), path, f"{cfg_where}.tp", 1),
        max_num_seqs=_int(_need(cfg, "max_num_seqs", path, cfg_where), path, f"{cfg_where}.max_num_seqs", 1),
        max_num_batched_tokens=_int(_need(cfg, "max_num_batched_tokens", path, cfg_where), path,
                                    f"{cfg_where}.max_num_batched_tokens", 1),
        total_kv_blocks=_int(_need(cfg, "total_kv_blocks", path, cfg_where), path, f"{cfg_where}.total_kv_blocks", 1),
        cpu_kv_blocks=_int(cpu, path, f"{cfg_where}.cpu_kv_blocks", 0),
        workload=dict(workload),
        ttft_mean_ms=ttft,
        e2e_mean_ms=e2e,
        predictions=predictions,
        output_len_mean=output_len,
    )


def parse_observed(data: Any, path: str = "<data>", sha256: str = "") -> ObservedSet:
    """Validate the decoded JSON of an observed file."""
    data = _mapping(data, path, "top level")
    raw = _need(data, "experiments", path, "")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{_where(path, 'experiments')} must be a non-empty list")
    experiments = tuple(_experiment(e, path, f"experiments[{i}]") for i, e in enumerate(raw))
    seen: dict[str, int] = {}
    for i, e in enumerate(experiments):
        if e.id in seen:
            raise ConfigError(f"{_where(path, f'experiments[{i}].id')} = {e.id!r} repeats experiments[{seen[e.id]}]")
        seen[e.id] = i
    stated = data.get("loss") or {}
    stated = _mapping(stated, path, "loss")
    return ObservedSet(path=str(path), sha256=sha256, experiments=experiments,
                       stated_loss={k: dict(v) for k, v in stated.items() if isinstance(v, Mapping)})


def load_observed(path: str | Path, flag: str = "--observed") -> ObservedSet:
    """Read and validate an observed file (trainval15.json format): a path, or the name of a
    bundled one (`synthetic-small`, from `configs/observed/`)."""
    path = Path(path)
    if not path.is_file():
        from blis_jax.config.bundled import bundled_dir

        bundled = bundled_dir("observed") / f"{path.name.removesuffix('.json')}.json"
        if path.parent != Path(".") or not bundled.is_file():
            raise ConfigError(f"{flag} {path}: file does not exist (bundled: "
                              f"{', '.join(p.stem for p in sorted(bundled_dir('observed').glob('*.json')))}; the 15 "
                              "real observed experiments are in ../shared/reference/observed/trainval15.json)")
        path = bundled
    text = read_text(path, f"{flag} {path}")
    blob = path.read_bytes()
    data = load_json_text(text, f"{flag} {path}")
    return parse_observed(data, str(path), hashlib.sha256(blob).hexdigest())
