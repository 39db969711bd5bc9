"""One sweep scenario's settings: `blis-jax run` flag names → a resolved scenario.

A sweep scenario is what a `blis-jax run` command line with those flags simulates: its settings
(keys are run-flag names without the dashes, e.g. `max-num-seqs`) are checked and turned into a
`ScenarioConfig` by the library's settings table (`blis_jax.scenario.settings`, kept equal to
the `run` parser by a test) and resolved by `blis_jax.scenario.resolve`. Output and logging
flags are not settings: a sweep writes its own table. Errors name `<scenario>.<key>`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from blis_jax.errors import ConfigError
from blis_jax.io_safety import clip, short
from blis_jax.naming import naming
from blis_jax.scenario import ResolvedScenario
from blis_jax.scenario import resolve as resolve_scenario
from blis_jax.scenario.settings import apply_settings, check_value, field_names, find_setting, settings_by_key

# `run` flags that are not scenario settings (outputs, logging, the process's memory limit).
NOT_SETTINGS = frozenset({"help", "metrics-path", "results-path", "trace-output", "progress", "log"})
PROCESS_SETTINGS = frozenset({"max-memory-gib"})

__all__ = ["NOT_SETTINGS", "canonical_key", "check_value", "default", "resolve"]


def default(key: str) -> Any:
    """A setting's value when a scenario does not give it (e.g. routing-policy → round-robin)."""
    return settings_by_key()[key].default


def canonical_key(key: Any, where: str) -> str:
    """The canonical setting key of a YAML key (underscores accepted for dashes)."""
    if not isinstance(key, str):
        raise ConfigError(f"{where}: key {short(key)} must be a string (a `blis-jax run` flag name)")
    setting = find_setting(key)
    if setting is not None:
        return setting.key
    name = key.strip().lstrip("-").replace("_", "-")
    if name in NOT_SETTINGS:
        raise ConfigError(f"{where}.{key}: is a `run` output flag, not a scenario setting; a sweep "
                          "writes its own table (use --output-dir)")
    if name in PROCESS_SETTINGS:
        raise ConfigError(f"{where}.{key}: limits the whole process, not a scenario; give it to the command "
                          f"(blis-jax sweep --{name})")
    raise ConfigError(f"{where}.{clip(key)}: unknown setting{_did_you_mean(name, settings_by_key())}; settings are "
                      "`blis-jax run` flag names without the dashes (see `blis-jax run --help`)")


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def resolve(settings: Mapping[str, Any], diag, where: str) -> ResolvedScenario:
    """The resolved scenario of checked settings ({key: value}), as `blis-jax run` with those
    flags resolves it; closed-loop sessions are refused (sweeps run open-loop lanes)."""
    from blis_jax.sweep import scaling_axes

    settings, scaling_values = scaling_axes.split(settings)
    config = apply_settings(settings, where)
    config = scaling_axes.apply(config, scaling_values, where, warn=diag.warn if diag is not None else None)
    # named by bare keys here: a warning then reads the same for every scenario (said once)
    with naming(field_names()):
        try:
            resolved = resolve_scenario(config, warn=diag.warn)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    if resolved.lora is not None:
        raise ConfigError(f"{where}.lora-config: LoRA adapters are not supported in sweeps yet; use `blis-jax run` "
                          "for this scenario")
    if resolved.cpu_tier is not None:
        raise ConfigError(f"{where}.kv-cpu-blocks: the CPU KV tier is not supported in sweeps yet; use `blis-jax run` "
                          "for this scenario")
    if resolved.offload is not None:
        raise ConfigError(f"{where}.kv-offload-config: the multi-tier KV offload chain is not supported in sweeps "
                          "yet; use `blis-jax run` for this scenario")
    if resolved.sessions is not None:
        raise ConfigError(f"{where}.workload-spec: closed-loop sessions (their rounds arrive during the run) are not "
                          "supported in sweeps yet; use `blis-jax run` for this workload")
    return resolved
