"""Real request traces as observations: replay a real vLLM run as it arrived and compare it,
request by request, with what the server measured.

A *run folder* (``../shared/reference/observed/requests/<run>/``, see its README) holds a TraceV2
(`trace.yaml` + `trace.csv`: observed send time, prompt and output length, first/last chunk time,
status per request) and `case.json` (the engine config as `replay_args`, the load stages, the
observed summary). `load_run` turns one into the scenario `blis-jax replay` builds from those
flags (`scenario_config` reads them through a table of the flags the cases use, `REPLAY_FLAGS`),
with the requests grouped per prefix mode; `score_run` pairs the simulated requests
with the observed ones through `calibrate.pair_records` and `calibrate.compare`, so the figures
are those `blis-jax calibrate` reports, whole run and per load stage (`client_id` = ``stage-k``).

Prefix caching. The real server cached prompts (prefix caching on; prompt *i* = pool entry
*i* mod 100, each a group system prompt + a question, both repeating). The traces carry no
`prefix_group`, so a plain replay computes every prompt in full. `PREFIX_MODES`:

* ``prompt`` (default): request *i* is in group *i* mod pool (`pool_entries`: two requests
  sent swapped take each other's entry), whose shared prefix is the group's shortest prompt
  − 1 token (vLLM always computes at least the last prompt token): a repeat hits every full
  block of its prompt while it is still cached (the engine's LRU prefix cache decides);
* ``system``: 10 groups of consecutive pool entries share the configured system prompt only;
* ``none``: the trace as it is.

The loss of the issue (#22) is BLIS's fit loss on the run means, over the runs that were not
overloaded: sqrt(mean APE(mean TTFT)²) + sqrt(mean APE(mean E2E)²), in percent (`observed.
loss_terms`), with both means over the same paired requests.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from blis_jax import calibrate
from blis_jax.errors import ConfigError
from blis_jax.fit.observed import loss_terms
from blis_jax.naming import naming
from blis_jax.scenario import Deployment, EngineSettings, ResolvedScenario, ScenarioConfig, TraceWorkload
from blis_jax.scenario.resolve import Warn, replay_horizon, resolve_deployment
from blis_jax.workload.requests import NO_PREFIX_GROUP, RequestSet

PREFIX_MODES = ("prompt", "system", "none")
STATS = ("mean", "p50", "p90", "p99")
ALL = "all"  # the whole-run row, beside stage-0, stage-1, ...


# case.json `replay_args`: the `blis-jax replay` flags the cases use → (configuration field,
# value type). The trace files are the case's own (relative to its folder); --results-path is
# dropped (nothing is written).
REPLAY_FLAGS: dict[str, tuple[str, type]] = {
    "--model": ("deployment.model", str),
    "--hardware": ("deployment.hardware", str),
    "--tp": ("deployment.tp", int),
    "--latency-model": ("deployment.latency_model", str),
    "--max-num-seqs": ("engine.max_num_seqs", int),
    "--max-num-batched-tokens": ("engine.max_num_batched_tokens", int),
    "--total-kv-blocks": ("deployment.total_kv_blocks", int),
    "--trace-header": ("workload.header", Path),
    "--trace-data": ("workload.data", Path),
    "--results-path": ("", str),
}


@dataclasses.dataclass(frozen=True)
class RealRun:
    """One real run ready to replay: the resolved replay scenario (its requests carry the prefix
    groups of `prefix_mode`), the trace header as recorded and the observed records."""

    name: str
    folder: Path
    case: Mapping[str, Any]
    header: Any              # the trace's TraceHeader, as recorded
    scenario: ResolvedScenario
    observed: calibrate.ObservedRecords
    stage: np.ndarray        # str[N] load stage of each record (client_id), record order
    prefix_mode: str

    @property
    def requests(self) -> RequestSet:
        """What is simulated: the trace's requests with the prefix groups of `prefix_mode`."""
        return self.scenario.requests

    @property
    def overloaded(self) -> bool:
        """The real server failed requests (the reasoning run: client timeouts after 300 s)."""
        return int(self.case["observed"].get("errored", 0)) > 0


def run_folders(root: str | Path) -> list[Path]:
    """Every run folder (one with case.json, trace.yaml and trace.csv) under `root`, by name."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such folder; give the folder of real runs "
                          "(../shared/reference/observed/requests)")
    folders = sorted(p for p in root.iterdir()
                     if all((p / f).is_file() for f in ("case.json", "trace.yaml", "trace.csv")))
    if not folders:
        raise ConfigError(f"{root}: no run folder (with case.json, trace.yaml, trace.csv) inside")
    return folders


def prompt_pool(case: Mapping[str, Any]) -> tuple[int, int]:
    """(pool size, prompts per system-prompt group) of inference-perf's resolved shared_prefix."""
    resolved = case["workload"]["resolved_config_shared_prefix"]
    groups, per_group = int(resolved["num_groups"]), int(resolved["num_prompts_per_group"])
    return groups * per_group, per_group


def pool_entries(request_id: np.ndarray, input_len: np.ndarray, pool: int) -> np.ndarray:
    """The pool entry (prompt) of each request: request_id mod pool, except where two
    neighbours in send order were sent swapped. Such rows come in adjacent pairs whose lengths
    are each other's entry's usual length (±the same difference), so a row whose length is
    not its entry's most common one but is that of entry ± 1 takes that entry."""
    request_id, input_len = np.asarray(request_id, np.int64), np.asarray(input_len, np.int64)
    entry = request_id % pool
    usual = np.zeros(pool, dtype=np.int64)
    for k in np.unique(entry):
        lengths, counts = np.unique(input_len[entry == k], return_counts=True)
        usual[k] = lengths[np.argmax(counts)]
    out = entry.copy()
    for step in (1, -1):
        other = (entry + step) % pool
        moved = (input_len != usual[entry]) & (input_len == usual[other]) & (out == entry)
        out[moved] = other[moved]
    return out


def with_prefix_groups(requests: RequestSet, case: Mapping[str, Any], mode: str) -> RequestSet:
    """The requests with the prefix groups of `mode` (see the module docstring)."""
    if mode not in PREFIX_MODES:
        raise ConfigError(f"prefix mode {mode!r}: expected one of {', '.join(PREFIX_MODES)}")
    if mode == "none":
        return requests
    if np.any(requests.prefix_group != NO_PREFIX_GROUP):
        raise ConfigError("the trace already has prefix groups; replay it with prefix mode 'none'")
    pool, per_group = prompt_pool(case)
    entry = pool_entries(requests.request_id, requests.input_len, pool)
    if mode == "prompt":
        group = entry
        shortest = np.full(pool, np.iinfo(np.int64).max)
        np.minimum.at(shortest, group, requests.input_len)
        prefix = shortest[group] - 1
    else:
        group = entry // per_group
        system = int(case["workload"]["resolved_config_shared_prefix"]["system_prompt_len"])
        prefix = np.minimum(system, requests.input_len - 1)
    used, dense = np.unique(group, return_inverse=True)
    grouped = prefix > 0  # a 1-token prompt shares nothing
    return dataclasses.replace(
        requests, prefix_group=np.where(grouped, dense, NO_PREFIX_GROUP).astype(np.int32),
        prefix_len=np.where(grouped, prefix, 0), prefix_group_names=tuple(f"{mode}-{g}" for g in used))


def replay_fields(case: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """case.json's `replay_args` as {configuration field: value} (`REPLAY_FLAGS`); the trace
    paths are made relative to `folder`."""
    where = f"{folder / 'case.json'} replay_args"
    argv = case.get("replay_args")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"{where}: expected a list of `blis-jax replay` flags and values")
    fields: dict[str, Any] = {}
    for i in range(0, len(argv), 2):
        flag = argv[i]
        if flag not in REPLAY_FLAGS:
            raise ConfigError(f"{where}: unexpected flag {flag!r}; the real-trace cases use "
                              f"{', '.join(REPLAY_FLAGS)}")
        if i + 1 >= len(argv):
            raise ConfigError(f"{where}: {flag} has no value")
        field, kind = REPLAY_FLAGS[flag]
        text = argv[i + 1]
        if not field:
            continue
        if kind is int:
            try:
                value: Any = int(text)
            except ValueError:
                raise ConfigError(f"{where}: {flag} {text!r} is not an integer") from None
        else:
            value = folder / text if kind is Path else text
        fields[field] = value
    for field, flag in (("workload.header", "--trace-header"), ("workload.data", "--trace-data")):
        if field not in fields:
            raise ConfigError(f"{where}: {flag} is missing")
    return fields


def _section(fields: Mapping[str, Any], section: str) -> dict[str, Any]:
    return {path.split(".", 1)[1]: value for path, value in fields.items() if path.startswith(section + ".")}


def scenario_config(case: Mapping[str, Any], folder: str | Path, coefficients: str | Path) -> ScenarioConfig:
    """The scenario of `blis-jax replay <case.json replay_args> --coefficients FILE` run in `folder`."""
    fields = replay_fields(case, Path(folder))
    return ScenarioConfig(deployment=Deployment(**_section(fields, "deployment"), coefficients=coefficients),
                          engine=EngineSettings(**_section(fields, "engine")),
                          workload=TraceWorkload(**_section(fields, "workload")))


def load_run(folder: str | Path, coefficients: str | Path, *, prefix_mode: str = "prompt",
             warn: Warn | None = None) -> RealRun:
    """The run's scenario as `blis-jax replay <case.json replay_args> --coefficients FILE`
    resolves it, with the requests grouped per `prefix_mode` (`warn` as in `scenario.resolve`).
    Configuration errors name case.json's flags."""
    from blis_jax.workload.tracev2 import read_trace

    folder = Path(folder)
    try:
        case = json.loads((folder / "case.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{folder / 'case.json'}: cannot read ({e})") from e
    try:
        with naming({field: flag for flag, (field, _) in REPLAY_FLAGS.items() if field}):
            config = scenario_config(case, folder, coefficients)
            header, requests = read_trace(config.workload.header, config.workload.data)
            simulated = with_prefix_groups(requests, case, prefix_mode)
            deployment = resolve_deployment(config, horizon_us=replay_horizon(config.horizon_us, simulated), warn=warn)
    except ConfigError as e:
        raise ConfigError(f"real run {folder.name}: {e}") from None
    observed = calibrate.observed_from_trace(requests, source=f"{folder / 'trace.csv'}")
    # as `replay` resolves the trace (scenario.resolve), with the grouped requests
    scenario = dataclasses.replace(deployment, requests=simulated, header=dataclasses.replace(header, mode="replayed"),
                                   goodput_targets=header.goodput_slo_targets)
    return RealRun(name=folder.name, folder=folder, case=case, header=header, scenario=scenario,
                   observed=observed, stage=np.asarray(requests.client_id, dtype=str), prefix_mode=prefix_mode)


def export_trace(run: RealRun, prefix: str | Path) -> tuple[Path, Path]:
    """Write the run as simulated (with its prefix groups) and as observed (chunk times and
    status unchanged) to `<prefix>.yaml` / `<prefix>.csv`: `blis-jax replay` of these files with
    the case's other flags simulates what the benchmark does, and `blis-jax calibrate` of them
    against its `--results-path` gives the benchmark's whole-run figures."""
    from blis_jax.workload.tracev2 import write_trace

    return write_trace(prefix, run.header, run.requests)


def lane(run: RealRun):
    """The run as a lane of the sweep's batch runner (`sweep.batch.run_lanes`): the engine
    `simulate_instance` runs for `replay`, with the running batch sized at max-num-seqs."""
    from blis_jax.sweep.lane import InstanceLane

    s = run.scenario
    return InstanceLane(requests=s.requests, params=s.params, model=s.latency_model,
                        block_size=s.block_size, scheduler=s.scheduler, preemption_policy=s.preemption_policy,
                        batch_start=None)


def sim_results(out, requests: RequestSet) -> calibrate.SimResults:
    """The completed requests of a SimOutput, as `replay --results-path` lists them."""
    done = np.flatnonzero(np.asarray(out.completed_mask()))
    return calibrate.SimResults(
        request_id=np.asarray(requests.request_id[done], dtype=np.int64),
        ttft_us=np.asarray(out.ttft_us, dtype=np.float64)[done],
        e2e_us=np.asarray(out.e2e_us, dtype=np.float64)[done],
        input_tokens=np.asarray(requests.input_len[done], dtype=np.int64),
        output_tokens=np.asarray(out.output_tokens, dtype=np.int64)[done])


# ------------------------------------------------------------------------------ scoring


def _row(real: Mapping[str, np.ndarray], sim: Mapping[str, np.ndarray], observed_ok: int) -> dict[str, Any]:
    """Observed vs simulated statistics (ms) and per-request MAPE (%) of one set of pairs."""
    row: dict[str, Any] = {"observed_ok": observed_ok, "pairs": int(len(real["ttft"]))}
    for metric in calibrate.METRICS:
        if len(real[metric]) == 0:
            continue
        c = calibrate.compare(real[metric], sim[metric])
        for stat in STATS:
            row[f"{metric}_{stat}_obs_ms"] = c[f"real_{stat}_us"] / 1000.0
            row[f"{metric}_{stat}_sim_ms"] = c[f"sim_{stat}_us"] / 1000.0
        row[f"{metric}_mean_ape_pct"] = 100.0 * abs(c["sim_mean_us"] - c["real_mean_us"]) / c["real_mean_us"]
        row[f"{metric}_mape_pct"] = None if c["mape"] is None else 100.0 * c["mape"]
        row[f"{metric}_pearson_r"] = c["pearson_r"]
    return row


def score_pairs(pairs: calibrate.CalibrationPairs, observed: calibrate.ObservedRecords, stage: np.ndarray,
                *, skip_first_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Rows keyed `all`, `stage-0`, ...: the pairs (and observed ok records) of requests sent at
    least `skip_first_s` after the run's first send."""
    start = int(observed.send_us.min()) + round(skip_first_s * 1e6)
    kept_ids = observed.request_id[observed.send_us >= start]
    stage_of = dict(zip(observed.request_id.tolist(), stage.tolist()))
    keep = np.isin(pairs.request_id, kept_ids)
    pair_stage = np.array([stage_of[int(r)] for r in pairs.request_id], dtype=str)
    ok_kept = observed.ok & (observed.send_us >= start)
    rows = {ALL: _row({m: pairs.real[m][keep] for m in calibrate.METRICS},
                      {m: pairs.sim[m][keep] for m in calibrate.METRICS}, int(ok_kept.sum()))}
    for name in sorted(set(stage.tolist())):
        sel = keep & (pair_stage == name)
        rows[name] = _row({m: pairs.real[m][sel] for m in calibrate.METRICS},
                          {m: pairs.sim[m][sel] for m in calibrate.METRICS}, int((ok_kept & (stage == name)).sum()))
    return rows


def cache_fill_step(pairs: calibrate.CalibrationPairs, pool: int) -> dict[str, float] | None:
    """Mean TTFT (ms) of requests pool/2 .. pool−1 (each prompt's first use: a prefix-cache
    miss) minus that of requests pool .. 3·pool/2 − 1 (its first repeat), observed and
    simulated: the step a cached prompt pool makes at request `pool`, whatever the time."""
    before = (pairs.request_id >= pool // 2) & (pairs.request_id < pool)
    after = (pairs.request_id >= pool) & (pairs.request_id < pool + pool // 2)
    if not before.any() or not after.any():
        return None
    return {side: float(values["ttft"][before].mean() - values["ttft"][after].mean()) / 1000.0
            for side, values in (("obs_ms", pairs.real), ("sim_ms", pairs.sim))}


def score_run(run: RealRun, sim: calibrate.SimResults, *, skip_first_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Rows keyed `all`, `stage-0`, ... (see `score_pairs`); the `all` row also carries how
    many of the run's requests the simulation completed and the cache-fill step
    (`cache_fill_step`, over every pair)."""
    pairs = calibrate.pair_records(run.observed, sim)
    rows = score_pairs(pairs, run.observed, run.stage, skip_first_s=skip_first_s)
    rows[ALL]["sim_completed"] = int(np.isin(sim.request_id, run.observed.request_id).sum())
    rows[ALL]["ttft_cache_fill_step"] = cache_fill_step(pairs, prompt_pool(run.case)[0])
    return rows


def real_trace_loss(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The issue's loss over whole-run rows (the non-overloaded runs): TTFT RMSE + E2E RMSE of
    the APE of the means (%), plus the mean over runs of the per-request MAPEs (%)."""
    if not rows:
        raise ConfigError("no run to score: the loss is over the runs that were not overloaded")
    if any(r["pairs"] == 0 for r in rows):
        raise ConfigError("a run has no simulated request to pair with its observations")
    ttft, e2e, loss = loss_terms([r["ttft_mean_sim_ms"] for r in rows], [r["e2e_mean_sim_ms"] for r in rows],
                                 [r["ttft_mean_obs_ms"] for r in rows], [r["e2e_mean_obs_ms"] for r in rows])
    return {"ttft_rmse": float(ttft), "e2e_rmse": float(e2e), "loss": float(loss), "n": len(rows),
            "ttft_mape": float(np.mean([r["ttft_mape_pct"] for r in rows])),
            "e2e_mape": float(np.mean([r["e2e_mape_pct"] for r in rows]))}


# ------------------------------------------------------------------------- fit observations


def observed_means_ms(run: RealRun) -> tuple[float, float]:
    """Mean observed TTFT and E2E (ms) over the run's successful requests."""
    o = run.observed
    return (float((o.first_chunk_us - o.send_us)[o.ok].mean()) / 1000.0,
            float((o.last_chunk_us - o.send_us)[o.ok].mean()) / 1000.0)


def fit_observation(run: RealRun):
    """The run as an observation of `blis-jax fit` (`fit.Prepared`): simulated as it arrived
    (the requests and scenario of `load_run`), scored on the run means, the observation type
    whose loss term is the issue-22 loss (`real_trace_loss`: APE of the means over the paired
    requests, which are all of them when the run was not overloaded). An overloaded run's
    means cover only the requests that beat the client timeout, so it is refused."""
    from blis_jax.fit.fit import Prepared
    from blis_jax.fit.observed import ObservedExperiment

    if run.overloaded:
        raise ConfigError(f"real run {run.name}: {run.case['observed'].get('errored')} requests failed (overloaded); "
                          "its observed means cover only the requests that beat the client timeout, so it "
                          "cannot be fitted on its means")
    ttft, e2e = observed_means_ms(run)
    s, c = run.scenario, run.case
    obs = ObservedExperiment(id=run.name, model=str(c["model"]), hardware=s.hardware, tp=s.tp,
                             max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                             total_kv_blocks=s.total_kv_blocks, cpu_kv_blocks=int(c.get("cpu_kv_blocks", 0)),
                             workload={}, ttft_mean_ms=ttft, e2e_mean_ms=e2e, predictions={})
    return Prepared(obs=obs, scenario=s)


def summary_id(run: RealRun) -> str | None:
    """The id of the same run in trainval15.json (`case.json` summary_reference), if any."""
    ref = run.case.get("summary_reference") or {}
    return ref.get("id")
