"""The zctl command line: export and verify end to end on the tiny model, and its errors;
zctl bench's summaries and refusal. (zctl bench running a benchmark:
tests/e2e/test_bench_commands.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers.repo import ROOT
from zctl.cli.app import app

runner = CliRunner()


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter at the repository's top (as ``zctl`` starts)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_export_then_verify_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exp"
    result = runner.invoke(app, ["export", str(tiny_llama_dir), "--layers", "0-0,1-3",
                                 "--weights", "fp32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "exported" in result.output and (out / "manifest.json").is_file()
    result = runner.invoke(app, ["verify", str(out), "--max-new-tokens", "16", "--json",
                                 "--prompt", "hello there", "--prompt", "the sky is"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["exact"] == 2 and report["prompts"] == 2


def test_export_errors_are_one_line_and_nonzero(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cases = [
        (["export", str(tiny_llama_dir), "--layers", "0-1,3-3", "--out", str(tmp_path / "a")],
         "starting at layer 2"),
        (["export", str(tiny_llama_dir), "--stages", "9", "--out", str(tmp_path / "b")],
         "cannot split 4 layers"),
        (["export", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "c")], "no such"),
        (["export", str(tiny_llama_dir), "--stages", "2", "--layers", "0-3"], "not both"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert "error:" in result.output and message in result.output, result.output
    assert not any(tmp_path.iterdir())


def test_verify_refuses_a_corrupted_export(tiny_exports, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_exports.get([(0, 4)]), broken)
    (broken / "stage0.bin").write_bytes(b"garbage")
    result = runner.invoke(app, ["verify", str(broken)])
    assert result.exit_code == 1
    assert "corrupted" in result.output


@pytest.mark.slow
def test_zctl_starts_without_importing_the_benchmarks() -> None:
    proc = _python("import sys, zctl.cli.app\n"
                   "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tools'))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bench_summaries_are_the_modules_first_lines() -> None:
    import importlib

    from zctl.cli.app import BENCHMARKS

    for name, (module, summary) in BENCHMARKS.items():
        doc = importlib.import_module(f"tools.{module}").__doc__
        assert doc.splitlines()[0] == summary, name


def test_bench_without_tools_says_so_in_one_line(monkeypatch) -> None:
    # an installed zctl outside a source checkout: no tools/ to run
    import zctl.cli.app as cli

    monkeypatch.setattr(cli, "_checkout_with_tools", lambda: None)
    result = runner.invoke(cli.app, ["bench", "parity", "--help"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "benchmarks run from a source checkout" in lines[0], result.output
