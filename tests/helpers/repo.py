"""The checkout the tests run in (its root: where pyproject.toml is)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
