"""The policy bundle (`--policy-config`, blis-infra §6): BLIS's strict schema, its validation
(worked example WE-20 and the §8 O-8 observations) and its precedence against flags (§6.4)."""

from __future__ import annotations

import io
import math

import pytest

from blis_jax import cli
from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.config.policy_bundle import PolicyBundle, load_policy_bundle, parse_policy_bundle
from blis_jax.errors import ConfigError
from blis_jax.scenario import ScenarioConfig
from blis_jax.scenario.policy import apply_policy_bundle
from shared_data import BLIS_DIFF, needs_blis_diff

WE20 = """
admission:
  policy: token-bucket
  token_bucket_capacity: 5000
  token_bucket_refill_rate: 500
routing:
  policy: weighted
  scorers:
    - {name: queue-depth, weight: 2}
    - {name: kv-utilization, weight: 2}
    - {name: load-balance, weight: 1}
priority:
  policy: slo-based
scheduler: priority-fcfs
"""


def parsed(text: str) -> PolicyBundle:
    return parse_policy_bundle(text, "bundle.yaml").validate()


def test_we20_bundle_parses():
    b = parsed(WE20)
    assert (b.admission.policy, b.admission.token_bucket_capacity, b.admission.token_bucket_refill_rate) == (
        "token-bucket", 5000.0, 500.0)
    assert b.routing.policy == "weighted"
    assert b.routing.scorers == (("queue-depth", 2.0), ("kv-utilization", 2.0), ("load-balance", 1.0))
    assert (b.priority_policy, b.scheduler) == ("slo-based", "priority-fcfs")
    # keys not given take their zero values; pointer keys stay "absent"
    assert b.admission.tier_shed_threshold is None and b.tenant_budgets is None
    assert b.autoscaler.interval_us == 0 and b.node_pools == ()


@pytest.mark.parametrize("text, key, line", [
    ("routing:\n  cache_weight: 1\n", "routing.cache_weight", 2),
    ("routing:\n  load_weight: 1\n", "routing.load_weight", 2),
    ("autoscaler:\n  interval_us: 1\n  scale_up_cooldown_us: 5\n", "autoscaler.scale_up_cooldown_us", 3),
    ("autoscaler:\n  scale_down_cooldown_us: 5\n", "autoscaler.scale_down_cooldown_us", 2),
    ("autoscaler:\n  actuation_delay: {mean: 1}\n", "autoscaler.actuation_delay", 2),
    ("instance_lifecycle:\n  warm_up_request_count: 3\n", "instance_lifecycle.warm_up_request_count", 2),
    ("instance_lifecycle:\n  warm_up_ttft_factor: 2\n", "instance_lifecycle.warm_up_ttft_factor", 2),
    ("instance_lifecycle:\n  drain_policy: WAIT\n", "instance_lifecycle.drain_policy", 2),
    ("hw_config_by_gpu: {}\n", "hw_config_by_gpu", 1),
    ("node_pools:\n  - name: p\n    gpu: H100\n", "node_pools[0].gpu", 3),
])
def test_keys_the_strict_parser_rejects(text, key, line):
    with pytest.raises(ConfigError) as e:
        parse_policy_bundle(text, "bundle.yaml")
    assert f"bundle.yaml: line {line}: unknown key {key} " in str(e.value)


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"),
    ("# only a comment\n", "empty"),
    ("scheduler: fcfs\nscheduler: sjf\n", "line 2: key scheduler is given twice"),
    ("node_pools:\n  - name: p\n    gpus_per_node: 1.5\n", "node_pools[0].gpus_per_node must be an integer"),
    ("instance_lifecycle:\n  warm_start_initial_instances: maybe\n", "must be true or false"),
    ("routing: [1, 2]\n", "routing must be a mapping"),
    ("admission:\n  policy: [a]\n", "admission.policy must be a string"),
    ("scheduler: [\n", "not valid YAML"),
])
def test_malformed_files(text, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        parse_policy_bundle(text, "bundle.yaml")
    assert fragment in str(e.value)


POOL = "node_pools:\n  - {name: p, gpu_type: H100, gpus_per_node: 1, gpu_memory_gib: 80, initial_nodes: 1, max_nodes: 1}\n"


@pytest.mark.parametrize("text, message", [
    ("routing:\n  scorers: [{name: fastest, weight: 1}]\n", "unknown scorer 'fastest'"),
    *((f"routing:\n  scorers: [{{name: queue-depth, weight: {w}}}]\n", "weight must be a finite number > 0")
      for w in ("0", "-1", ".nan", ".inf")),
    ("routing:\n  scorers: [{name: queue-depth, weight: 1}, {name: queue-depth, weight: 2}]\n", "listed twice"),
    ("routing:\n  policy: round-robin\n  scorers: [{name: fastest, weight: 1}]\n", "unknown scorer"),
    *((f"tenant_budgets: {{alice: {v}}}\n", "tenant_budgets['alice'] must be in [0, 1]")
      for v in ("-0.1", "1.5", ".nan", ".inf", "-.inf")),
    ("autoscaler:\n  interval_us: -1\n", "autoscaler.interval_us must be a finite number >= 0, got -1"),
    ("autoscaler:\n  scale_up_stabilization_window_us: -1\n", "scale_up_stabilization_window_us"),
    ("autoscaler:\n  scale_down_stabilization_window_us: .nan\n", "scale_down_stabilization_window_us"),
    ("autoscaler:\n  hpa_scrape_delay: {mean: -1}\n", "autoscaler.hpa_scrape_delay.mean must be >= 0"),
    ("autoscaler:\n  hpa_scrape_delay: {stddev: .inf}\n", "autoscaler.hpa_scrape_delay.stddev must be a finite"),
    ("autoscaler:\n  analyzer: {scale_up_threshold: -0.1}\n", "scale_up_threshold must be 0 (default) or"),
    ("autoscaler:\n  analyzer: {scale_down_boundary: -1}\n", "scale_down_boundary must be 0 (default) or"),
    ("autoscaler:\n  analyzer: {avg_input_tokens: -100}\n", "avg_input_tokens must be 0 (default) or"),
    ("autoscaler:\n  analyzer: {scale_up_threshold: 0.5, scale_down_boundary: 0.5}\n",
     "scale_down_boundary (0.5) must be < effective scale_up_threshold (0.5)"),
    ("autoscaler:\n  analyzer: {scale_up_threshold: 0.4, scale_down_boundary: 0.8}\n", "(0.8) must be <"),
    ("autoscaler:\n  analyzer: {scale_down_boundary: 0.9}\n",
     "autoscaler.analyzer.scale_down_boundary (0.9) must be < effective scale_up_threshold (0.8)"),
    ("autoscaler:\n  analyzer: {scale_up_threshold: 0.3}\n", "scale_down_boundary (0.4) must be < effective "
                                                             "scale_up_threshold (0.3)"),
    ("autoscaler:\n  analyzer: {kv_cache_threshold: 1.5}\n", "kv_cache_threshold must be 0 (default) or in (0, 1]"),
    ("node_pools:\n  - {gpu_type: H100, gpus_per_node: 1, gpu_memory_gib: 80}\n", "node_pools[0]: name must not be empty"),
    ("node_pools:\n  - {name: p, gpu_type: H100, gpus_per_node: 1, gpu_memory_gib: 80, initial_nodes: 5, max_nodes: 2}\n",
     "node_pools[0] 'p': max_nodes (2) must be >= initial_nodes (5)"),
    ("node_pools:\n  - {name: p, gpu_type: H100, gpus_per_node: 0, gpu_memory_gib: 80}\n",
     "gpus_per_node must be >= 1, got 0"),
    ("node_pools:\n  - {name: p, gpu_type: H100, gpus_per_node: 1, gpu_memory_gib: 80, min_nodes: 3, max_nodes: 2}\n",
     "min_nodes (3) must be <= max_nodes (2)"),
    ("instance_lifecycle:\n  loading_delay: {mean: -1}\n", "instance_lifecycle.loading_delay.mean must be >= 0, got -1"),
    ("instance_lifecycle:\n  loading_delay: {stddev: -1}\n", "instance_lifecycle.loading_delay.stddev must be >= 0"),
    ("admission:\n  token_bucket_capacity: -1\n", "token_bucket_capacity must be non-negative, got -1.000000"),
    ("admission:\n  gaie_qd_threshold: 0\n", "gaie_qd_threshold must be a finite number > 0"),
    ("admission:\n  gaie_kv_threshold: 1.5\n", "gaie_kv_threshold must be in (0, 1]"),
    ("scheduler: lottery\n", "scheduler 'lottery' is not valid"),
])
def test_validation_failures(text, message):
    with pytest.raises(ConfigError) as e:
        parsed(text)
    assert message in str(e.value)


@pytest.mark.parametrize("text", [
    "instance_lifecycle:\n  loading_delay: {mean: 0}\n",
    "tenant_budgets: {a: 0, b: 1}\n",
    "tenant_budgets: {a: 0.3, b: 0.7}\n",
    "tenant_budgets: {}\n",
    "scheduler: reverse-priority\n",   # valid in a bundle (blis-jax's engine then refuses it)
    POOL,
])
def test_valid_edge_values(text):
    parsed(text)


def test_absent_sections_and_lifecycle_round_trip():
    b = parsed("instance_lifecycle:\n  loading_delay: {mean: 270, stddev: 30}\n  warm_start_initial_instances: true\n")
    assert b.autoscaler.interval_us == 0 and b.node_pools == ()
    assert b.instance_lifecycle == InstanceLifecycle(loading_delay=Delay(270.0, 30.0), warm_start_initial_instances=True)
    assert parsed("tenant_budgets: {}\n").tenant_budgets == ()   # present but empty: not None


@needs_blis_diff
@pytest.mark.parametrize("case", ["F01", "F02", "F05"])
def test_reference_bundles_load(case):
    bundle = load_policy_bundle(next(BLIS_DIFF.glob(f"{case}_*")) / "bundle.yaml")
    if case == "F01":
        assert bundle.node_pools == (NodePool(name="h100", gpu_type="H100", gpus_per_node=4, gpu_memory_gib=80.0,
                                              initial_nodes=1, max_nodes=1, cost_per_hour=10.0),)
        assert bundle.instance_lifecycle == InstanceLifecycle(loading_delay=Delay(2.0, 0.5))
    elif case == "F02":
        assert [p.name for p in bundle.node_pools] == ["big", "small"]
        assert bundle.instance_lifecycle.warm_start_initial_instances
    else:
        assert (bundle.routing.policy, bundle.routing.scorer_profile) == ("weighted", "queue-depth:2,kv-utilization:1")


# ------------------------------------------------------------------------------- precedence


def applied(text: str, tmp_path, **cluster) -> ScenarioConfig:
    path = tmp_path / "bundle.yaml"
    path.write_text(text)
    config = ScenarioConfig(policy_config=str(path))
    if cluster:
        config = config.replace(cluster=config.cluster.__class__(**cluster))
    return apply_policy_bundle(config)


def test_bundle_values_fill_unset_settings(tmp_path):
    c = applied(WE20, tmp_path)
    assert (c.cluster.admission_policy, c.cluster.token_bucket_capacity, c.cluster.token_bucket_refill_rate) == (
        "token-bucket", 5000.0, 500.0)
    assert (c.cluster.routing_policy, c.cluster.routing_scorers) == (
        "weighted", "queue-depth:2,kv-utilization:2,load-balance:1")
    assert c.engine.scheduler == "priority-fcfs"


def test_flags_win_over_the_bundle(tmp_path):
    c = applied(WE20, tmp_path, routing_policy="least-loaded", admission_policy="reject-all")
    assert (c.cluster.routing_policy, c.cluster.routing_scorers, c.cluster.admission_policy) == (
        "least-loaded", None, "reject-all")
    c = applied(WE20, tmp_path, routing_policy="weighted", routing_scorers="queue-depth:1")
    assert c.cluster.routing_scorers == "queue-depth:1"


def test_tier_shed_min_priority_defaults_to_3_with_a_tier_shed_bundle(tmp_path):
    assert applied("admission: {policy: tier-shed}\n", tmp_path).cluster.tier_shed_min_priority == 3
    assert applied("admission: {tier_shed_threshold: 2}\n", tmp_path).cluster.tier_shed_min_priority == 0


def test_pools_and_lifecycle_come_from_the_bundle(tmp_path):
    c = applied(POOL + "instance_lifecycle: {loading_delay: {mean: 1}}\n", tmp_path)
    assert [p.name for p in c.cluster.node_pools] == ["p"]
    assert c.cluster.instance_lifecycle.loading_delay == Delay(1.0, 0.0)
    with pytest.raises(ConfigError, match="one place"):
        applied(POOL, tmp_path, node_pools=(NodePool("q", "H100", 1, 80.0, 1, 0, 1),))


def test_autoscaler_section_and_the_interval_flag(tmp_path):
    """blis-infra §4.1: the bundle's keys count only with its own interval > 0; the flag
    overrides the interval whenever given (0 disables); alone it gives default settings."""
    from blis_jax.cluster.autoscaler import AnalyzerConfig, AutoscalerConfig

    full = ("autoscaler: {interval_us: 500000, scale_down_stabilization_window_us: 3000000,\n"
            "  hpa_scrape_delay: {mean: 0.4, stddev: 0.15}, analyzer: {scale_up_threshold: 0.7}}\n")
    c = applied(full, tmp_path).cluster
    assert c.effective_autoscaler() == AutoscalerConfig(
        interval_us=500000, scale_down_stabilization_window_us=3000000, hpa_scrape_delay=Delay(0.4, 0.15),
        analyzer=AnalyzerConfig(scale_up_threshold=0.7))
    flagged = applied(full, tmp_path, model_autoscaler_interval_us=2e6).cluster.effective_autoscaler()
    assert flagged.interval_us == 2e6 and flagged.scale_down_stabilization_window_us == 3000000
    assert applied(full, tmp_path, model_autoscaler_interval_us=0.0).cluster.effective_autoscaler() is None
    without = "autoscaler: {interval_us: 0, scale_up_stabilization_window_us: 9}\n"
    assert applied(without, tmp_path, model_autoscaler_interval_us=1e6).cluster.effective_autoscaler() == \
        AutoscalerConfig(interval_us=1e6)                      # the bundle's other keys are ignored
    with pytest.raises(ConfigError, match="interval_us must be 0 .* or >= 1"):
        ClusterConfig(model_autoscaler_interval_us=0.5).validate()    # BLIS would re-tick forever
    with pytest.raises(ConfigError, match="interval_us must be a finite number >= 0"):
        ClusterConfig(model_autoscaler_interval_us=-5.0).validate()


@pytest.mark.parametrize("text, key", [
    ("tenant_budgets: {alice: 0.5}\n", "tenant_budgets"),
    ("admission: {slo_priorities: {batch: 2}}\n", "admission.slo_priorities"),
])
def test_features_not_built_are_refused_by_name(text, key, tmp_path):
    with pytest.raises(ConfigError, match=f"{key}.*not supported by blis-jax yet"):
        applied(text, tmp_path)


def test_a_bundle_object_works_without_yaml():
    bundle = PolicyBundle(node_pools=(NodePool("p", "H100", 2, 80.0, 1, 0, 1),))
    c = apply_policy_bundle(ScenarioConfig(policy_config=bundle))
    assert c.cluster.node_pools == bundle.node_pools
    with pytest.raises(ConfigError, match="gpu_memory_gib must be > 0"):
        apply_policy_bundle(ScenarioConfig(policy_config=PolicyBundle(node_pools=(NodePool("p", "H100", 2, 0.0),))))
    assert math.isfinite(c.cluster.token_bucket_capacity)


def test_cli_error_names_the_key_and_line(tmp_path):
    path = tmp_path / "bundle.yaml"
    path.write_text("routing:\n  policy: weighted\n  cache_weight: 1\n")
    err = io.StringIO()
    rc = cli.main(["run", "--policy-config", str(path), "--num-requests", "1"], stdout=io.StringIO(), stderr=err)
    assert rc == 2
    (line,) = err.getvalue().splitlines()
    assert line.startswith("blis-jax run: error: --policy-config ") and "line 3: unknown key routing.cache_weight" in line


def test_explicit_settings_at_their_default_beat_the_bundle(tmp_path):
    path = tmp_path / "bundle.yaml"
    path.write_text(WE20)
    config = ScenarioConfig(policy_config=str(path))
    c = apply_policy_bundle(config, explicit={"cluster.routing_policy", "engine.scheduler",
                                              "cluster.admission_policy"})
    assert (c.cluster.routing_policy, c.cluster.routing_scorers, c.engine.scheduler) == ("round-robin", None, "fcfs")
    assert c.cluster.admission_policy == "always-admit" and c.cluster.token_bucket_capacity == 5000.0


def test_cli_typed_flags_win_even_at_their_default(tmp_path):
    """`--routing-policy round-robin` typed: BLIS keeps it over the bundle's weighted policy
    (the flag is Changed); untyped, the bundle's policy applies."""
    from blis_jax.cli import app

    path = tmp_path / "bundle.yaml"
    path.write_text(WE20)
    diag = app.Diagnostics(io.StringIO())
    for argv, want in ((["--routing-policy", "round-robin"], ("round-robin", "priority-fcfs")),
                       (["--scheduler=fcfs"], ("weighted", "fcfs")),
                       ([], ("weighted", "priority-fcfs"))):
        raw = ["run", "--policy-config", str(path), "--num-requests", "2", *argv]
        args = app.build_parser().parse_args(raw)
        args.given_flags = frozenset(t[2:].split("=", 1)[0] for t in raw if t.startswith("--"))
        r = app.resolve_command(args, diag)
        assert (r.cluster.routing_policy, r.scheduler) == want, argv


def test_the_bundle_is_consumed_once(tmp_path):
    c = applied(POOL, tmp_path)
    assert c.policy_config is None and apply_policy_bundle(c) == c
