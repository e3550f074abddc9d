"""The default weight format: per model (zctl/cli/exports.py DEFAULT_WEIGHTS, chosen in
docs/quality.md), taken by `zctl export`, `zctl run` and `zctl cluster up` unless --weights
says otherwise, and never mistaken for a cached export of another format."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
from typer.testing import CliRunner

from tests.helpers.repo import ROOT
from zctl.cli.app import app
from zctl.cli.exports import (
    AUTO,
    AUTO_WEIGHTS_OTHERWISE,
    DEFAULT_WEIGHTS,
    default_export_dir,
    ensure_export,
    fleet_export_ranges,
    local_export_ranges,
    planned_export_dir,
    resolve_weights,
)
from zctl.launcher.record import ClusterError
from zctl.weights import WEIGHT_FORMATS

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path))
    return tmp_path


def test_auto_is_the_models_own_format_and_a_named_format_is_kept() -> None:
    assert resolve_weights("smollm2-135m", AUTO) == DEFAULT_WEIGHTS["smollm2-135m"] == "int8"
    assert resolve_weights("gemma3-270m", AUTO) == DEFAULT_WEIGHTS["gemma3-270m"] == "int8"
    assert resolve_weights("some/other-model", AUTO) == AUTO_WEIGHTS_OTHERWISE == "int4"
    assert set(DEFAULT_WEIGHTS.values()) <= set(WEIGHT_FORMATS)
    for weights in WEIGHT_FORMATS:
        assert resolve_weights("smollm2-135m", weights) == weights


def test_the_default_export_dir_names_the_resolved_format(home: Path) -> None:
    auto = default_export_dir("smollm2-135m", 2, AUTO)
    assert auto == default_export_dir("smollm2-135m", 2, "int8") == (
        home / "exports" / "smollm2-135m-int8-2stages")
    assert auto != default_export_dir("smollm2-135m", 2, "int4")
    assert default_export_dir("gpt-oss-20b", 2, "int4", exact_experts=True) == (
        home / "exports" / "gpt-oss-20b-int4-2stages-exact-experts")


def test_a_cached_export_of_another_format_is_exported_again(home: Path, tiny_llama_dir: Path,
                                                             tiny_exports, monkeypatch) -> None:
    import exporter.export

    fp32_export = tiny_exports.get([(0, 4)], "fp32")
    made: list[tuple[str, Path]] = []

    def fake_export(source, ranges, weights, target, **kwargs):
        made.append((weights, Path(target)))

    monkeypatch.setattr(exporter.export, "export_model", fake_export)
    model = str(tiny_llama_dir)
    target = default_export_dir(model, 1, "int8")
    shutil.copytree(fp32_export, target)  # an fp32 export sits where the int8 one belongs
    assert ensure_export(model, 1, "int8") == target
    assert made == [("int8", target)]
    made.clear()
    fp32_target = default_export_dir(model, 1, "fp32")
    shutil.copytree(target, fp32_target)
    assert ensure_export(model, 1, "fp32") == fp32_target and made == []  # it is reused


class ExportAsked(NamedTuple):
    """What ``ensure_export`` was asked for."""

    model: str
    stages: int
    weights: str
    ranges: list[tuple[int, int]] | None
    exact_experts: bool


def _exports_asked(monkeypatch: pytest.MonkeyPatch, module: object) -> list[ExportAsked]:
    """Make ``module.ensure_export`` record what it is asked for, then stop the command
    (ClusterError: one error line, exit 1) before anything starts."""
    asked: list[ExportAsked] = []

    def record(model: str, stages: int, weights: str = AUTO,
               ranges: list[tuple[int, int]] | None = None,
               exact_experts: bool = False) -> Path:
        asked.append(ExportAsked(model, stages, weights, ranges, exact_experts))
        raise ClusterError("stopped by the test")

    monkeypatch.setattr(module, "ensure_export", record)
    return asked


@pytest.mark.parametrize("command", [["run", "hello"], ["cluster", "up", "--local", "2"],
                                     ["serve"]])
def test_run_and_cluster_up_take_the_default_unless_told(command: list[str], home: Path,
                                                          monkeypatch) -> None:
    from zctl.cli import cluster, run, serve

    module = {"run": run, "serve": serve}.get(command[0], cluster)
    asked = _exports_asked(monkeypatch, module)
    for extra, expected in (([], AUTO), (["--weights", "int4"], "int4")):
        result = runner.invoke(app, [*command, *extra])
        assert result.exit_code == 1 and "stopped by the test" in result.output, result.output
        assert asked[-1].weights == expected


def test_zctl_export_help_names_the_default() -> None:
    result = runner.invoke(app, ["export", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "int8 for smollm2-135m" in text.replace("│ ", "").replace(" │", "")


def test_a_local_cluster_exports_the_planners_ranges(home: Path, tiny_llama_dir: Path,
                                                     monkeypatch) -> None:
    import exporter.export

    ranges, source = local_export_ranges("smollm2-135m", 2, AUTO, "CPU")
    assert ranges is not None and len(ranges) == 2 and ranges[-1][1] == 30, source
    assert source.startswith("the planner's split for 2 processes from the xeon-core "
                              "reference profile (this machine: not profiled yet)")
    made: list[tuple[list, Path]] = []

    def fake_export(source, ranges, weights, target, **kwargs):
        made.append((list(ranges), Path(target)))

    monkeypatch.setattr(exporter.export, "export_model", fake_export)
    model = str(tiny_llama_dir)
    target = ensure_export(model, 2, "fp32", [(0, 3), (3, 4)])
    assert target == planned_export_dir(model, "fp32", [(0, 3), (3, 4)])
    assert target.name.endswith("-fp32-layers-0-2_3") and made == [([(0, 3), (3, 4)], target)]


def test_without_a_shape_the_local_export_is_split_by_cost(home: Path) -> None:
    ranges, source = local_export_ranges(str(home / "nothing-here"), 2, "int4", "CPU")
    assert ranges is None and source.startswith("split by cost, not by the planner: ")


FOUR_PCS = ROOT / "examples" / "fleets" / "four-pcs.toml"


def test_a_fleet_file_gives_the_stages_of_its_best_placement(home: Path) -> None:
    """`cluster up --fleet` exports the stages `zctl plan --fleet` shows as the best."""
    import json

    ranges, source = fleet_export_ranges("llama-3.1-70b", FOUR_PCS, "int8")  # (no PC holds it)
    planned = json.loads(runner.invoke(app, ["plan", "llama-3.1-70b", "--fleet",
                                             str(FOUR_PCS), "--weights", "int8",
                                             "--json"]).output)
    best = planned["fits"]["int8"]["placements"][0]
    assert ranges == [tuple(stage["layers"]) for stage in best["stages"]]
    assert len(ranges) > 1 and ranges[0][0] == 0 and ranges[-1][1] == 80
    assert source.startswith(f"the planner's best placement on {FOUR_PCS} (")
    with pytest.raises(ValueError, match="short by"):  # fits none: refused, nothing made
        fleet_export_ranges("llama-3.1-70b", FOUR_PCS, "fp32")


def test_cluster_up_with_a_fleet_exports_the_planners_stages(home: Path, monkeypatch) -> None:
    from zctl.cli import cluster

    asked = _exports_asked(monkeypatch, cluster)
    result = runner.invoke(app, ["cluster", "up", "--model", "llama-3.1-70b", "--weights",
                                 "int8", "--fleet", str(FOUR_PCS)])
    assert result.exit_code == 1 and "stopped by the test" in result.output, result.output
    want, _ = fleet_export_ranges("llama-3.1-70b", FOUR_PCS, "int8")
    assert [(a.stages, a.ranges) for a in asked] == [(len(want), want)]
    assert "stages: the planner's best placement on" in " ".join(result.output.split())


@pytest.mark.parametrize(("extra", "message"), [
    (["--local", "2"], "--local N plans for this machine's N processes: drop --fleet"),
    (["--stages", "3"], "--fleet lets the planner choose the stages: drop --stages"),
    (["--weights", "fp32"], "llama-3.1-70b in fp32 (KV for 4 stream(s) of 4096 tokens) needs"),
])
def test_cluster_up_refuses_a_fleet_it_cannot_use_before_any_export(
        extra: list[str], message: str, home: Path, monkeypatch) -> None:
    from zctl.cli import cluster

    asked = _exports_asked(monkeypatch, cluster)
    result = runner.invoke(app, ["cluster", "up", "--model", "llama-3.1-70b", "--fleet",
                                 str(FOUR_PCS), *extra], terminal_width=300)
    assert result.exit_code == 1 and asked == [], result.output
    assert message in " ".join(result.output.split()), result.output


def test_cluster_up_refuses_a_missing_fleet_file_or_an_export_with_one(
        home: Path, tiny_exports, monkeypatch) -> None:
    from zctl.cli import cluster

    asked = _exports_asked(monkeypatch, cluster)
    missing = runner.invoke(app, ["cluster", "up", "--fleet", str(home / "none.toml")])
    assert missing.exit_code == 1 and "no such file" in missing.output
    export = tiny_exports.get([(0, 2), (2, 4)], "fp32")
    made = runner.invoke(app, ["cluster", "up", "--model", str(export), "--fleet",
                               str(FOUR_PCS)], terminal_width=300)
    assert made.exit_code == 1 and "whose stages are made" in made.output
    assert asked == []


def test_exact_experts_are_exported_apart_and_reused_only_as_asked(
        home: Path, tiny_llama_dir: Path, tiny_exports, monkeypatch) -> None:
    """`cluster up --exact-experts` exports into its own directory, passes the flag to the
    exporter, and never takes an export of the other form for it (either way)."""
    import exporter.export

    made: list[tuple[bool, Path]] = []

    def fake_export(source, ranges, weights, target, **kwargs):
        made.append((kwargs["exact_experts"], Path(target)))

    monkeypatch.setattr(exporter.export, "export_model", fake_export)
    model = str(tiny_llama_dir)
    exact = ensure_export(model, 1, "fp32", exact_experts=True)
    assert exact == default_export_dir(model, 1, "fp32", exact_experts=True)
    planned = ensure_export(model, 2, "fp32", [(0, 3), (3, 4)], exact_experts=True)
    assert planned == planned_export_dir(model, "fp32", [(0, 3), (3, 4)], exact_experts=True)
    assert planned.name.endswith("-fp32-layers-0-2_3-exact-experts")
    assert made == [(True, exact), (True, planned)]
    made.clear()
    plain = tiny_exports.get([(0, 4)], "fp32")  # its experts (none) not kept exact
    shutil.copytree(plain, exact)  # sits where the exact export belongs
    assert ensure_export(model, 1, "fp32", exact_experts=True) == exact
    assert made == [(True, exact)]
    with pytest.raises(ClusterError, match="not kept exact: export the model with "
                                           "--exact-experts"):
        ensure_export(str(plain), 1, "fp32", exact_experts=True)
    assert ensure_export(str(plain), 1, "fp32") == plain


def test_an_export_the_exporter_refuses_is_a_cluster_error(home: Path, tiny_llama_dir: Path,
                                                           monkeypatch) -> None:
    import exporter.export
    from exporter.export import ExportError

    def refuse(source, ranges, weights, target, **kwargs):
        raise ExportError("tiny-llama has no mixture of experts to keep exact")

    monkeypatch.setattr(exporter.export, "export_model", refuse)
    with pytest.raises(ClusterError, match="no mixture of experts"):
        ensure_export(str(tiny_llama_dir), 1, "fp32", exact_experts=True)


def test_a_fleet_plans_exact_experts_at_their_size(home: Path) -> None:
    """Exact experts take about twice INT4's bytes: gpt-oss-120b, which four-pcs.toml holds
    in INT4, no longer fits it with them, and a dense model is refused the flag."""
    from controlplane.planner.presets import PRESETS
    from controlplane.planner.references import derive_profile, reference_speed

    int4, source = fleet_export_ranges("gpt-oss-120b", FOUR_PCS, "int4")
    assert len(int4) > 1 and int4[0][0] == 0 and int4[-1][1] == 36, int4
    assert source.startswith(f"the planner's best placement on {FOUR_PCS} (")
    with pytest.raises(ValueError, match=r"gpt-oss-120b in int4 .* needs about 1\d\d"):
        fleet_export_ranges("gpt-oss-120b", FOUR_PCS, "int4", exact_experts=True)
    shape = PRESETS["gpt-oss-20b"]
    derived = derive_profile(reference_speed("xeon-core"), shape, "int4", 1 << 40, True)
    assert derived.key.exact_experts
    assert derived.layer_bytes > 1.8 * derive_profile(
        reference_speed("xeon-core"), shape, "int4", 1 << 40).layer_bytes
    with pytest.raises(ValueError, match="no experts to keep exact: drop --exact-experts"):
        fleet_export_ranges("llama-3.1-70b", FOUR_PCS, "int8", exact_experts=True)


def test_cluster_up_passes_exact_experts_to_the_export(home: Path, monkeypatch) -> None:
    from zctl.cli import cluster

    asked = _exports_asked(monkeypatch, cluster)
    for extra, expected in (([], False), (["--exact-experts"], True)):
        result = runner.invoke(app, ["cluster", "up", "--model", "gpt-oss-20b", "--weights",
                                     "int4", "--fleet", str(FOUR_PCS), *extra])
        assert result.exit_code == 1 and "stopped by the test" in result.output, result.output
        assert asked[-1].exact_experts is expected
