"""The e2e and slow marks keep the multi-process end-to-end tests apart and the quick suite
single-process: tests/conftest.py fails a test that starts one of zctl's own processes
without the e2e mark, or any other Python process without the slow mark, marks every test
under tests/e2e/ e2e and every e2e test slow (checked here on a throwaway test tree)."""

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

NODE_ENTRY = [sys.executable, "-m", "zctl.launcher"]  # its usage line, exit 2


def test_quick_but_starts_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_slow_and_starts_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_quick_and_starts_another_program():
    subprocess.run(["true"], check=True)


@pytest.mark.slow
def test_slow_but_starts_a_node_entry():
    subprocess.run(NODE_ENTRY, capture_output=True)


@pytest.mark.e2e
def test_e2e_and_starts_a_node_entry():
    subprocess.run(NODE_ENTRY, capture_output=True)


def test_quick_but_starts_a_zctl_program(tmp_path):
    program = tmp_path / "zctl"
    program.write_text("#!/bin/sh\\n")
    program.chmod(0o755)
    subprocess.run([str(program), "run"], check=True)


def test_quick_but_starts_a_wrapped_stage_worker_in_a_shell():
    subprocess.run(f"env {sys.executable} -m dataplane.worker --help >/dev/null",
                   shell=True, check=True)


def test_quick_but_starts_python_and_a_node_entry():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    subprocess.run(NODE_ENTRY, capture_output=True)
'''

E2E_MODULE = '''
import subprocess
import sys


def test_unmarked_but_under_e2e_and_starts_a_node_entry():
    subprocess.run([sys.executable, "-m", "zctl.launcher"], capture_output=True)
'''


@pytest.mark.slow
def test_a_test_starting_processes_without_their_marks_fails(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow\n    e2e\n")
    (tmp_path / "test_module.py").write_text(MODULE)
    (tmp_path / "e2e").mkdir()
    (tmp_path / "e2e" / "test_in_e2e.py").write_text(E2E_MODULE)

    def pytest_run(*args: str) -> str:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              *args, str(tmp_path)],
                             cwd=HERE.parent, capture_output=True, text=True, timeout=300)
        return run.stdout + run.stderr

    out = pytest_run("-rE")
    assert "9 passed, 5 errors" in out, out  # the errors at teardown, below
    assert ("test_module.py::test_quick_but_starts_python started 1 process(es) "
            f"({sys.executable} -c pass ...) but is not marked slow") in out, out
    node_entry = f"({sys.executable} -m zctl.launcher ...) but is not marked e2e"
    assert ("test_module.py::test_slow_but_starts_a_node_entry started 1 of zctl's own "
            f"process(es) {node_entry}") in out, out
    zctl_program = out[out.index("test_module.py::test_quick_but_starts_a_zctl_program started"):]
    assert zctl_program.startswith("test_module.py::test_quick_but_starts_a_zctl_program "
                                   "started 1 of zctl's own process(es) (/"), out
    assert "/zctl run ...) but is not marked e2e" in zctl_program.splitlines()[0], out
    assert ("test_module.py::test_quick_but_starts_a_wrapped_stage_worker_in_a_shell started "
            f"1 of zctl's own process(es) ({sys.executable} -m dataplane.worker --help ...) "
            "but is not marked e2e") in out, out
    assert ("test_module.py::test_quick_but_starts_python_and_a_node_entry started 1 of "
            f"zctl's own process(es) {node_entry}; and started 1 process(es) "
            f"({sys.executable} -c pass ...) but is not marked slow") in out, out
    # the e2e tests (marked, or under e2e/) are slow: the quick run leaves them out
    out = pytest_run("--collect-only", "-m", "not slow")
    assert "5/9 tests collected (4 deselected)" in out, out
    assert "e2e_and_starts" not in out and "test_in_e2e" not in out, out
