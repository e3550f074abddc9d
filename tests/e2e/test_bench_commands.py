"""zctl bench end to end: the command becomes the benchmark's own program (``python -m
tools...``), from the checkout it was installed from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.repo import ROOT


def _zctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zctl", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_bench_help_is_the_benchmarks_own() -> None:
    """zctl bench becomes the benchmark's own program (python -m tools...)."""
    result = _zctl("bench", "parity", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--model", "--weights", "--tokens", "--runs", "--threads", "--json",
                   "--extras"):
        assert option in result.stdout, result.stdout
    result = _zctl("bench", "static", "--contexts", "0")  # refused before work
    assert result.returncode == 2 and "--contexts" in result.stderr, result.stderr


def test_bench_finds_the_checkout_it_was_installed_from(tmp_path: Path) -> None:
    """The zctl script does not run with the checkout on sys.path: zctl bench finds it."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys\nsys.path[:] = [p for p in sys.path if p not in "
         "('', '.')]\nfrom zctl.cli.app import app\napp(['bench', 'parity', '--help'])"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--tokens" in proc.stdout and "--runs" in proc.stdout
