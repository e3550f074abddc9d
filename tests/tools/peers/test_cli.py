"""The command line: bad input is refused clearly; a failed build is llama.cpp's failure."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tools.peers import cli
from tools.peers.build import BuildFailure


def invoke(app: typer.Typer, args: list[str]):
    """Run the command with a terminal wide enough that Rich wraps no message."""
    return CliRunner(env={"COLUMNS": "400"}).invoke(app, args)


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    app.command()(cli.main)
    return app


def test_a_missing_llama_cpp_directory_is_a_clear_error(app, zctl_home: Path, tmp_path) -> None:
    result = invoke(app, ["--llama-cpp", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert "no such directory" in result.output


def test_a_directory_without_the_binaries_is_a_clear_error(app, zctl_home, tmp_path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    result = invoke(app, ["--llama-cpp", str(tmp_path / "bin")])
    assert result.exit_code == 2
    assert "ggml-rpc-server" in result.output and "llama-quantize" in result.output


@pytest.mark.parametrize("args, message", [
    (["--models", "gpt-5"], "--models takes"),
    (["--topologies", "4-split"], "--topologies takes"),
    (["--delays", "-1"], "--delays needs"),
    (["--amx", "maybe"], "--amx takes"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_options_are_refused(app, zctl_home, args, message) -> None:
    result = invoke(app, args)
    assert result.exit_code == 2 and message in result.output


def test_a_failed_build_is_llama_cpps_failure_with_its_log(monkeypatch, tmp_path) -> None:
    def failing_build(plan, cache, **kwargs):
        raise BuildFailure("llama.cpp's build failed (cmake --build exited 1)", "error: boom")

    monkeypatch.setattr(cli, "build", failing_build)
    llama = cli.llama_cpp(None, tmp_path, "off", None)
    assert llama.binaries is None
    assert llama.failure.log_tail == "error: boom"
    assert llama.info["failure"]["log_tail"] == "error: boom"
    assert llama.info["build"]["options"]["GGML_NATIVE"] == "OFF"
    run = cli.Run(cli.CasePlan(), llama, tmp_path, None)
    gguf = run.gguf("smollm2-135m", "int4")  # every case then reports this failure
    assert "could not be built" in str(gguf) and gguf.log_tail == "error: boom"
