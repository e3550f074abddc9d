"""What ``pip install .`` puts into site-packages: the ``zctl`` namespace and the three rooms
the product was specified with at the top (controlplane, dataplane, exporter), every
sub-package of theirs, and nothing generic (no ``common``, ``engine``, ``console`` or
``serve`` beside other projects' packages); never the benchmarks (``tools``) or the tests.
The Dockerfile copies exactly what is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.repo import ROOT

TOP_LEVEL = {"zctl", "controlplane", "dataplane", "exporter"}


def source_packages() -> set[str]:
    """Every package directory (one with __init__.py) of the installed rooms, dotted."""
    found = set()
    for top in TOP_LEVEL:
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


@pytest.mark.slow
def test_the_wheel_holds_zctl_and_the_specified_rooms_only(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy: setuptools builds in the source tree (build/)
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".ci-home", "__pycache__", "build", "*.egg-info", ".*_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--quiet", "-w", str(tmp_path), str(source)],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("zctl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == TOP_LEVEL, f"top-level entries of the wheel: {sorted(top)}"
    packages = {".".join(Path(n).parent.parts) for n in names if n.endswith("/__init__.py")}
    assert packages == source_packages(), sorted(packages ^ source_packages())
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "zctl = zctl.cli.app:app" in zipfile.ZipFile(wheel).read(entry).decode()


def test_the_dockerfile_copies_what_is_installed() -> None:
    copied = {line.split()[1] for line in (ROOT / "compose" / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and not line.startswith("COPY pyproject")}
    assert copied == TOP_LEVEL
