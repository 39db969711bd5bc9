"""BLIS's policy bundle (`--policy-config FILE.yaml`, blis-infra §6): the schema, its strict
parser and its validator.

The file is one YAML document decoded strictly at every nesting level, as BLIS's Go decoder
does: an unknown key (including the ones BLIS's prose documentation shows but its parser
rejects: `instance_lifecycle.warm_up_request_count`, `drain_policy`, `hw_config_by_gpu`,
`routing.cache_weight`, ...) or a duplicated key is an error naming the key and its line; an
empty file is an error. Keys marked optional (None when absent) distinguish "absent" from an
explicit value. After parsing, `PolicyBundle.validate` runs BLIS's checks in BLIS's order
(the first failure wins) with BLIS's messages.

How a bundle combines with the other settings (flags win over the bundle's admission,
routing, scheduler and preemption keys; node pools and the lifecycle come from the bundle
only) is `blis_jax.scenario.policy`'s concern; this module only reads and checks the file.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import yaml

from blis_jax.cluster.autoscaler import AnalyzerConfig, AutoscalerConfig
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
from blis_jax.errors import ConfigError

ADMISSION_POLICIES = ("", "always-admit", "token-bucket", "reject-all", "tier-shed", "gaie-legacy")
ROUTING_POLICIES = ("", "round-robin", "least-loaded", "weighted", "always-busiest")
SCHEDULERS = ("", "fcfs", "priority-fcfs", "sjf", "reverse-priority")
PREEMPTION_POLICIES = ("", "fcfs", "priority")
SLO_PRIORITY_RANGE = (-100, 100)


@dataclasses.dataclass(frozen=True)
class AdmissionBundle:
    policy: str = ""
    token_bucket_capacity: float | None = None
    token_bucket_refill_rate: float | None = None
    tier_shed_threshold: int | None = None
    tier_shed_min_priority: int | None = None
    gaie_qd_threshold: float | None = None
    gaie_kv_threshold: float | None = None
    slo_priorities: tuple[tuple[str, int], ...] = ()  # class → priority, file order
    slo_targets: tuple[tuple[str, int], ...] = ()  # class → µs


@dataclasses.dataclass(frozen=True)
class RoutingBundle:
    policy: str = ""
    scorers: tuple[tuple[str, float], ...] = ()  # (name, weight), file order

    @property
    def scorer_profile(self) -> str | None:
        """The scorers as a `--routing-scorers` string (None when the bundle lists none)."""
        return ",".join(f"{n}:{w:g}" for n, w in self.scorers) or None


# the bundle's `autoscaler` section is the library's autoscaler configuration
AnalyzerBundle, AutoscalerBundle = AnalyzerConfig, AutoscalerConfig


@dataclasses.dataclass(frozen=True)
class PolicyBundle:
    """Every key of BLIS's bundle (blis-infra §6.2); absent keys take these defaults."""

    admission: AdmissionBundle = AdmissionBundle()
    routing: RoutingBundle = RoutingBundle()
    priority_policy: str = ""  # `priority.policy`: ignored by BLIS (a warning unless "" or constant)
    scheduler: str = ""
    preemption_policy: str = ""  # `preemption.policy`
    tenant_budgets: tuple[tuple[str, float], ...] | None = None  # present (even {}) ⇒ enforcement
    node_pools: tuple[NodePool, ...] = ()
    autoscaler: AutoscalerBundle = AutoscalerBundle()
    instance_lifecycle: InstanceLifecycle = InstanceLifecycle()

    def validate(self) -> PolicyBundle:
        """BLIS's bundle validation, in its order; raises `ConfigError` with its message."""
        from blis_jax.cluster.scorers import SCORERS

        a, r = self.admission, self.routing
        for key, value, choices in (("admission.policy", a.policy, ADMISSION_POLICIES),
                                    ("routing.policy", r.policy, ROUTING_POLICIES),
                                    ("scheduler", self.scheduler, SCHEDULERS),
                                    ("preemption.policy", self.preemption_policy, PREEMPTION_POLICIES)):
            if value not in choices:
                raise ConfigError(f"{key} {value!r} is not valid; use one of {', '.join(c for c in choices if c)}")
        for key, value in (("token_bucket_capacity", a.token_bucket_capacity),
                           ("token_bucket_refill_rate", a.token_bucket_refill_rate)):
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ConfigError(f"admission.{key} must be non-negative, got {value:f}")
        if a.tier_shed_threshold is not None and a.tier_shed_threshold < 0:
            raise ConfigError(f"admission.tier_shed_threshold must be >= 0, got {a.tier_shed_threshold}")
        if a.gaie_qd_threshold is not None and not (math.isfinite(a.gaie_qd_threshold) and a.gaie_qd_threshold > 0):
            raise ConfigError(f"admission.gaie_qd_threshold must be a finite number > 0, got {a.gaie_qd_threshold:g}")
        if a.gaie_kv_threshold is not None and not (math.isfinite(a.gaie_kv_threshold) and 0 < a.gaie_kv_threshold <= 1):
            raise ConfigError(f"admission.gaie_kv_threshold must be in (0, 1], got {a.gaie_kv_threshold:g}")
        for tenant, budget in self.tenant_budgets or ():
            if not (math.isfinite(budget) and 0 <= budget <= 1):
                raise ConfigError(f"tenant_budgets[{tenant!r}] must be in [0, 1], got {budget:g}")
        seen = set()
        for i, (scorer, weight) in enumerate(r.scorers):
            if scorer not in SCORERS:
                raise ConfigError(f"routing.scorers[{i}]: unknown scorer {scorer!r}; use one of {', '.join(SCORERS)}")
            if scorer in seen:
                raise ConfigError(f"routing.scorers[{i}]: scorer {scorer!r} is listed twice")
            seen.add(scorer)
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError(f"routing.scorers[{i}] {scorer!r}: weight must be a finite number > 0, got {weight:g}")
        self.autoscaler.check()
        for i, pool in enumerate(self.node_pools):
            pool.check(i)
        self.instance_lifecycle.check()
        return self


# ------------------------------------------------------------------------------- parsing
#
# The schema: a section is {key: kind}; a kind is a type, a nested section (with BLIS's Go
# type name, for messages), ("map", type) or ("list", section).

_DELAY = ("Delay", {"mean": float, "stddev": float})
_POOL = ("NodePoolConfig", {"name": str, "gpu_type": str, "gpus_per_node": int, "gpu_memory_gib": float,
                            "initial_nodes": int, "min_nodes": int, "max_nodes": int,
                            "provisioning_delay": _DELAY, "cost_per_hour": float})
_SCHEMA = ("PolicyBundle", {
    "admission": ("AdmissionConfig", {
        "policy": str, "token_bucket_capacity": float, "token_bucket_refill_rate": float,
        "tier_shed_threshold": int, "tier_shed_min_priority": int, "gaie_qd_threshold": float,
        "gaie_kv_threshold": float, "slo_priorities": ("map", int), "slo_targets": ("map", int)}),
    "routing": ("RoutingConfig", {"policy": str, "scorers": ("list", ("ScorerConfig", {"name": str, "weight": float}))}),
    "priority": ("PriorityConfig", {"policy": str}),
    "scheduler": str,
    "preemption": ("PreemptionConfig", {"policy": str}),
    "tenant_budgets": ("map", float),
    "node_pools": ("list", _POOL),
    "autoscaler": ("AutoscalerConfig", {
        "interval_us": float, "scale_up_stabilization_window_us": float,
        "scale_down_stabilization_window_us": float, "hpa_scrape_delay": _DELAY,
        "analyzer": ("AnalyzerConfig", {"kv_cache_threshold": float, "scale_up_threshold": float,
                                        "scale_down_boundary": float, "avg_input_tokens": float})}),
    "instance_lifecycle": ("InstanceLifecycleBundleConfig", {"loading_delay": _DELAY,
                                                             "warm_start_initial_instances": bool}),
})
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


class _Decoder:
    def __init__(self, loader: yaml.SafeLoader, where: str):
        self.loader, self.where = loader, where

    def fail(self, node, message: str):
        raise ConfigError(f"{self.where}: line {node.start_mark.line + 1}: {message}")

    def decode(self, node, kind, path: str):
        if isinstance(kind, tuple) and kind[0] == "map":
            return self._pairs(node, path, lambda v, p: self.decode(v, kind[1], p), "map")
        if isinstance(kind, tuple) and kind[0] == "list":
            if self._null(node):
                return ()
            if not isinstance(node, yaml.SequenceNode):
                self.fail(node, f"{path} must be a list")
            return tuple(self.decode(item, kind[1], f"{path}[{i}]") for i, item in enumerate(node.value))
        if isinstance(kind, tuple):
            return self._section(node, kind, path)
        return self._scalar(node, kind, path)

    @staticmethod
    def _null(node) -> bool:
        return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"

    def _pairs(self, node, path, value_of, what):
        if self._null(node):
            return ()
        if not isinstance(node, yaml.MappingNode):
            self.fail(node, f"{path or 'the file'} must be a mapping of keys to values")
        out, seen = [], set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.fail(key_node, f"{path}: keys must be plain strings")
            key = key_node.value
            if key in seen:
                self.fail(key_node, f"key {self._join(path, key)} is given twice")
            seen.add(key)
            out.append((key, value_of(value_node, self._join(path, key), key_node)
                        if what == "section" else value_of(value_node, f"{path}[{key!r}]")))
        return tuple(out)

    @staticmethod
    def _join(path: str, key: str) -> str:
        return f"{path}.{key}" if path else key

    def _section(self, node, kind, path):
        type_name, fields = kind

        def field(value_node, key_path, key_node):
            key = key_path.rsplit(".", 1)[-1]
            if key not in fields:
                self.fail(key_node, f"unknown key {key_path} (BLIS: field {key} not found in type sim.{type_name}); "
                                    f"known keys{' under ' + path if path else ''}: {', '.join(fields)}")
            return self.decode(value_node, fields[key], key_path)

        return dict(self._pairs(node, path, field, "section"))

    def _scalar(self, node, kind, path):
        if not isinstance(node, yaml.ScalarNode):
            shape = "list" if isinstance(node, yaml.SequenceNode) else "mapping"
            self.fail(node, f"{path} must be {_TYPE_NAMES[kind]}, not a {shape}")
        if self._null(node):
            return None
        if kind is str:  # Go's decoder puts any scalar's text into a string field
            return node.value
        value = self.loader.construct_object(node, deep=True)
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        self.fail(node, f"{path} must be {_TYPE_NAMES[kind]}, got {node.value!r}")


def parse_policy_bundle(text: str, where: str = "policy config") -> PolicyBundle:
    """A bundle from YAML text (strict; not yet validated: call `.validate()`)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f"line {mark.line + 1}: " if mark is not None else ""
            raise ConfigError(f"{where}: {line}not valid YAML ({getattr(e, 'problem', None) or e})") from None
        if node is None:
            raise ConfigError(f"{where}: the file is empty; give at least one bundle section (e.g. node_pools)")
        raw = _Decoder(loader, where).decode(node, _SCHEMA, "")
    finally:
        loader.dispose()
    return _bundle(raw)


def load_policy_bundle(path: str | Path, where: str | None = None) -> PolicyBundle:
    """Read, parse and validate a bundle file; errors name `where` (default: the path)."""
    where = where or str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the policy config ({e.strerror or e})") from None
    bundle = parse_policy_bundle(text, where)
    try:
        return bundle.validate()
    except ConfigError as e:
        raise ConfigError(f"{where}: invalid policy config: {e}") from None


def _bundle(raw: dict) -> PolicyBundle:
    def delay(d) -> Delay:
        d = d or {}
        return Delay(mean=d.get("mean") or 0.0, stddev=d.get("stddev") or 0.0)

    adm = raw.get("admission") or {}
    routing = raw.get("routing") or {}
    scaler = raw.get("autoscaler") or {}
    analyzer = scaler.get("analyzer") or {}
    life = raw.get("instance_lifecycle") or {}
    pools = tuple(NodePool(name=p.get("name") or "", gpu_type=p.get("gpu_type") or "",
                           gpus_per_node=p.get("gpus_per_node") or 0, gpu_memory_gib=p.get("gpu_memory_gib") or 0.0,
                           initial_nodes=p.get("initial_nodes") or 0, min_nodes=p.get("min_nodes") or 0,
                           max_nodes=p.get("max_nodes") or 0, provisioning_delay=delay(p.get("provisioning_delay")),
                           cost_per_hour=p.get("cost_per_hour") or 0.0)
                  for p in raw.get("node_pools") or ())
    return PolicyBundle(
        admission=AdmissionBundle(
            policy=adm.get("policy") or "", **{k: adm.get(k) for k in (
                "token_bucket_capacity", "token_bucket_refill_rate", "tier_shed_threshold", "tier_shed_min_priority",
                "gaie_qd_threshold", "gaie_kv_threshold")},
            slo_priorities=tuple((k, v if v is not None else 0) for k, v in adm.get("slo_priorities") or ()),
            slo_targets=tuple((k, v if v is not None else 0) for k, v in adm.get("slo_targets") or ())),
        routing=RoutingBundle(policy=routing.get("policy") or "",
                              scorers=tuple((s.get("name") or "", s.get("weight") or 0.0)
                                            for s in routing.get("scorers") or ())),
        priority_policy=(raw.get("priority") or {}).get("policy") or "",
        scheduler=raw.get("scheduler") or "",
        preemption_policy=(raw.get("preemption") or {}).get("policy") or "",
        tenant_budgets=(tuple((k, v if v is not None else 0.0) for k, v in raw["tenant_budgets"])
                        if "tenant_budgets" in raw else None),
        node_pools=pools,
        autoscaler=AutoscalerBundle(
            **{k: scaler.get(k) or 0.0 for k in ("interval_us", "scale_up_stabilization_window_us",
                                                 "scale_down_stabilization_window_us")},
            hpa_scrape_delay=delay(scaler.get("hpa_scrape_delay")),
            analyzer=AnalyzerBundle(**{k: analyzer.get(k) or 0.0 for k in (
                "kv_cache_threshold", "scale_up_threshold", "scale_down_boundary", "avg_input_tokens")})),
        instance_lifecycle=InstanceLifecycle(loading_delay=delay(life.get("loading_delay")),
                                             warm_start_initial_instances=bool(life.get("warm_start_initial_instances"))),
    )
