"""The zctl command line: export and verify end to end on the tiny model, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console.cli import app

runner = CliRunner()


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
