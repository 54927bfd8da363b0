"""Chart tests: helpers live in chart_helpers.py (imported by name; see its docstring)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart_helpers import helm_binary  # noqa: E402


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_binary()
