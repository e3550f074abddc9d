"""`zctl plan`: a model's fit and speed on a fleet file, as a table or JSON, and its errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers.repo import ROOT
from zctl.cli.app import app
from zctl.manifest import parse_layer_spec

runner = CliRunner()
FOUR = str(ROOT / "examples" / "fleets" / "four-pcs.toml")


def test_70b_on_four_pcs_answers_within_two_seconds_with_fit_use_and_speed() -> None:
    started = time.monotonic()
    result = runner.invoke(app, ["plan", "llama-3.1-70b", "--fleet", FOUR], terminal_width=120)
    assert time.monotonic() - started < 2.0
    assert result.exit_code == 0, result.output
    text = result.output
    assert "fits: INT4 yes" in text and "INT8 yes" in text
    assert "best placement in INT4" in text and "tok/s" in text and "TTFT at 1,024" in text
    for pc in ("desktop", "old-desktop", "laptop", "mini-pc"):
        assert pc in text
    assert "left out" in text and "reference profiles" in text
    assert "its stages as an export: --layers 0-" in text


def test_json_has_every_format_placement_and_left_out_node() -> None:
    result = runner.invoke(app, ["plan", "llama-3.1-70b", "--fleet", FOUR, "--json",
                                 "--objective", "throughput", "--streams", "8",
                                 "--context", "1024"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["weights"] == "int4" and set(report["fits"]) == {"int4", "int8"}
    for fits in report["fits"].values():
        assert fits["fits"] and fits["objective"] == "throughput"
        best = fits["placements"][0]
        layers = [s["layers"] for s in best["stages"]]
        assert layers[0][0] == 0 and layers[-1][1] == 80
        # the same stages as zctl export --layers takes them
        assert parse_layer_spec(best["export_layers"]) == [tuple(r) for r in layers]
        assert best["streams"]["streams"] == 8 and best["streams"]["tok_s"] > best["tok_s"]
        assert best["score"] == pytest.approx(best["streams"]["tok_s"])
        assert {o["node"] for o in fits["left_out"]} | set(best["nodes"]) == {
            "desktop", "old-desktop", "laptop", "mini-pc"}


def test_a_model_that_does_not_fit_says_by_how_much(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", "llama-3.1-70b", "--fleet", FOUR, "--weights", "fp32"],
                           terminal_width=200)
    assert result.exit_code == 1
    assert "FP32 does not fit" in result.output and "short by" in result.output


def test_a_config_json_and_a_moe_preset_plan_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}))
    result = runner.invoke(app, ["plan", str(tmp_path), "--fleet", FOUR, "--weights", "int8"])
    assert result.exit_code == 0, result.output
    assert "fits: INT8 yes" in result.output
    result = runner.invoke(app, ["plan", "qwen3-30b-a3b", "--fleet", FOUR], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "128 experts (8 active) of 768" in result.output  # planned as its routed experts
    assert "does not cut" not in result.output  # zctl export cuts a mixture of experts


def test_exact_experts_are_planned_at_their_bytes() -> None:
    """gpt-oss-20b's experts exact take about twice INT4's memory on the same PCs."""
    reports = []
    for extra in ([], ["--exact-experts"]):
        result = runner.invoke(app, ["plan", "gpt-oss-20b", "--fleet", FOUR, "--weights",
                                     "int4", "--json", *extra])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.output))
    used = [sum(s["memory_used"] for s in report["fits"]["int4"]["placements"][0]["stages"])
            for report in reports]
    assert 1.6 < used[1] / used[0] < 2.0
    assert [r["exact_experts"] for r in reports] == [False, True]
    assert any("the experts exact" in note for note in reports[1]["notes"])


@pytest.mark.parametrize("args, message", [
    (["llama-3.1-8b", "--fleet", FOUR, "--exact-experts"],
     "--exact-experts: llama-3.1-8b has no mixture of experts"),
    (["llama-3.1-8b"], "give --fleet FILE"),
    (["llama-3.1-8b", "--fleet", FOUR, "--endpoint", "tcp://127.0.0.1:1"], "one of them"),
    (["llama-3.1-8b", "--endpoint", "tcp://127.0.0.1:1"], "no answer from a coordinator"),
    (["llama-3.1-8b", "--fleet", FOUR, "--objective", "speed"], "--objective is latency"),
    (["llama-3.1-8b", "--fleet", FOUR, "--weights", "int2"], "--weights is auto"),
    (["no-such-model", "--fleet", FOUR], "not a preset"),
    (["llama-3.1-8b", "--fleet", "missing.toml"], "missing.toml: cannot read it"),
])
def test_bad_input_gets_one_clear_error(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", *args], terminal_width=200)
    assert result.exit_code == 1
    assert message in result.output


def test_a_fleet_error_names_the_file_and_pc(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.toml"
    bad.write_text('[[pc]]\nname = "laptop"\nmemory_gb = 16\n')
    result = runner.invoke(app, ["plan", "llama-3.1-8b", "--fleet", str(bad)],
                           terminal_width=300)
    assert result.exit_code == 1
    assert f"{bad}: pc 'laptop': no profile" in result.output


def test_a_running_cluster_is_planned_on_its_profiles_and_links(cp_cluster,
                                                                tiny_llama_dir: Path) -> None:
    from tests.helpers.control import seed_profile, wait_for

    coord = cp_cluster.coordinator(expect_nodes=1)
    seed_profile(cp_cluster.root / "coord", coord.shape)
    seed_profile(cp_cluster.root / "n1", coord.shape)
    cp_cluster.coordinators.remove(coord)  # again, now that its own profile is kept
    coord.stop()
    coord = cp_cluster.coordinator(expect_nodes=1)
    agent = cp_cluster.agent(coord.endpoint)
    # placed by the planner on these profiles: the coordinator alone runs the tiny model,
    # and its link to the spare is probed
    wait_for(lambda: [s for s in coord.status().links if s.measured_at]
             and all(n.profile for n in coord.status().nodes), timeout=20,
             what="profiles and links")
    assert coord.status().placement.startswith("by the planner")
    result = runner.invoke(app, ["plan", str(tiny_llama_dir), "--endpoint", coord.endpoint,
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["fleet"] == f"cluster at {coord.endpoint}" and report["weights"] == "fp32"
    best = report["fits"]["fp32"]["placements"][0]
    assert best["nodes"][0] == coord.node_id
    assert {s["node"] for s in report["fits"]["fp32"]["placements"][0]["stages"]} | {
        o["node"] for o in report["fits"]["fp32"]["left_out"]} == {coord.node_id, agent.node_id}
    assert any("measured" in note for note in report["notes"])


def test_a_cluster_whose_nodes_have_no_profiles_is_refused_clearly(cp_cluster,
                                                                   tiny_llama_dir: Path) -> None:
    coord = cp_cluster.coordinator()
    result = runner.invoke(app, ["plan", str(tiny_llama_dir), "--endpoint", coord.endpoint],
                           terminal_width=200)
    assert result.exit_code == 1
    assert "has a profile of" in result.output and "not profiled yet" in result.output
    assert coord.status().pipeline in ("serving", "wiring", "waiting")
