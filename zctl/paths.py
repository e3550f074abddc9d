"""Where zctl keeps its state: exports, node ids, cluster files (override with ZCTL_HOME)."""

from __future__ import annotations

import os
from pathlib import Path


def zctl_home() -> Path:
    return Path(os.environ.get("ZCTL_HOME", Path.home() / ".cache" / "zctl"))


def export_cache_dir() -> Path:
    return zctl_home() / "exports"


def source_cache_dir() -> Path:
    """Model sources converted once (the default model's GGUF as an HF directory)."""
    return zctl_home() / "sources"
