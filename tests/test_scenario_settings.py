"""The scenario settings table (`blis_jax.scenario.settings`): the same settings as the `run`
parser (keys, aliases, kinds, choices, defaults), the same `ScenarioConfig` as the CLI builds
from the equivalent flags, and errors that name `<where>.<key>`."""

from __future__ import annotations

import argparse

import pytest

from blis_jax.cli import build_parser
from blis_jax.cli.scenario_flags import FLAG_OF_FIELD, scenario_config
from blis_jax.config import load_coefficients
from blis_jax.errors import ConfigError
from blis_jax.naming import naming
from blis_jax.scenario import ScenarioConfig
from blis_jax.scenario.settings import NUMBERS, SETTINGS, apply_settings, settings_by_key

# run flags that configure no scenario: outputs, logging, the process's memory limit
NOT_SETTINGS = {"help", "metrics-path", "results-path", "trace-output", "progress", "log", "max-memory-gib"}


def run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def run_actions() -> dict[str, argparse.Action]:
    """run's flags (without dashes, aliases included) → their argparse action."""
    out = {}
    for action in run_parser()._actions:
        longs = [o[2:] for o in action.option_strings if o.startswith("--")]
        if longs[0] not in NOT_SETTINGS:
            out.update(dict.fromkeys(longs, action))
    return out


def test_the_table_has_the_run_parsers_settings():
    actions = run_actions()
    assert set(settings_by_key()) == set(actions)
    for key, setting in settings_by_key().items():
        action = actions[key]
        assert action.option_strings == [f"--{k}" for k in (setting.key, *setting.aliases)], key
        switch = isinstance(action, argparse._StoreTrueAction)
        kind = bool if switch else (action.type or str)
        assert kind is (str if setting.kind is NUMBERS else setting.kind), key
        assert (tuple(action.choices) if action.choices else None) == setting.choices, key
        if action.default is not None:
            assert action.default == setting.default, key
    assert len({s.field for s in SETTINGS}) == len(SETTINGS)  # each field set by one setting


def test_the_cli_names_fields_by_the_tables_keys():
    for setting in SETTINGS:
        if setting.names_field:
            assert FLAG_OF_FIELD[setting.named_field] == f"--{setting.key}"


def _flags(settings: dict) -> list[str]:
    argv = []
    for key, value in settings.items():
        if isinstance(value, bool):
            argv += [f"--{key}"] if value else []
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", ",".join(repr(float(v)) for v in value)]
        else:
            argv += [f"--{key}", str(value)]
    return argv


_COEFFS = load_coefficients(None)

EXAMPLES = [
    {},
    {"rate": 5, "num-requests": 50, "max-num-running-reqs": 8, "prompt-tokens-max": 300, "output-tokens": 40,
     "seed": 3, "horizon": 10_000_000, "prefix-tokens": 16, "timeout": 10, "max-num-scheduled-tokens": 1024},
    {"workload": "chatbot", "rate": 2.5, "num-requests": 0, "horizon": 5_000_000, "scheduler": "sjf",
     "preemption-policy": "priority", "long-prefill-token-threshold": 64},
    {"workload-spec": "spec.yaml", "num-requests": 10, "rate": 3},
    {"num-instances": 4, "routing-policy": "weighted", "routing-scorers": "queue-depth:1", "admission-policy":
     "token-bucket", "token-bucket-capacity": 500, "flow-control": True, "saturation-detector": "concurrency",
     "queue-shedding": True, "request-ttl": 1000, "snapshot-refresh-interval": 0, "admission-latency": 7},
    {"alpha-coeffs": list(_COEFFS.alpha), "beta-coeffs": ",".join(str(b) for b in _COEFFS.beta), "hardware": "A100",
     "tp": 2, "latency-model": "trained-physics", "max-model-len": 4096, "block-size-in-tokens": 32,
     "gpu-memory-utilization": 0.8, "total-kv-blocks": 5000, "model": "qwen/qwen3-14b"},
    {"num-instances": 4, "prefill-instances": 2, "decode-instances": 2, "pd-decider": "always", "prefill-tp": 2,
     "decode-hardware": "A100", "pd-transfer-contention": True, "flow-control": False, "latency-model": "roofline"},
]


@pytest.mark.parametrize("settings", EXAMPLES)
def test_apply_settings_builds_what_run_builds(settings):
    args = run_parser().parse_args(_flags(settings))
    with naming(FLAG_OF_FIELD):
        expected = scenario_config(args, seed_given="seed" in settings)
    assert apply_settings(settings, "grid") == expected


def test_defaults_and_spellings():
    assert apply_settings({}, "g") == ScenarioConfig()
    assert apply_settings({"max_num_running_reqs": 8, "--rate": 2}, "g") == apply_settings(
        {"max-num-seqs": 8, "rate": 2.0}, "g")


@pytest.mark.parametrize("settings, message", [
    ({"max-num-seqs": 0}, "g: s1.max-num-seqs 0"),  # the library's check, named by the key
    ({"rate": 0}, "g: s1.rate 0.0: must be a finite number of requests/s > 0"),
    ({"prompt-tokens": -5}, "g: s1.prompt-tokens -5"),
    ({"alpha-coeffs": [1, 2, 3]}, "g: s1.alpha-coeffs needs g: s1.beta-coeffs too"),
    ({"rate": "fast"}, "g: s1.rate: 'fast' must be a finite number"),
    ({"max-num-seqs": 2.5}, "g: s1.max-num-seqs: 2.5 must be an integer"),
    ({"scheduler": "lifo"}, "g: s1.scheduler: 'lifo' is not one of fcfs"),
    ({"queue-shedding": "yes"}, "g: s1.queue-shedding: 'yes' must be true or false"),
    ({"beta-coeffs": [1, "x"]}, "g: s1.beta-coeffs[1]: 'x' must be a finite number"),
    ({"max-num-seq": 8}, "g: s1.max-num-seq: unknown setting"),
    ({"max-num-seqs": 8, "max-num-running-reqs": 4}, "max-num-seqs is set twice"),
    ({"saturation-detector": "concurrency"}, "g: s1: the gateway-queue settings (saturation-detector) need "
                                             "flow-control: true"),
])
def test_errors_name_the_setting(settings, message):
    with pytest.raises(ConfigError) as e:
        apply_settings(settings, "g: s1")
    assert message in str(e.value), str(e.value)


def test_sweep_scenarios_refuse_closed_loop_sessions(tmp_path):
    """A sweep resolves its scenarios as `run` does, but its lanes are open-loop: a workload
    with closed-loop sessions is refused, naming the scenario and the setting."""
    import yaml

    from blis_jax.sweep import settings as sweep_settings

    spec = tmp_path / "sessions.yaml"
    spec.write_text(yaml.safe_dump({
        "version": "2", "seed": 3, "num_requests": 2, "aggregate_rate": 10.0, "clients": [{
            "id": "mt", "rate_fraction": 1.0, "arrival": {"process": "poisson"},
            "input_distribution": {"type": "constant", "params": {"value": 20}},
            "output_distribution": {"type": "constant", "params": {"value": 4}},
            "reasoning": {"multi_turn": {"max_rounds": 2, "think_time_us": 10_000, "context_growth": "accumulate",
                                         "single_session": True}}}]}))

    class Quiet:
        def warn(self, message):
            pass

    with pytest.raises(ConfigError, match=r"^g: s0\.workload-spec: closed-loop sessions"):
        sweep_settings.resolve({"workload-spec": str(spec)}, Quiet(), "g: s0")
    resolved = sweep_settings.resolve({"rate": 4, "num-requests": 5, "max-num-seqs": 8}, Quiet(), "g: s0")
    assert len(resolved.requests) == 5 and resolved.max_num_seqs == 8 and resolved.sessions is None
    with pytest.raises(ConfigError, match=r"^g: s0: .*total-kv-blocks"):  # a library error, named by its key
        sweep_settings.resolve({"max-model-len": 10**6, "total-kv-blocks": 10}, Quiet(), "g: s0")
