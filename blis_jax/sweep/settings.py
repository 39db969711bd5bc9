"""One scenario's settings: `blis-jax run` flags as a mapping, checked and resolved by the CLI.

A sweep scenario is exactly a `blis-jax run` command line: its settings (keys are run-flag
names without the dashes, e.g. `max-num-seqs`) become run-flag tokens, are parsed by the `run`
parser itself and resolved by `cli.resolve_run`, so defaults, precedence and validation cannot
drift from `run` (the flags are the scenario schema). Output and logging flags are not
settings: a sweep writes its own table.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

from blis_jax.errors import ConfigError
from blis_jax.io_safety import clip, short

# `run` flags that are not scenario settings (outputs, logging).
NOT_SETTINGS = frozenset({"help", "metrics-path", "results-path", "trace-output", "progress", "log"})
# Settings whose value is a list of numbers (given as a YAML list or a comma string).
LIST_SETTINGS = frozenset({"alpha-coeffs", "beta-coeffs"})


@dataclasses.dataclass(frozen=True)
class Setting:
    """A `run` flag seen as a scenario setting."""

    key: str  # canonical flag name without the leading dashes
    dest: str  # argparse destination
    kind: type  # int, float, str, or bool for a switch (true: the flag is given)
    choices: tuple[str, ...] | None


@functools.cache
def _run_parser() -> argparse.ArgumentParser:
    # The CLI owns the flags. Imported here, not at the top: cli imports this package lazily.
    from blis_jax import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


@functools.cache
def settings_schema() -> Mapping[str, Setting]:
    """Every run setting by key, aliases included (`max-num-running-reqs` → max-num-seqs)."""
    schema: dict[str, Setting] = {}
    for action in _run_parser()._actions:
        longs = [o[2:] for o in action.option_strings if o.startswith("--")]
        switch = isinstance(action, argparse._StoreTrueAction)  # e.g. --flow-control: true / false
        if not longs or longs[0] in NOT_SETTINGS or (action.nargs == 0 and not switch):
            continue
        setting = Setting(key=longs[0], dest=action.dest, kind=bool if switch else (action.type or str),
                          choices=tuple(action.choices) if action.choices else None)
        for name in longs:
            schema[name] = setting
    return schema


def run_default(key: str) -> Any:
    """The `run` parser's default of a setting (e.g. routing-policy → round-robin)."""
    return _run_parser().get_default(settings_schema()[key].dest)


def canonical_key(key: Any, where: str) -> str:
    """The canonical setting key of a YAML key (underscores accepted for dashes)."""
    if not isinstance(key, str):
        raise ConfigError(f"{where}: key {short(key)} must be a string (a `blis-jax run` flag name)")
    name = key.strip().lstrip("-").replace("_", "-")
    schema = settings_schema()
    if name in schema:
        return schema[name].key
    if name in NOT_SETTINGS:
        raise ConfigError(f"{where}.{key}: is a `run` output flag, not a scenario setting; a sweep "
                          "writes its own table (use --output-dir)")
    raise ConfigError(f"{where}.{clip(key)}: unknown setting{_did_you_mean(name, schema)}; settings are "
                      "`blis-jax run` flag names without the dashes (see `blis-jax run --help`)")


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def value_token(key: str, value: Any, where: str) -> str:
    """A YAML value → the run-flag token, type-checked (the error names `where` and the key)."""
    setting = settings_schema()[key]
    if key in LIST_SETTINGS:
        return _number_list(value, f"{where}.{key}")
    if setting.kind is bool:
        text = str(value).lower() if isinstance(value, (bool, str)) else ""
        if text not in ("true", "false"):
            raise ConfigError(f"{where}.{key}: {short(value)} must be true or false (a switch of `blis-jax run`)")
        return text
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        raise ConfigError(f"{where}.{key}: {short(value)} is not a valid value; give {_expected(setting)}")
    if setting.kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise ConfigError(f"{where}.{key}: {short(value)} must be an integer")
        return str(value)
    if setting.kind is float:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}.{key}: {short(value)} must be a finite number")
        return repr(float(value))
    text = str(value)
    if setting.choices and text not in setting.choices:
        raise ConfigError(f"{where}.{key}: {short(text)} is not one of {', '.join(setting.choices)}")
    return text


def _expected(setting: Setting) -> str:
    if setting.choices:
        return f"one of {', '.join(setting.choices)}"
    return {int: "an integer", float: "a number", bool: "true or false"}.get(setting.kind, "a string")


def _number_list(value: Any, where: str) -> str:
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ConfigError(f"{where}: {short(value)} must be a list of numbers, e.g. [15563.2, 777.35, 45.91]")
    out = []
    for i, part in enumerate(parts):
        try:
            number = float(part) if not isinstance(part, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise ConfigError(f"{where}[{i}]: {short(part)} must be a finite number")
        out.append(repr(number))
    return ",".join(out)


def run_argv(settings: Mapping[str, str]) -> list[str]:
    """Run-flag tokens of checked settings ({key: token})."""
    argv: list[str] = []
    schema = settings_schema()
    for key, token in settings.items():
        if schema[key].kind is bool:  # a switch: present or absent
            argv += [f"--{key}"] if token == "true" else []
        else:
            argv += [f"--{key}", token]
    return argv


def parse_run_args(settings: Mapping[str, str], where: str) -> argparse.Namespace:
    """Parse settings with the `run` parser (its defaults fill the rest)."""
    from blis_jax import cli

    try:
        return _run_parser().parse_args(run_argv(settings))
    except cli.UsageError as e:
        raise ConfigError(f"{where}: {e}") from None


def resolve(settings: Mapping[str, str], diag, where: str):
    """(cli.Scenario, RequestSet, EngineParams) of a scenario, exactly as `blis-jax run`
    resolves its flags."""
    from blis_jax import cli

    args = parse_run_args(settings, where)
    try:
        scenario, requests = cli.resolve_run(args, diag)
        return scenario, requests, cli.engine_params(scenario)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
