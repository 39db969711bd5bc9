"""Workload spec v2 (`--workload-spec FILE.yaml`, spec §4.3): schema, strict loading, validation.

A spec is plain data: frozen dataclasses mirroring BLIS's YAML keys one to one, so
`spec_to_dict(load_spec(p))` writes back an equivalent file. Loading is strict — unknown keys,
duplicate keys, wrong types and impossible values raise one `ConfigError` whose message starts
with the key path (`clients[2].arrival.cv: ...`) and says how to fix it.

v1 specs (`version: "1"` or no version) are upgraded on load: SLO classes `realtime` →
`critical`, `interactive` → `standard`.

Sessions are part of the schema (`reasoning.multi_turn`, `closed_loop`, `concurrency`,
`think_time_us`) and validated here; `generate.py` says what is generated from them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from blis_jax import limits
from blis_jax.errors import ConfigError
from blis_jax.io_safety import check_yaml_shape, load_json_text, read_text, short, summarise, clip, yaml_problem
from blis_jax.workload.arrivals import check_arrival
from blis_jax.workload.lengths import make_length

SPEC_VERSIONS = ("1", "2")
SLO_CLASSES = ("critical", "standard", "sheddable", "batch", "background", "")
V1_SLO_UPGRADE: Mapping[str, str] = MappingProxyType({"realtime": "critical", "interactive": "standard"})
CATEGORIES = ("language", "multimodal", "reasoning", "")
CONTEXT_GROWTH = ("accumulate", "")
PREFIX_SHARING = ("shared", "per_member")
# inference_perf.multi_turn_mode (blis-jax extension; see workload/inference_perf.py)
MULTI_TURN_MODES = ("closed-loop", "open-loop")
GOODPUT_DIMENSIONS = ("ttft_ms", "itl_ms", "e2e_ms")
DEFAULT_PREFIX_LENGTH = 50
MAX_COHORT_POPULATION = 100_000
DEFAULT_SEED = 42


# ----------------------------------------------------------------------------- schema


@dataclasses.dataclass(frozen=True)
class DistSpec:
    """A length distribution `{type, params, file}`. `file` (empirical only) is kept as
    written; its mapping is loaded into `params` at load time."""

    type: str
    params: Mapping[str, float] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    file: str | None = None


@dataclasses.dataclass(frozen=True)
class ArrivalSpec:
    process: str = "poisson"
    cv: float | None = None
    shape: float | None = None
    scale: float | None = None   # µs


@dataclasses.dataclass(frozen=True)
class WindowSpec:
    """Lifecycle window [start_us, end_us) with optional per-window overrides."""

    start_us: int
    end_us: int
    trace_rate: float | None = None
    arrival: ArrivalSpec | None = None
    input_distribution: DistSpec | None = None
    output_distribution: DistSpec | None = None

    @property
    def has_overrides(self) -> bool:
        return (self.trace_rate is not None or self.arrival is not None
                or self.input_distribution is not None or self.output_distribution is not None)


@dataclasses.dataclass(frozen=True)
class LifecycleSpec:
    windows: tuple[WindowSpec, ...] = ()


@dataclasses.dataclass(frozen=True)
class MultiTurnSpec:
    max_rounds: int
    think_time_us: int = 0
    context_growth: str = ""
    single_session: bool = False


@dataclasses.dataclass(frozen=True)
class ReasoningSpec:
    reason_ratio_distribution: DistSpec | None = None
    multi_turn: MultiTurnSpec | None = None


@dataclasses.dataclass(frozen=True)
class MultimodalSpec:
    text_distribution: DistSpec | None = None
    image_distribution: DistSpec | None = None
    image_count_distribution: DistSpec | None = None
    audio_distribution: DistSpec | None = None
    audio_count_distribution: DistSpec | None = None
    video_distribution: DistSpec | None = None
    video_count_distribution: DistSpec | None = None


@dataclasses.dataclass(frozen=True)
class NetworkSpec:
    rtt_ms: float | None = None
    bandwidth_mbps: float | None = None


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """One client: rate-based (`rate_fraction` > 0) or closed-loop users (`concurrency`)."""

    id: str = ""
    tenant_id: str = ""
    slo_class: str = ""
    model: str = ""
    adapter: str = ""
    rate_fraction: float | None = None
    concurrency: int | None = None
    think_time_us: int | None = None
    arrival: ArrivalSpec | None = None
    input_distribution: DistSpec | None = None
    output_distribution: DistSpec | None = None
    prefix_group: str = ""
    prefix_length: int | None = None
    streaming: bool = False
    network: NetworkSpec | None = None
    lifecycle: LifecycleSpec | None = None
    multimodal: MultimodalSpec | None = None
    reasoning: ReasoningSpec | None = None
    timeout: int | None = None          # µs; None → 300 s for session clients, none otherwise; 0 → none
    slo_target_us: int | None = None
    closed_loop: bool | None = None     # None → true for multi-turn clients

    @property
    def multi_turn(self) -> MultiTurnSpec | None:
        return self.reasoning.multi_turn if self.reasoning is not None else None

    @property
    def is_session_client(self) -> bool:
        return self.multi_turn is not None or self.concurrency is not None

    @property
    def is_closed_loop(self) -> bool:
        """Follow-ups depend on completions: concurrency users, or multi-turn not marked open-loop."""
        return self.concurrency is not None or (self.multi_turn is not None and self.closed_loop is not False)


@dataclasses.dataclass(frozen=True)
class DiurnalSpec:
    peak_hour: float
    peak_to_trough_ratio: float


@dataclasses.dataclass(frozen=True)
class SpikeSpec:
    start_time_us: int
    duration_us: int
    trace_rate: float


@dataclasses.dataclass(frozen=True)
class DrainSpec:
    start_time_us: int
    ramp_duration_us: int


@dataclasses.dataclass(frozen=True)
class CohortSpec:
    """`population` identical clients `<id>-<j>`, each with rate_fraction/population."""

    id: str
    population: int
    tenant_id: str = ""
    slo_class: str = ""
    model: str = ""
    adapter: str = ""
    rate_fraction: float | None = None
    arrival: ArrivalSpec | None = None
    input_distribution: DistSpec | None = None
    output_distribution: DistSpec | None = None
    prefix_group: str = ""
    prefix_sharing: str = "shared"
    prefix_length: int | None = None
    streaming: bool = False
    diurnal: DiurnalSpec | None = None
    spike: SpikeSpec | None = None
    drain: DrainSpec | None = None
    reasoning: ReasoningSpec | None = None
    closed_loop: bool | None = None
    timeout: int | None = None
    slo_target_us: int | None = None
    network: NetworkSpec | None = None
    multimodal: MultimodalSpec | None = None


@dataclasses.dataclass(frozen=True)
class StageSpec:
    rate: float          # req/s
    duration: float      # s


@dataclasses.dataclass(frozen=True)
class SharedPrefixSpec:
    num_unique_system_prompts: int
    num_users_per_system_prompt: int
    system_prompt_len: int
    question_len: int
    output_len: int
    enable_multi_turn_chat: bool = False


@dataclasses.dataclass(frozen=True)
class InferencePerfSpec:
    stages: tuple[StageSpec, ...]
    shared_prefix: SharedPrefixSpec
    # blis-jax extension: how multi-turn chat is generated. "closed-loop" (BLIS, default): each
    # user's next round arrives a think time after its previous round completes; "open-loop":
    # every request arrives as a Poisson process at the stage rate (inference-perf's generator).
    multi_turn_mode: str = "closed-loop"


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    version: str = "2"
    seed: int | None = None
    category: str = ""
    aggregate_rate: float = 0.0        # req/s; 0 → absolute-rate mode (trace_rate windows)
    num_requests: int = 0              # 0 → bounded by the horizon / lifecycles only
    horizon: int | None = None         # µs
    clients: tuple[ClientSpec, ...] = ()
    cohorts: tuple[CohortSpec, ...] = ()
    servegen_data: Mapping[str, Any] | None = None
    inference_perf: InferencePerfSpec | None = None
    goodput_slo_targets: Mapping[str, Mapping[str, float]] | None = None

    @property
    def absolute_rate_mode(self) -> bool:
        return self.aggregate_rate == 0


# ---------------------------------------------------------------------------- loading


MAX_NUMBER = 2.0**53  # larger reals in a spec are typos (and overflow int64 once rounded to tokens or µs)
CLIENT_BYTES = 4096  # host memory of one expanded client


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (Go's strict YAML does) and keeps timestamps
    as strings."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in out:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}; "
                              "each key may appear once per mapping")
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def load_yaml(text: str, source: str = "spec") -> Any:
    """Strict YAML → Python (duplicate keys are errors; nesting depth and alias expansion
    bounded, see io_safety.check_yaml_shape)."""
    check_yaml_shape(text, source)
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML ({yaml_problem(e)})") from e
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def load_spec(path: str | Path) -> WorkloadSpec:
    """Read, parse and validate a workload spec file."""
    path = Path(path)
    text = read_text(path, f"--workload-spec {path}")
    raw = load_yaml(text, f"--workload-spec {path}")
    try:
        return parse_spec(raw, base_dir=path.parent)
    except ConfigError as e:
        raise ConfigError(f"--workload-spec {path}: {e}") from e


def parse_spec(raw: Any, base_dir: str | Path | None = None) -> WorkloadSpec:
    """Mapping (parsed YAML) or WorkloadSpec → validated WorkloadSpec.

    `base_dir` resolves relative `file:` paths of empirical distributions (default: cwd).
    """
    if isinstance(raw, WorkloadSpec):
        return validate_spec(raw)
    return validate_spec(_Parser(Path(base_dir) if base_dir is not None else Path.cwd()).spec(raw))


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _type_name(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    return {list: "a list", str: "a string", bool: "a boolean",
            type(None): "nothing"}.get(type(value), type(value).__name__)


class _Parser:
    """Raw YAML values → schema dataclasses; every error names the key path."""

    def __init__(self, base_dir: Path):
        self.base_dir = base_dir

    # -- primitives

    @staticmethod
    def mapping(raw: Any, path: str, cls_or_keys) -> dict:
        keys = ([f.name for f in dataclasses.fields(cls_or_keys)]
                if dataclasses.is_dataclass(cls_or_keys) else list(cls_or_keys))
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path or 'spec'}: expected a mapping with keys {', '.join(keys)}; "
                              f"got {_type_name(raw)}")
        for key in raw:
            if key not in keys:
                raise ConfigError(f"{_join(path, clip(key, 30))}: unknown key; known keys here: "
                                  f"{summarise(list(keys), 'keys', 'see the workload spec reference')}")
        return dict(raw)

    @staticmethod
    def number(raw: Any, path: str, *, minimum: float | None = None, positive: bool = False) -> float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {_type_name(raw)} {short(raw)}")
        try:
            value = float(raw)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value) or abs(value) > MAX_NUMBER:
            raise ConfigError(f"{path}: {short(raw)} must be a finite number of at most {MAX_NUMBER:.3g}")
        if positive and value <= 0:
            raise ConfigError(f"{path}: {raw!r} must be > 0")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{path}: {raw!r} must be ≥ {minimum:g}")
        return value

    @staticmethod
    def integer(raw: Any, path: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or \
                (isinstance(raw, float) and (not math.isfinite(raw) or not raw.is_integer())):
            raise ConfigError(f"{path}: expected an integer, got {_type_name(raw)} {short(raw)}")
        value = int(raw)
        if minimum is not None and value < minimum:
            raise ConfigError(f"{path}: {short(value)} must be ≥ {minimum}")
        key = path.rsplit(".", 1)[-1]
        if maximum is None:  # times and token counts keep the engine's int64 sums exact (limits.py)
            maximum = (limits.MAX_TIME_US if key.endswith("_us") or key in ("horizon", "timeout") else
                       limits.MAX_TOKENS if key.endswith("_len") or key.endswith("_length") else limits.INT64_MAX)
        if value > maximum or value < -limits.INT64_MAX - 1:
            raise ConfigError(f"{path}: {short(value)} is beyond the limit of {maximum:,}")
        return value

    @staticmethod
    def string(raw: Any, path: str) -> str:
        if raw is None:
            return ""
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise ConfigError(f"{path}: expected a string, got {_type_name(raw)}")
        return str(raw)

    @staticmethod
    def boolean(raw: Any, path: str) -> bool:
        if not isinstance(raw, bool):
            raise ConfigError(f"{path}: expected true or false, got {raw!r}")
        return raw

    @staticmethod
    def choice(raw: Any, path: str, options: Sequence[str]) -> str:
        value = _Parser.string(raw, path)
        if value not in options:
            shown = ", ".join(repr(o) if o == "" else o for o in options)
            raise ConfigError(f"{path}: {value!r} is not one of {shown}")
        return value

    @staticmethod
    def opt(d: dict, key: str, path: str, fn, *args, **kwargs):
        value = d.get(key)
        return None if value is None else fn(value, _join(path, key), *args, **kwargs)

    @staticmethod
    def seq(raw: Any, path: str) -> list:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise ConfigError(f"{path}: expected a list, got {_type_name(raw)}")
        return raw

    @staticmethod
    def required(d: dict, path: str, keys: Sequence[str], what: str) -> None:
        for key in keys:
            if key not in d:
                raise ConfigError(f"{_join(path, key)}: missing; {what} needs {', '.join(keys)}")

    # -- pieces

    def dist(self, raw: Any, path: str) -> DistSpec:
        d = self.mapping(raw, path, DistSpec)
        if "type" not in d:
            raise ConfigError(f"{_join(path, 'type')}: missing; give one of gaussian, exponential, "
                              "lognormal, pareto_lognormal, empirical, constant")
        dist_type = self.string(d["type"], _join(path, "type"))
        file = self.opt(d, "file", path, self.string)
        params_raw = d.get("params") or {}
        if not isinstance(params_raw, Mapping):
            raise ConfigError(f"{_join(path, 'params')}: expected a mapping of parameter: number")
        if file is not None:
            if dist_type != "empirical":
                raise ConfigError(f"{_join(path, 'file')}: only empirical distributions read a file; "
                                  "put the parameters under params")
            if params_raw:
                raise ConfigError(f"{_join(path, 'file')}: give either file or params, not both")
            params_raw = self._read_empirical(file, _join(path, "file"))
        params = {str(k): self.number(v, _join(_join(path, "params"), str(k))) for k, v in params_raw.items()}
        make_length(dist_type, params, path)    # validates the type and every parameter
        return DistSpec(dist_type, MappingProxyType(params), file)

    def _read_empirical(self, file: str, path: str) -> Mapping:
        full = Path(file) if Path(file).is_absolute() else self.base_dir / file
        text = read_text(full, f"{path}: {full}")
        data = load_json_text(text, f"{path}: {full}") if full.suffix == ".json" else load_yaml(text, str(full))
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: {full} must hold a mapping of \"<tokens>\": probability")
        return data

    def arrival(self, raw: Any, path: str) -> ArrivalSpec:
        d = self.mapping(raw, path, ArrivalSpec)
        if "process" not in d:
            raise ConfigError(f"{_join(path, 'process')}: missing; use poisson, gamma, weibull or constant")
        spec = ArrivalSpec(process=self.string(d["process"], _join(path, "process")),
                           cv=self.opt(d, "cv", path, self.number),
                           shape=self.opt(d, "shape", path, self.number),
                           scale=self.opt(d, "scale", path, self.number))
        check_arrival(spec.process, spec.cv, spec.shape, spec.scale, path)
        return spec

    def window(self, raw: Any, path: str) -> WindowSpec:
        d = self.mapping(raw, path, WindowSpec)
        self.required(d, path, ("start_us", "end_us"), "a window [start_us, end_us) in µs")
        start = self.integer(d["start_us"], _join(path, "start_us"), minimum=0)
        end = self.integer(d["end_us"], _join(path, "end_us"))
        if end <= start:
            raise ConfigError(f"{_join(path, 'end_us')}: {end} must be > start_us ({start})")
        return WindowSpec(start, end,
                          trace_rate=self.opt(d, "trace_rate", path, self.number, minimum=0),
                          arrival=self.opt(d, "arrival", path, self.arrival),
                          input_distribution=self.opt(d, "input_distribution", path, self.dist),
                          output_distribution=self.opt(d, "output_distribution", path, self.dist))

    def lifecycle(self, raw: Any, path: str) -> LifecycleSpec:
        d = self.mapping(raw, path, LifecycleSpec)
        wpath = _join(path, "windows")
        windows = tuple(self.window(w, _join(wpath, i)) for i, w in enumerate(self.seq(d.get("windows"), wpath)))
        if not windows:
            raise ConfigError(f"{wpath}: empty; give at least one window, or drop lifecycle for an "
                              "always-on client")
        for i in range(1, len(windows)):
            if windows[i].start_us < windows[i - 1].end_us:
                raise ConfigError(f"{_join(wpath, i)}.start_us: {windows[i].start_us} is before the end of "
                                  f"windows[{i - 1}] ({windows[i - 1].end_us}); windows must be in time "
                                  "order and must not overlap")
        return LifecycleSpec(windows)

    def multi_turn(self, raw: Any, path: str) -> MultiTurnSpec:
        d = self.mapping(raw, path, MultiTurnSpec)
        self.required(d, path, ("max_rounds",), "multi_turn")
        return MultiTurnSpec(
            max_rounds=self.integer(d["max_rounds"], _join(path, "max_rounds"), minimum=1),
            think_time_us=self.opt(d, "think_time_us", path, self.integer, minimum=0) or 0,
            context_growth=self.choice(d.get("context_growth", ""), _join(path, "context_growth"), CONTEXT_GROWTH),
            single_session=self.opt(d, "single_session", path, self.boolean) or False)

    def reasoning(self, raw: Any, path: str) -> ReasoningSpec:
        d = self.mapping(raw, path, ReasoningSpec)
        return ReasoningSpec(reason_ratio_distribution=self.opt(d, "reason_ratio_distribution", path, self.dist),
                             multi_turn=self.opt(d, "multi_turn", path, self.multi_turn))

    def multimodal(self, raw: Any, path: str) -> MultimodalSpec:
        d = self.mapping(raw, path, MultimodalSpec)
        return MultimodalSpec(**{k: self.opt(d, k, path, self.dist) for k in d})

    def network(self, raw: Any, path: str) -> NetworkSpec:
        d = self.mapping(raw, path, NetworkSpec)
        return NetworkSpec(rtt_ms=self.opt(d, "rtt_ms", path, self.number, minimum=0),
                           bandwidth_mbps=self.opt(d, "bandwidth_mbps", path, self.number, minimum=0))

    def _common(self, d: dict, path: str) -> dict:
        """Fields that clients and cohorts share."""
        return {
            "tenant_id": self.string(d.get("tenant_id"), _join(path, "tenant_id")),
            "slo_class": self.string(d.get("slo_class"), _join(path, "slo_class")),
            "model": self.string(d.get("model"), _join(path, "model")),
            "adapter": self.string(d.get("adapter"), _join(path, "adapter")),
            "rate_fraction": self.opt(d, "rate_fraction", path, self.number),
            "arrival": self.opt(d, "arrival", path, self.arrival),
            "input_distribution": self.opt(d, "input_distribution", path, self.dist),
            "output_distribution": self.opt(d, "output_distribution", path, self.dist),
            "prefix_group": self.string(d.get("prefix_group"), _join(path, "prefix_group")),
            "prefix_length": self.opt(d, "prefix_length", path, self.integer, minimum=0),
            "streaming": self.opt(d, "streaming", path, self.boolean) or False,
            "network": self.opt(d, "network", path, self.network),
            "multimodal": self.opt(d, "multimodal", path, self.multimodal),
            "reasoning": self.opt(d, "reasoning", path, self.reasoning),
            "timeout": self.opt(d, "timeout", path, self.integer, minimum=0),
            "slo_target_us": self.opt(d, "slo_target_us", path, self.integer, minimum=0),
            "closed_loop": self.opt(d, "closed_loop", path, self.boolean)}

    def client(self, raw: Any, path: str) -> ClientSpec:
        d = self.mapping(raw, path, ClientSpec)
        return ClientSpec(id=self.string(d.get("id"), _join(path, "id")),
                          concurrency=self.opt(d, "concurrency", path, self.integer, minimum=1),
                          think_time_us=self.opt(d, "think_time_us", path, self.integer, minimum=0),
                          lifecycle=self.opt(d, "lifecycle", path, self.lifecycle),
                          **self._common(d, path))

    def cohort(self, raw: Any, path: str) -> CohortSpec:
        d = self.mapping(raw, path, CohortSpec)
        self.required(d, path, ("id", "population"), "a cohort")
        return CohortSpec(
            id=self.string(d["id"], _join(path, "id")),
            population=self.integer(d["population"], _join(path, "population"), minimum=1),
            prefix_sharing=self.choice(d.get("prefix_sharing", "shared"), _join(path, "prefix_sharing"),
                                       PREFIX_SHARING),
            diurnal=self.opt(d, "diurnal", path, self.diurnal),
            spike=self.opt(d, "spike", path, self.spike),
            drain=self.opt(d, "drain", path, self.drain),
            **self._common(d, path))

    def diurnal(self, raw: Any, path: str) -> DiurnalSpec:
        d = self.mapping(raw, path, DiurnalSpec)
        self.required(d, path, ("peak_hour", "peak_to_trough_ratio"), "diurnal")
        peak = self.number(d["peak_hour"], _join(path, "peak_hour"), minimum=0)
        if peak >= 24:
            raise ConfigError(f"{_join(path, 'peak_hour')}: {peak:g} must be in [0, 24)")
        ratio = self.number(d["peak_to_trough_ratio"], _join(path, "peak_to_trough_ratio"), minimum=1)
        return DiurnalSpec(peak, ratio)

    def spike(self, raw: Any, path: str) -> SpikeSpec:
        d = self.mapping(raw, path, SpikeSpec)
        self.required(d, path, ("start_time_us", "duration_us", "trace_rate"), "spike")
        return SpikeSpec(self.integer(d["start_time_us"], _join(path, "start_time_us"), minimum=0),
                         self.integer(d["duration_us"], _join(path, "duration_us"), minimum=1),
                         self.number(d["trace_rate"], _join(path, "trace_rate"), minimum=0))

    def drain(self, raw: Any, path: str) -> DrainSpec:
        d = self.mapping(raw, path, DrainSpec)
        self.required(d, path, ("start_time_us", "ramp_duration_us"), "drain")
        return DrainSpec(self.integer(d["start_time_us"], _join(path, "start_time_us"), minimum=0),
                         self.integer(d["ramp_duration_us"], _join(path, "ramp_duration_us"), minimum=1))

    def inference_perf(self, raw: Any, path: str) -> InferencePerfSpec:
        d = self.mapping(raw, path, InferencePerfSpec)
        self.required(d, path, ("stages", "shared_prefix"), "inference_perf")
        spath = _join(path, "stages")
        stages = []
        for i, s in enumerate(self.seq(d["stages"], spath)):
            sp = _join(spath, i)
            sd = self.mapping(s, sp, StageSpec)
            self.required(sd, sp, ("rate", "duration"), "a stage")
            stages.append(StageSpec(self.number(sd["rate"], _join(sp, "rate"), positive=True),
                                    self.number(sd["duration"], _join(sp, "duration"), positive=True)))
        if not stages:
            raise ConfigError(f"{spath}: empty; give at least one {{rate, duration}} stage")
        pp = _join(path, "shared_prefix")
        pd = self.mapping(d["shared_prefix"], pp, SharedPrefixSpec)
        ints = ("num_unique_system_prompts", "num_users_per_system_prompt", "system_prompt_len",
                "question_len", "output_len")
        self.required(pd, pp, ints, "shared_prefix")
        values = {k: self.integer(pd[k], _join(pp, k), minimum=0 if k == "system_prompt_len" else 1)
                  for k in ints}
        limits.check_size(f"{pp}: clients (system prompts x users)",
                          values["num_unique_system_prompts"] * values["num_users_per_system_prompt"],
                          CLIENT_BYTES, "lower them")
        multi = self.opt(pd, "enable_multi_turn_chat", pp, self.boolean) or False
        mode = self.opt(d, "multi_turn_mode", path, self.choice, MULTI_TURN_MODES) or MULTI_TURN_MODES[0]
        if mode != MULTI_TURN_MODES[0] and not multi:
            raise ConfigError(f"{_join(path, 'multi_turn_mode')}: {mode!r} applies to multi-turn chat only; set "
                              f"{_join(pp, 'enable_multi_turn_chat')}: true or drop multi_turn_mode (single-turn "
                              "stages are open-loop already)")
        return InferencePerfSpec(tuple(stages), SharedPrefixSpec(**values, enable_multi_turn_chat=multi),
                                 multi_turn_mode=mode)

    def goodput(self, raw: Any, path: str) -> Mapping[str, Mapping[str, float]]:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path}: expected {{class: {{ttft_ms, itl_ms, e2e_ms}}}}")
        out = {}
        for cls, dims in raw.items():
            cpath = _join(path, str(cls))
            dd = self.mapping(dims, cpath, GOODPUT_DIMENSIONS)
            out[str(cls)] = MappingProxyType({k: self.number(v, _join(cpath, k), positive=True)
                                              for k, v in dd.items()})
        return MappingProxyType(out)

    # -- top level

    def spec(self, raw: Any) -> WorkloadSpec:
        d = self.mapping(raw, "", WorkloadSpec)
        version = "1" if d.get("version") is None else self.string(d["version"], "version")
        if version not in SPEC_VERSIONS:
            raise ConfigError(f"version: {version!r} is not supported; use \"2\" (or \"1\", upgraded on load)")
        servegen = d.get("servegen_data")
        if servegen is not None and not isinstance(servegen, Mapping):
            raise ConfigError("servegen_data: expected a mapping")
        spec = WorkloadSpec(
            version=version,
            seed=self.opt(d, "seed", "", self.integer, maximum=limits.MAX_SEED),
            category=self.choice(d.get("category", ""), "category", CATEGORIES),
            aggregate_rate=self.opt(d, "aggregate_rate", "", self.number, minimum=0) or 0.0,
            num_requests=self.opt(d, "num_requests", "", self.integer, minimum=0) or 0,
            horizon=self.opt(d, "horizon", "", self.integer, minimum=0) or None,
            clients=tuple(self.client(c, f"clients[{i}]")
                          for i, c in enumerate(self.seq(d.get("clients"), "clients"))),
            cohorts=tuple(self.cohort(c, f"cohorts[{i}]")
                          for i, c in enumerate(self.seq(d.get("cohorts"), "cohorts"))),
            servegen_data=None if servegen is None else MappingProxyType(dict(servegen)),
            inference_perf=self.opt(d, "inference_perf", "", self.inference_perf),
            goodput_slo_targets=self.opt(d, "goodput_slo_targets", "", self.goodput))
        return upgrade_v1(spec) if version == "1" else spec


def upgrade_v1(spec: WorkloadSpec) -> WorkloadSpec:
    """v1 → v2: SLO classes `realtime` → `critical`, `interactive` → `standard`."""
    def up(x):
        return dataclasses.replace(x, slo_class=V1_SLO_UPGRADE.get(x.slo_class, x.slo_class))
    return dataclasses.replace(spec, version="2", clients=tuple(up(c) for c in spec.clients),
                               cohorts=tuple(up(c) for c in spec.cohorts))


# ------------------------------------------------------------------------- validation


def validate_spec(spec: WorkloadSpec) -> WorkloadSpec:
    """Cross-field rules of spec §4.3; returns `spec` or raises ConfigError naming the key."""
    members = [(f"clients[{i}]", c) for i, c in enumerate(spec.clients)] + \
              [(f"cohorts[{i}]", c) for i, c in enumerate(spec.cohorts)]
    for path, c in members:
        if c.slo_class not in SLO_CLASSES:
            raise ConfigError(f"{path}.slo_class: {c.slo_class!r} is not an SLO class; use one of "
                              f"{', '.join(s for s in SLO_CLASSES if s)}")
    if spec.inference_perf is not None:
        for key, present in (("clients", bool(spec.clients)), ("cohorts", bool(spec.cohorts)),
                             ("aggregate_rate", spec.aggregate_rate != 0),
                             ("servegen_data", spec.servegen_data is not None)):
            if present:
                raise ConfigError(f"{key}: cannot be combined with inference_perf, which defines the clients "
                                  "and rates itself; expand it with `convert inference-perf` and edit the result")
        return spec
    if not members and spec.servegen_data is None:
        raise ConfigError("clients: empty; give at least one client (or cohorts, or inference_perf)")
    # SLO classes: all or none (inference-perf and ServeGen set their own).
    with_class = [(p, c) for p, c in members if c.slo_class]
    if with_class and len(with_class) != len(members):
        missing = next(p for p, c in members if not c.slo_class)
        raise ConfigError(f"{missing}.slo_class: missing, but {with_class[0][0]} sets one; when any client or "
                          "cohort sets slo_class every one must (use standard for the default class)")
    for i, c in enumerate(spec.clients):
        _validate_client(c, f"clients[{i}]", spec)
    for i, c in enumerate(spec.cohorts):
        _validate_cohort(c, f"cohorts[{i}]", spec)
    concurrency = [f"clients[{i}]" for i, c in enumerate(spec.clients) if c.concurrency is not None]
    multi_turn = [p for p, c in members if c.reasoning is not None and c.reasoning.multi_turn is not None]
    if concurrency and multi_turn:
        raise ConfigError(f"{concurrency[0]}.concurrency: concurrency clients cannot be mixed with multi-turn "
                          f"clients ({multi_turn[0]}.reasoning.multi_turn); split them into two specs")
    return spec


def _validate_lengths(c: ClientSpec | CohortSpec, path: str) -> None:
    if c.multimodal is not None and c.multimodal.text_distribution is None and c.input_distribution is None:
        raise ConfigError(f"{path}.multimodal.text_distribution: missing; give it or input_distribution")
    if c.multimodal is None and c.input_distribution is None:
        raise ConfigError(f"{path}.input_distribution: missing; every client needs an input length "
                          "distribution, e.g. {type: gaussian, params: {mean: 512, std_dev: 128, min: 2, max: 4096}}")
    if c.output_distribution is None:
        raise ConfigError(f"{path}.output_distribution: missing; every client needs an output length distribution")


def _validate_client(c: ClientSpec, path: str, spec: WorkloadSpec) -> None:
    if c.concurrency is not None:
        if c.rate_fraction:
            raise ConfigError(f"{path}.rate_fraction: a concurrency client runs closed-loop users and has no "
                              "rate; remove rate_fraction or concurrency")
        if c.lifecycle is not None:
            raise ConfigError(f"{path}.lifecycle: concurrency clients are always on; remove lifecycle")
    else:
        if c.think_time_us is not None:
            raise ConfigError(f"{path}.think_time_us: only concurrency clients take think_time_us; for "
                              "sessions use reasoning.multi_turn.think_time_us")
        if c.rate_fraction is None:
            raise ConfigError(f"{path}.rate_fraction: missing; give a fraction > 0 of aggregate_rate "
                              "(or concurrency for closed-loop users)")
        if c.rate_fraction <= 0:
            raise ConfigError(f"{path}.rate_fraction: {c.rate_fraction:g} must be > 0")
        if spec.absolute_rate_mode:
            _require_trace_rates(c.lifecycle, path)
    _validate_lengths(c, path)


def _require_trace_rates(lifecycle: LifecycleSpec | None, path: str) -> None:
    if lifecycle is None:
        raise ConfigError(f"{path}.lifecycle: aggregate_rate is 0 (absolute-rate mode), so the client needs "
                          "lifecycle windows with trace_rate; set aggregate_rate > 0 or add windows")
    for w, window in enumerate(lifecycle.windows):
        if window.trace_rate is None:
            raise ConfigError(f"{path}.lifecycle.windows[{w}].trace_rate: missing; aggregate_rate is 0 "
                              "(absolute-rate mode), so every window needs a trace_rate in req/s")


def _validate_cohort(c: CohortSpec, path: str, spec: WorkloadSpec) -> None:
    if c.population > MAX_COHORT_POPULATION:
        raise ConfigError(f"{path}.population: {c.population} exceeds the limit of {MAX_COHORT_POPULATION}")
    shapes = [k for k in ("diurnal", "spike", "drain") if getattr(c, k) is not None]
    if len(shapes) > 1:
        raise ConfigError(f"{path}.{shapes[1]}: a cohort takes one of diurnal, spike, drain; "
                          f"it already has {shapes[0]}")
    if c.rate_fraction is None and c.spike is None:
        raise ConfigError(f"{path}.rate_fraction: missing; give a fraction > 0 of aggregate_rate")
    if c.rate_fraction is not None and c.rate_fraction <= 0:
        raise ConfigError(f"{path}.rate_fraction: {c.rate_fraction:g} must be > 0")
    if spec.absolute_rate_mode and c.spike is None:
        raise ConfigError(f"{path}: aggregate_rate is 0 (absolute-rate mode), which needs trace_rate windows; "
                          "only a spike cohort has one — set aggregate_rate > 0")
    _validate_lengths(c, path)


# ---------------------------------------------------------------------------- writing


def spec_to_dict(spec: WorkloadSpec) -> dict[str, Any]:
    """WorkloadSpec → plain mapping in schema key order, omitting unset and default fields.

    `parse_spec(spec_to_dict(s)) == s` for every valid spec (empirical `file:` references are
    written as the file name, so the file must stay beside the written spec).
    """
    out: dict[str, Any] = {"version": spec.version}
    if spec.seed is not None:
        out["seed"] = spec.seed
    if spec.category:
        out["category"] = spec.category
    if spec.aggregate_rate:
        out["aggregate_rate"] = spec.aggregate_rate
    if spec.num_requests:
        out["num_requests"] = spec.num_requests
    if spec.horizon:
        out["horizon"] = spec.horizon
    if spec.clients:
        out["clients"] = [_to_plain(c) for c in spec.clients]
    if spec.cohorts:
        out["cohorts"] = [_to_plain(c) for c in spec.cohorts]
    if spec.servegen_data is not None:
        out["servegen_data"] = dict(spec.servegen_data)
    if spec.inference_perf is not None:
        out["inference_perf"] = _to_plain(spec.inference_perf)
    if spec.goodput_slo_targets is not None:
        out["goodput_slo_targets"] = {k: dict(v) for k, v in spec.goodput_slo_targets.items()}
    return out


# Written even when equal to the dataclass default (they carry meaning a reader expects).
_ALWAYS_WRITTEN = frozenset({"id", "process", "type", "enable_multi_turn_chat"})


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None or (isinstance(obj, DistSpec) and f.name == "params" and obj.file):
                continue
            if f.name not in _ALWAYS_WRITTEN:
                if f.default is not dataclasses.MISSING and value == f.default:
                    continue
                if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
                    continue
            out[f.name] = _to_plain(value)
        return out
    if isinstance(obj, Mapping):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [_to_plain(v) for v in obj]
    return obj
