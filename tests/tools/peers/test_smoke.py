"""The real thing, once, in quick mode on SmolLM2: zctl and llama.cpp (binaries named by
ZCTL_TEST_LLAMA_CPP, e.g. a build of the pinned release's bin/) on 2 nodes, a core each,
10 ms per hop. Skipped without those binaries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tools.peers import cli

LLAMA_CPP = os.environ.get("ZCTL_TEST_LLAMA_CPP", "")


@pytest.mark.e2e
@pytest.mark.skipif(not (LLAMA_CPP and (Path(LLAMA_CPP) / "llama-server").is_file()),
                    reason="no llama.cpp binaries (set ZCTL_TEST_LLAMA_CPP to their directory)")
def test_quick_run_on_two_nodes_with_a_core_each_and_10_ms_hops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("2 nodes with a core each need 2 cores")
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    app = typer.Typer()
    app.command()(cli.main)
    result = CliRunner().invoke(app, ["--quick", "--json", "--llama-cpp", LLAMA_CPP,
                                      "--topologies", "2-split", "--delays", "10"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    case = "smollm2-135m/int4/2n-split/10ms"
    assert [c["case"] for c in out["cases"]] == [case]
    record = out["cases"][0]
    assert record["failures"] == {}, record["failures"]
    assert any(line.startswith("RPC0[127.0.0.2:") for line in record["placement"]["llama.cpp"])
    assert out["delay_check"][0]["same"], out["delay_check"]
    for figure in ("one_stream.p128/decode_tok_s", "one_stream.p128/ttft_ms", "serve.c4/tok_s"):
        assert out["ratios"][f"{case}/{figure}"] > 0
    # no 8 or 16 clients in quick; no greedy check either (its target unmet)
    assert set(out["targets"]) == {"greedy/smollm2-135m", f"one_stream/{case}/p128"}
    assert out["targets"]["greedy/smollm2-135m"]["met"] is False
    assert out["ggufs"][0]["type"] == "Q4_1"
