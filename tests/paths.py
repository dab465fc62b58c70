"""The repository root, as every test finds it (tests run from any directory, in tests/unit or tests/integration)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
