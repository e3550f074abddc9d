"""The real thing, once, on the smallest case: the tiny random model on 2 nodes sharing the
cores, profiled as it joins, predicted from its status, then run at 1 and 8 streams. The
figures are not held to the targets (a 4-layer model on a busy machine says nothing of the
model of time); the prediction and the measurements are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tools.plan import cli


@pytest.mark.e2e
def test_the_tiny_case_is_predicted_then_measured(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    app = typer.Typer()
    app.command()(cli.main)
    result = CliRunner().invoke(app, ["--cases", "tiny-2n-shared", "--tokens", "8",
                                      "--rounds", "1", "--timeout", "300", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    case = report["cases"]["tiny-2n-shared"]
    assert "failed" not in case, case
    assert [s["node"] for s in case["placement"]][0] and len(case["placement"]) == 2
    assert len(case["predicted_step_ms"]) == 2 and len(case["predicted_hop_ms"]) == 2
    for streams in ("1", "8"):
        got = case["streams"][streams]
        assert got["predicted_tok_s"] > 0 and got["measured_tok_s"] > 0
        assert got["error"] == pytest.approx(
            (got["predicted_tok_s"] - got["measured_tok_s"]) / got["measured_tok_s"], abs=1e-3)
    assert case["streams"]["8"]["row_groups"] == 1  # shared cores: one group of every stream
    assert set(report["targets"]) == {"1 stream within 15%", "8 streams within 25%"}
