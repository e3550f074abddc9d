"""CPU sets for co-located nodes: parsing, splitting, confinement. (A split local cluster:
tests/e2e/test_local_clusters.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zctl.cli.app import app
from zctl.launcher.cpusets import (
    confine_to,
    format_cpu_list,
    local_cpu_sets,
    parse_cpu_list,
    split_cpus,
)

runner = CliRunner()


def test_cpu_lists_parse_and_format_round_trip() -> None:
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("5, 1,1") == [1, 5]
    assert format_cpu_list([6, 0, 1, 2, 3]) == "0-3,6"
    assert format_cpu_list([4]) == "4"
    for bad in ("", "a", "1-", "3-1", "-2", "0,,1"):
        with pytest.raises(ValueError, match="CPU"):
            parse_cpu_list(bad)


def test_split_gives_disjoint_near_equal_sets_extra_cores_first() -> None:
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_cpus([7, 3, 5], 1) == [[3, 5, 7]]
    with pytest.raises(ValueError, match="at least 3 CPUs"):
        split_cpus([0, 1], 3)
    with pytest.raises(ValueError):
        split_cpus([0, 1], 0)


def test_local_cpu_sets_modes() -> None:
    assert local_cpu_sets("shared", 3) == [None, None, None]
    cores = sorted(os.sched_getaffinity(0))
    sets = local_cpu_sets("split", 1)
    assert sets == [format_cpu_list(cores)]
    with pytest.raises(ValueError, match="shared"):
        local_cpu_sets("mine", 2)


def test_confine_refuses_cpus_this_process_may_not_use() -> None:
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="not available"):
        confine_to("4095")
    assert os.sched_getaffinity(0) == before


def test_bad_cpus_fail_clearly_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from zctl.launcher.__main__ import main
    from zctl.launcher.processes import NodeProcess, process_command

    assert main(process_command(NodeProcess("tcp://127.0.0.1:9", cpus="x"))[2:]) == 1
    assert "bad CPU list" in capsys.readouterr().err
    refused = runner.invoke(app, ["node", "join", "tcp://127.0.0.1:9", "--cpus", "x"])
    assert refused.exit_code == 1 and "bad CPU list" in refused.output


def test_local_row_groups_default_follows_the_cpu_sets() -> None:
    from zctl.launcher.local import local_row_groups
    from zctl.launcher.record import ClusterError

    assert local_row_groups("shared", 3) == 1  # shared cores: batch every stream
    assert local_row_groups("split", 3) == 3  # own cores: keep every stage busy
    assert local_row_groups("split", 3, 0) == 0 and local_row_groups("shared", 2, 4) == 4
    assert local_row_groups("shared", 2, None, 25.0) == 0  # WAN hops: every stream in flight
    with pytest.raises(ClusterError, match=">= 0"):
        local_row_groups("shared", 2, -1)


def test_coordinator_row_groups_default_to_one_per_stage(dp_export2: Path) -> None:
    from zctl.launcher.processes import CoordinatorProcess, _row_groups

    assert _row_groups(CoordinatorProcess(str(dp_export2))) == 2
    assert _row_groups(CoordinatorProcess(str(dp_export2), row_groups=0)) == 0
    with pytest.raises(ValueError, match="row groups must be >= 0"):
        _row_groups(CoordinatorProcess(str(dp_export2), row_groups=-2))


def test_cluster_up_refuses_negative_row_groups(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    refused = runner.invoke(app, ["cluster", "up", "--local", "2", "--row-groups", "-1"])
    assert refused.exit_code == 1 and "--row-groups must be >= 0" in refused.output


def test_kv_cache_precision_reaches_the_coordinator_or_is_refused_before_any_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zctl.launcher.processes import runtime_spec

    assert runtime_spec("f32", None, "CPU", "u8").kv_cache_precision == "u8"
    assert runtime_spec("f32", None, "CPU").kv_cache_precision is None  # the plugin's
    assert runtime_spec("f32", None, "CPU", "default").kv_cache_precision is None
    assert runtime_spec("f32", None, "CPU", dynamic_quantization=False).dynamic_quantization is False
    assert runtime_spec("default", 3, "CPU").precision is None
    assert runtime_spec("default", 3, "CPU").num_threads == 3
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    for command in (["cluster", "up", "--local", "2"], ["run", "hi"]):
        refused = runner.invoke(app, [*command, "--kv-cache-precision", "q3"])
        assert refused.exit_code == 1 and "unknown KV cache precision 'q3'" in refused.output
    assert not (tmp_path / "home" / "exports").exists()


def test_coordinator_runtime_options_become_the_nodes_runtime_spec() -> None:
    from zctl.launcher.processes import CoordinatorProcess, parse_process, process_command, runtime_spec

    config = CoordinatorProcess("/x", runtime=runtime_spec("f32", None, "CPU", "default", False))
    spec = parse_process("coordinator", process_command(config)[3]).runtime  # as spawned
    assert spec == config.runtime
    assert spec.kv_cache_precision is None and spec.dynamic_quantization is False
    props = spec.properties()  # as the stages' runners compile with it
    assert props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 0 and "KV_CACHE_PRECISION" not in props


def test_exact_and_fast_numerics() -> None:
    from zctl.cli.cluster import numerics

    assert numerics(None, None, None) == ("default", True)  # fast: the plugin's defaults
    assert numerics(False, None, None) == ("default", True)
    assert numerics(True, None, None) == ("f32", False)  # exact: f32 KV, f32 activations
    assert numerics(None, "u8", False) == ("u8", False)  # fine-grained, fast otherwise
    assert numerics(True, "f32", False) == ("f32", False)
    for kv, dq in (("u8", None), (None, True)):
        with pytest.raises(ValueError, match="--exact means"):
            numerics(True, kv, dq)


def test_cluster_up_refuses_contradicting_exactness_before_any_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    refused = runner.invoke(app, ["cluster", "up", "--local", "2", "--exact",
                                  "--kv-cache-precision", "u8"])
    assert refused.exit_code == 1 and "--exact means" in refused.output
    assert not (tmp_path / "home" / "exports").exists()
