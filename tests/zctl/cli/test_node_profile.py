"""`zctl node profile`: measures this PC for a shape and format, keeps the profile, uses it
again, measures a damaged or stale one again, and says what is wrong with bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.planner.measured import PROFILE_FORMAT
from zctl.cli.app import app

runner = CliRunner()
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 384}


def _config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.mark.slow
def test_a_profile_is_measured_once_kept_and_measured_again_when_damaged(tmp_path: Path) -> None:
    args = ["node", "profile", "--model", _config(tmp_path), "--weights", "fp32", "--device",
            "CPU", "--budget", "20", "--state-dir", str(tmp_path / "node"), "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "profiling" in first.stderr
    profile = json.loads(first.stdout)
    assert profile["format"] == PROFILE_FORMAT and profile["weights"] == "fp32"
    assert len(profile["decode_s"]) == 4 and profile["measurement"]["rounds"] >= 2
    kept = runner.invoke(app, args)
    assert kept.exit_code == 0 and "profiling" not in kept.stderr
    assert json.loads(kept.stdout) == profile
    (path,) = (tmp_path / "node" / "profiles").glob("*.json")
    path.write_text("{")
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "its profile is damaged" in again.stderr and "measuring again" in again.stderr
    table = runner.invoke(app, args[:-1])
    assert table.exit_code == 0 and "CPU" in table.stdout and "kept in" in table.stdout


@pytest.mark.slow
def test_each_int8_form_is_profiled_and_kept_apart(tmp_path: Path) -> None:
    """An export in u8 channels is timed on u8 channels, and never takes the i8-groups
    profile kept beside it (nor the other way)."""
    base = ["node", "profile", "--model", _config(tmp_path), "--weights", "int8", "--device",
            "CPU", "--budget", "20", "--state-dir", str(tmp_path / "node"), "--json"]
    forms = {}
    for form in ("u8-channel", "i8-groups"):
        result = runner.invoke(app, [*base, "--int8-form", form])
        assert result.exit_code == 0, result.output
        assert f"INT8 {form}" in result.stderr and "profiling" in result.stderr
        forms[form] = json.loads(result.stdout)
        assert forms[form]["int8_form"] == form
    default = runner.invoke(app, base)  # an int8 export written now: i8 groups, kept
    assert default.exit_code == 0 and "profiling" not in default.stderr
    assert json.loads(default.stdout) == forms["i8-groups"]
    assert len(list((tmp_path / "node" / "profiles").glob("*.json"))) == 2


@pytest.mark.parametrize(("args", "message"), [
    (["--weights", "int2"], "--weights is auto or one of"),
    (["--model", "no-such-model"], "not a preset"),
    (["--model", "llama-3.1-70b", "--device", "CPU", "--memory-mb", "1000"],
     "needs ~2.9 GB (three layers and the LM head), 50% of the 1.0 GB free"),
    (["--device", "CPU", "--budget", "0.5"], "Invalid value for '--budget'"),
    (["--weights", "int8", "--int8-form", "u4-groups"], "--int8-form is one of i8-groups"),
    (["--weights", "fp16", "--int8-form", "i8-groups"], "a fp16 export holds no INT8"),
])
def test_bad_input_gets_one_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["node", "profile", "--state-dir", str(tmp_path), *args],
                           terminal_width=200)
    assert result.exit_code != 0
    assert message in result.output
