"""A policy bundle (`ScenarioConfig.policy_config`, `--policy-config`) applied to a scenario, with
BLIS's precedence (blis-infra §6.4).

* Admission, routing, scheduler and preemption keys are used only where the scenario leaves the
  corresponding setting at its default and does not name it as explicit ("the flag wins"; the
  CLI names its typed flags, so `--routing-policy round-robin` beats a weighted bundle).
* `routing.scorers` are the weighted policy's scorers when the scenario names none.
* `node_pools` and `instance_lifecycle` come from the bundle only (a scenario that sets its own
  as well is an error: one source).
* Keys of features blis-jax does not simulate yet (tenant budgets, SLO
  priority or target maps) are errors naming the key, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

from blis_jax.cluster.node_pools import InstanceLifecycle
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.config.policy_bundle import PolicyBundle, load_policy_bundle
from blis_jax.errors import ConfigError
from blis_jax.naming import name
from blis_jax.scenario.config import EngineSettings, ScenarioConfig


def load_bundle(source: str | Path | PolicyBundle) -> PolicyBundle:
    """The bundle a `policy_config` value names, validated."""
    if isinstance(source, PolicyBundle):
        try:
            return source.validate()
        except ConfigError as e:
            raise ConfigError(f"{name('policy_config')}: invalid policy config: {e}") from None
    return load_policy_bundle(source, where=f"{name('policy_config')} {source}")


def apply_policy_bundle(config: ScenarioConfig, warn=None, explicit: Collection[str] = ()) -> ScenarioConfig:
    """`config` with its policy bundle applied and `policy_config` cleared (unchanged without a
    bundle); `warn(message)` receives
    what BLIS warns about (an ignored `priority.policy`). `explicit`: field paths
    (`cluster.routing_policy`, `engine.scheduler`, ...) set explicitly, which the bundle never
    overrides even when they hold their default value (the CLI's typed flags)."""
    if config.policy_config is None:
        return config
    bundle = load_bundle(config.policy_config)
    where = name("policy_config")
    _refuse_unsupported(bundle, where)
    if bundle.priority_policy not in ("", "constant") and warn is not None:
        warn(f"{where}: priority.policy {bundle.priority_policy!r} is ignored (BLIS reads no priority policy "
             "from the bundle)")
    c, default = config.cluster, ClusterConfig()
    a = bundle.admission
    changes: dict = {}

    def bundle_value(field: str, value) -> None:
        if (value is not None and value != "" and getattr(c, field) == getattr(default, field)
                and f"cluster.{field}" not in explicit):
            changes[field] = value

    bundle_value("admission_policy", a.policy)
    bundle_value("token_bucket_capacity", a.token_bucket_capacity)
    bundle_value("token_bucket_refill_rate", a.token_bucket_refill_rate)
    bundle_value("tier_shed_threshold", a.tier_shed_threshold)
    # BLIS: the minimum priority defaults to 3 when the bundle's own admission policy is tier-shed
    bundle_value("tier_shed_min_priority", a.tier_shed_min_priority if a.tier_shed_min_priority is not None
                 else (3 if a.policy == "tier-shed" else None))
    bundle_value("queue_depth_threshold", a.gaie_qd_threshold)
    bundle_value("kv_cache_util_threshold", a.gaie_kv_threshold)
    bundle_value("routing_policy", bundle.routing.policy)
    policy = changes.get("routing_policy", c.routing_policy)
    if (policy == "weighted" and c.routing_scorers is None and bundle.routing.scorers
            and "cluster.routing_scorers" not in explicit):
        changes["routing_scorers"] = bundle.routing.scorer_profile
    if bundle.autoscaler.interval_us > 0:   # its other keys count only with its own interval (§4.1)
        if c.autoscaler is not None:
            raise ConfigError(f"{where} sets autoscaler, and so does {name('cluster.autoscaler')}; give it in one place")
        changes["autoscaler"] = bundle.autoscaler
    if bundle.node_pools or bundle.instance_lifecycle != InstanceLifecycle():
        if c.node_pools or c.instance_lifecycle != InstanceLifecycle():
            raise ConfigError(f"{where} sets node_pools/instance_lifecycle, and so does {name('cluster.node_pools')}; "
                              "give them in one place")
        changes["node_pools"] = bundle.node_pools
        changes["instance_lifecycle"] = bundle.instance_lifecycle
    e, engine_default, engine_changes = config.engine, EngineSettings(), {}
    for field, value in (("scheduler", bundle.scheduler), ("preemption_policy", bundle.preemption_policy)):
        if value and getattr(e, field) == getattr(engine_default, field) and f"engine.{field}" not in explicit:
            engine_changes[field] = value
    try:
        engine = dataclasses.replace(e, **engine_changes)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    # the bundle is consumed: the result holds its effect, so resolving it again changes nothing
    return dataclasses.replace(config, cluster=dataclasses.replace(c, **changes), engine=engine, policy_config=None)


def _refuse_unsupported(bundle: PolicyBundle, where: str) -> None:
    """Bundle keys of features blis-jax does not simulate yet: an error naming the key."""
    unsupported = []
    if bundle.tenant_budgets is not None:
        unsupported.append("tenant_budgets")
    if bundle.admission.slo_priorities:
        unsupported.append("admission.slo_priorities")
    if bundle.admission.slo_targets:
        unsupported.append("admission.slo_targets")
    if unsupported:
        raise ConfigError(f"{where}: {', '.join(unsupported)} not supported by blis-jax yet; remove "
                          f"{'it' if len(unsupported) == 1 else 'them'} from the policy config")
