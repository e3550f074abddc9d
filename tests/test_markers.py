"""The slow mark keeps the quick suite single-process: tests/conftest.py fails a test that
starts a Python process without it (checked here on a throwaway test module)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

MODULE = '''
import subprocess
import sys

import pytest


def test_quick_but_starts_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_slow_and_starts_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_quick_and_starts_another_program():
    subprocess.run(["true"], check=True)
'''


@pytest.mark.slow
def test_a_test_starting_python_without_the_slow_mark_fails(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_module.py").write_text(MODULE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "markers=slow", str(tmp_path / "test_module.py")],
                         cwd=HERE.parent, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "3 passed, 1 error" in out, out
    assert ("test_module.py::test_quick_but_starts_python started 1 process(es) "
            f"({sys.executable} -c pass ...) but is not marked slow") in out, out
