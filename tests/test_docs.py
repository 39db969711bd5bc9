"""Every code example of README.md and docs/*.md works: Python blocks are executed (in a
temporary folder), shell blocks name commands and flags the CLI has."""

import argparse
import re
import shlex
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)
# Python blocks that simulate (compilation dominates): (file, index of the Python block in it)
SLOW = {("README.md", 0)}


def blocks(lang: str) -> list[tuple[str, int, str]]:
    """(file name, index among that file's `lang` blocks, code) of every fenced `lang` block."""
    found = []
    for path in DOCS:
        text = path.read_text()
        matches = [m for m in FENCE.finditer(text) if m.group("lang") in ({lang} if lang != "bash" else {"bash", "sh"})]
        found += [(path.name, i, textwrap.dedent(m.group("body"))) for i, m in enumerate(matches)]
    return found


def _python_params():
    return [pytest.param(code, id=f"{name}-{i}", marks=[pytest.mark.slow] if (name, i) in SLOW else [])
            for name, i, code in blocks("python")]


def test_docs_have_the_examples_they_promise():
    assert any(name == "README.md" for name, _, _ in blocks("python")), "the README has a Python API example"
    for path in DOCS:   # an unclosed fence would swallow the text after it
        assert len(re.findall(r"^[ \t]*```", path.read_text(), re.MULTILINE)) % 2 == 0, path.name
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[\w.]+)\)", readme):
        assert (ROOT / link).is_file(), link


@pytest.mark.parametrize("code", _python_params())
def test_python_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # whatever an example writes lands here
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_example__"})


# ----------------------------------------------------------------------------- shell blocks


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:   # argparse has no public accessor for subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _commands(code: str) -> list[list[str]]:
    """The `blis-jax ...` / `python -m blis_jax ...` command lines of a shell block (continuation
    lines joined, comments and `&&` chains split), as argument lists after the program name."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            # leading environment assignments (BLIS_JAX_COMPILE_CACHE=0 blis-jax ...)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words[:1] == ["blis-jax"]:
                commands.append(words[1:])
            elif words[:3] == ["python", "-m", "blis_jax"]:
                commands.append(words[3:])
    return commands


def _check_command(parser: argparse.ArgumentParser, args: list[str]) -> None:
    top_flags = _flags(parser)
    while args and args[0] in top_flags:   # `blis-jax --no-compile-cache sweep ...`
        args = args[1:]
    assert args, "no subcommand"
    subs = _subcommands(parser)
    assert args[0] in subs, f"unknown subcommand {args[0]!r}"
    sub = subs[args[0]]
    nested = _subcommands(sub)
    if nested and len(args) > 1 and not args[1].startswith("-"):   # `convert preset ...`
        assert args[1] in nested, f"unknown {args[0]} subcommand {args[1]!r}"
        sub = nested[args[1]]
    known = _flags(sub) | top_flags
    for word in args:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in known, f"{args[0]}: unknown flag {flag}"


def _shell_params():
    return [pytest.param(code, id=f"{name}-{i}") for name, i, code in blocks("bash")]


@pytest.mark.parametrize("code", _shell_params())
def test_shell_block_names_real_commands_and_flags(code):
    from blis_jax.cli.app import build_parser

    parser = build_parser()
    for args in _commands(code):
        _check_command(parser, args)
    for path in re.findall(r"python (benchmarks/[\w/.-]+\.py)", code):
        assert (ROOT / path).is_file(), path


def test_shell_check_catches_a_wrong_flag():
    from blis_jax.cli.app import build_parser

    parser = build_parser()
    _check_command(parser, ["convert", "preset", "--name", "chatbot"])
    with pytest.raises(AssertionError, match="unknown flag --no-such-flag"):
        _check_command(parser, ["run", "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="unknown subcommand"):
        _check_command(parser, ["runn"])
    assert _commands("BLIS_JAX_COMPILE_CACHE=0 blis-jax run \\\n  --rate 2  # comment\npip install .") == [
        ["run", "--rate", "2"]]

