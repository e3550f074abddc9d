"""tools.robustness.chaos: a trial's figures from the client's log, the summary and targets, the
options; and (slow) whole trials of every fault on a real local cluster of the tiny model,
its nodes in their own network namespaces where they can be made."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tools.robustness.chaos import main, summarize, targets, trial_figures
from zctl.engine.requests import GenerationChunk, GenerationDone


def _chunk(tokens: list[int], note: str = "") -> GenerationChunk:
    return GenerationChunk("r", tokens, "", 0, None, None, {}, {}, note)


def _done(tokens: list[int], error: str = "") -> GenerationDone:
    return GenerationDone("r", tokens, "", 5, 1.0, 1.0, error=error)


def test_a_trial_is_timed_from_the_fault_to_the_pause_and_the_next_token() -> None:
    events = [(1.0, _chunk([1, 2])), (2.1, _chunk([3])),  # a token in flight at the fault
              (4.5, _chunk([], "paused: stage 1 ...")), (6.0, _chunk([], "resumed after 1 s")),
              (6.2, _chunk([4, 5])), (6.4, _done([1, 2, 3, 4, 5]))]
    got = trial_figures(events, 2.0, [1, 2, 3, 4, 5], [], False)
    assert got == {"detect_s": 2.5, "next_token_s": 4.2, "identical": True, "lost": False,
                   "error": ""}
    calm = trial_figures([(2.5, _chunk([3])), (3.0, _done([1, 2, 3]))], 2.0, [1, 2, 9], [],
                         False)
    assert calm["detect_s"] is None and calm["next_token_s"] == 0.5 and not calm["identical"]
    lost = trial_figures([(2.5, _done([1], error="PipelineDown: gone"))], 2.0, [1], [], False)
    assert lost["lost"] and lost["error"] == "PipelineDown: gone"
    assert trial_figures([], 2.0, [1], ["ClusterUnreachable: no answer"], False)["error"] == \
        "ClusterUnreachable: no answer"
    assert trial_figures([], 2.0, [1], [], True)["error"] == "the client still waited"


def test_summary_and_targets() -> None:
    trials = [{"detect_s": 1.0, "next_token_s": 3.0, "identical": True, "lost": False,
               "error": ""},
              {"detect_s": 3.5, "next_token_s": 6.0, "identical": False, "lost": True,
               "error": "x"}]
    summary = summarize(trials)
    assert (summary["trials"], summary["lost"], summary["identical"]) == (2, 1, 1)
    assert summary["detect_s_max"] == 3.5 and summary["next_token_s_median"] == 4.5
    met = targets({"kill": summary, "link-down": {"trials": 0, "skipped": "no namespaces"}})
    assert not met["lost"]["met"] and not met["detection"]["met"]
    assert not met["identical"]["met"] and met["next_token"]["met"]
    assert targets({"kill": summarize(trials[:1])})["detection"]["met"]


@pytest.mark.parametrize("args", [["--faults", "meteor"], ["--trials", "0"],
                                  ["--fault-at", "48"], ["--hold", "0"]])
def test_bad_options_are_refused_before_anything_starts(args: list[str]) -> None:
    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output


@pytest.mark.e2e
def test_every_fault_on_a_tiny_cluster(tiny_llama_dir: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "cache"))
    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, [
        "--model", str(tiny_llama_dir), "--weights", "fp32", "--trials", "1", "--tokens", "40",
        "--fault-at", "4", "--hold", "3", "--link-delay-ms", "20", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    faults = out["faults"]
    assert set(faults) == {"kill", "stop", "link-down", "flap", "slow", "heal"}
    ran = {name: f for name, f in faults.items() if f["trials"]}
    if out["network"] == "namespaces":
        assert set(ran) == set(faults)
    else:  # the fallback says why, and skips what needs namespaces
        assert out["network"].startswith("loopback fallback: ")
        assert {"link-down", "flap", "slow"}.isdisjoint(ran)
    for name, f in ran.items():
        assert f["lost"] == 0 and f["identical"] == f["trials"] == 1, (name, f)
    for name in ("kill", "stop", "heal"):
        assert faults[name]["detected"] == 1, faults[name]
    assert out["targets"]["lost"]["met"] and out["targets"]["identical"]["met"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "zcxn" not in left  # the harness removed its namespaces
