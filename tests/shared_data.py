"""Where the tests find BLIS's reference data: `../shared` beside the checkout (never copied
into the project). One definition of the paths and of the skip rule, for every test file.

Outside CI a missing `../shared` skips the tests that read it, with the path in the reason.
Under CI (CI set), `../shared` is always laid beside the clone, so the tests run and a
missing reference fails loudly instead of being skipped silently.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
REFERENCE = SHARED / "reference"
BLIS_REF = REFERENCE / "blis"
BLIS_DIFF = REFERENCE / "blis-diff"


def needs(path: Path, what: str):
    """Skip marker for tests that read `path` (see the module docstring for CI)."""
    return pytest.mark.skipif(
        not path.exists() and not os.environ.get("CI"),
        reason=f"{what} not found at {path} (it lives in ../shared beside the checkout)",
    )


needs_blis_diff = needs(BLIS_DIFF, "BLIS differential reference set")
needs_blis_ref = needs(BLIS_REF, "BLIS reference configs")
