"""The package installs on its own: every import declared, every package and data folder built.

`.ci/run` installs the project non-editable into a fresh virtual environment and runs these tests
with ``BLIS_JAX_EXPECT_INSTALLED`` set to that environment; there they also check that the
installed copy (not the checkout) was imported and that it reads its bundled data from inside
the package.
"""

import ast
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

import blis_jax
from blis_jax.config.bundled import REPOSITORY_FOLDERS, bundled_dir
from blis_jax.config.hardware import bundled_gpu_names
from blis_jax.config.model import bundled_model_ids, load_model

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# import name -> distribution name, where they differ
DISTRIBUTION_OF = {"yaml": "pyyaml"}
DATA_FILES = {"observed": "*.json"}   # the other bundled folders hold YAML


def _declared(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def _third_party_imports(root: Path) -> dict[str, str]:
    """Top-level third-party module -> one file importing it, for every module under root."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "blis_jax" and top != "__future__":
                    found.setdefault(top, str(path.relative_to(root.parent)))
    return found


def test_every_third_party_import_is_a_declared_dependency():
    declared = _declared(PYPROJECT["project"]["dependencies"])
    imports = _third_party_imports(REPO / "blis_jax")
    assert imports, "the scan found no third-party import at all"
    missing = {DISTRIBUTION_OF.get(m, m): f for m, f in imports.items()
               if DISTRIBUTION_OF.get(m, m).lower() not in declared}
    assert not missing, f"imported but not in [project].dependencies: {missing}"


def test_every_test_import_is_declared_in_the_test_extra_or_dependencies():
    declared = _declared(PYPROJECT["project"]["dependencies"]) | _declared(
        PYPROJECT["project"]["optional-dependencies"]["test"])
    imports = _third_party_imports(REPO / "tests")
    # modules of the test folder itself (imported by name: tests/ is on sys.path)
    local = {p.stem for p in (REPO / "tests").glob("*.py")}
    missing = {DISTRIBUTION_OF.get(m, m): f for m, f in imports.items()
               if m not in local and DISTRIBUTION_OF.get(m, m).lower() not in declared}
    assert not missing, f"imported by tests but not declared (test extra): {missing}"


def test_every_package_is_listed_and_every_data_folder_mapped():
    setuptools = PYPROJECT["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "blis_jax").rglob("__init__.py")}
    assert on_disk - listed == set(), "add these packages to [tool.setuptools].packages"
    mapped = setuptools["package-dir"]
    for kind, folder in REPOSITORY_FOLDERS.items():
        assert mapped[f"blis_jax.data.{kind}"] == folder
        assert f"blis_jax.data.{kind}" in listed
        assert list((REPO / folder).glob(DATA_FILES.get(kind, "*.yaml"))), f"{folder} holds no data file"


def test_bundled_data_is_readable_by_name():
    assert "meta-llama/Llama-3.1-8B-Instruct" in bundled_model_ids()
    assert "H100" in bundled_gpu_names()
    assert load_model("Qwen/Qwen3-14B").num_layers > 0
    for kind in REPOSITORY_FOLDERS:
        pattern = DATA_FILES.get(kind, "*.yaml")
        assert sorted(p.name for p in bundled_dir(kind).glob(pattern)) == sorted(
            p.name for p in (REPO / REPOSITORY_FOLDERS[kind]).glob(pattern)), kind
    with pytest.raises(KeyError, match="unknown bundled data kind"):
        bundled_dir("weights")


def test_license_is_apache_2():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()


@pytest.mark.skipif(not os.environ.get("BLIS_JAX_EXPECT_INSTALLED"),
                    reason="only under .ci/run, which installs the package non-editable into a fresh venv")
def test_ci_imports_the_installed_package_and_its_packaged_data():
    venv = Path(os.environ["BLIS_JAX_EXPECT_INSTALLED"]).resolve()
    package = Path(blis_jax.__file__).resolve().parent
    assert venv in package.parents, f"imported {package}, not the copy installed in {venv}"
    for kind in REPOSITORY_FOLDERS:
        assert bundled_dir(kind).resolve() == package / "data" / kind
