"""Printing a benchmark's result: where and when it ran (the CPU, its count, the date, the
checkout's commit), one JSON object (``--json``) or Rich tables, and the console on stderr
that progress goes to."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

err = Console(stderr=True)

# The instruction sets that change what the CPU plugin runs (int8 dynamic quantization on
# VNNI/AMX, bf16 where the hint allows it): a figure names the ones its CPU has.
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which every published figure names, with the
    CPU_FEATURES it has in brackets."""
    import platform

    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    features = [f for f in CPU_FEATURES if f in flags]
    return f"{name} [{' '.join(features)}]" if features else name


def run_record() -> dict[str, Any]:
    """Where and when a benchmark ran: CPU model and count, UTC date, the checkout's commit
    (with "-dirty" when it has uncommitted changes; "unknown" outside a git checkout)."""
    import os
    import subprocess
    from datetime import UTC, datetime

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return {"cpu": cpu_model(), "cpus": os.cpu_count(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit}


def print_result(result: Mapping[str, Any], as_json: bool,
                 render: Callable[[Mapping[str, Any], Console], None]) -> None:
    """A benchmark's result: one JSON object on stdout (``--json``), else ``render``'s
    tables."""
    if as_json:
        print(json.dumps(result))
    else:
        render(result, Console())


def metric_table(title: str, result: Mapping[str, Any], skip: Sequence[str] = ()) -> Table:
    """A two-column table of ``result``'s figures (the keys in ``skip`` left out)."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key not in skip:
            table.add_row(key, str(value))
    return table
