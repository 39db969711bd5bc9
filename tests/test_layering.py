"""The library comes first and the CLI is one client of it: no module outside `blis_jax/cli/`
imports the CLI (function-level imports included), so no import cycle runs through it. The
`python -m blis_jax` entry point (`__main__.py`) is the CLI's own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "blis_jax"
ENTRY_POINTS = {PACKAGE / "__main__.py"}


def cli_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "blis_jax.cli" or a.name.startswith("blis_jax.cli.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "blis_jax.cli" or node.module.startswith("blis_jax.cli."):
                found.append(node.module)
            elif node.module == "blis_jax" and any(a.name == "cli" for a in node.names):
                found.append("blis_jax.cli")
        elif isinstance(node, ast.ImportFrom) and node.level > 0 and any(a.name == "cli" for a in node.names):
            found.append("." * node.level + "cli")
    return found


def test_no_library_module_imports_the_cli():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "cli") or path in ENTRY_POINTS:
            continue
        if found := cli_imports(path):
            offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, f"library modules importing the CLI: {offenders}"


def test_the_check_sees_every_import_form(tmp_path):
    forms = ["import blis_jax.cli", "from blis_jax.cli import main", "from blis_jax import cli",
             "from blis_jax.cli.app import Diagnostics", "def f():\n    from blis_jax.cli import scenario_flags"]
    for i, source in enumerate(forms):
        path = tmp_path / f"m{i}.py"
        path.write_text(source + "\n")
        assert cli_imports(path), source
    clean = tmp_path / "clean.py"
    clean.write_text("from blis_jax import scenario\nimport blis_jax.client_like\n")
    assert cli_imports(clean) == []


def test_building_the_cli_parser_loads_no_optional_heavy_library():
    """Every command (`run --help` included) builds the whole parser: the optimiser, plotting,
    HTTP and SciPy libraries load only in the commands that use them (start-up time, #20)."""
    import subprocess
    import sys

    code = ("import sys; from blis_jax.cli import app; app.build_parser(); "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & {'optax', 'matplotlib', 'aiohttp', 'scipy'})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


# Modules that are also small tools of their own (`python -m ...`), whose flags build nothing
# the library uses: the golden pins writer and the local OpenAI-compatible test server.
OWN_TOOLS = {PACKAGE / "golden.py", PACKAGE / "observe" / "testserver.py"}


def test_only_the_cli_and_stand_alone_tools_parse_flags():
    """No library module builds a scenario from command-line flags: argparse lives in the CLI."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "cli") in path.parents or path in ENTRY_POINTS | OWN_TOOLS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names:
                offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []
