"""tools/decode/cluster_ab: environments parsed and applied, pairs summarised, and two real
local clusters (the tiny model) alternated run by run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.decode.cluster_ab import environment, paired_summary, parse_env, run_ab
from zctl.launcher.processes import runtime_spec


def test_parse_env_takes_assignments_and_names_a_bad_one() -> None:
    assert parse_env(["ZCTL_HUGE_PAGES=0", "X_1=a=b", "EMPTY="]) == {
        "ZCTL_HUGE_PAGES": "0", "X_1": "a=b", "EMPTY": ""}
    for bad in ("NOEQUALS", "=1", "1X=2", "A-B=1"):
        with pytest.raises(ValueError, match="is not VAR=VALUE"):
            parse_env([bad])


def test_environment_applies_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_AB_KEPT", "before")
    monkeypatch.delenv("ZCTL_AB_NEW", raising=False)
    with environment({"ZCTL_AB_KEPT": "during", "ZCTL_AB_NEW": "1"}):
        assert os.environ["ZCTL_AB_KEPT"] == "during" and os.environ["ZCTL_AB_NEW"] == "1"
    assert os.environ["ZCTL_AB_KEPT"] == "before" and "ZCTL_AB_NEW" not in os.environ


def test_paired_summary_compares_pair_by_pair() -> None:
    out = paired_summary([50.0, 40.0, 44.0], [40.0, 40.0, 55.0])
    assert out["a_tok_s"] == 44.0 and out["b_tok_s"] == 40.0
    assert out["a_over_b_paired"] == 1.0 and out["a_over_b_range"] == [0.8, 1.25]
    assert out["a_over_b_mean"] == round((1.25 + 1.0 + 0.8) / 3, 3)
    assert out["a_faster_pairs"] == 1 and out["pairs"] == 3
    with pytest.raises(ValueError, match="same, non-zero"):
        paired_summary([1.0], [])


@pytest.mark.e2e
def test_run_ab_alternates_two_real_clusters(tiny_exports, dp_hosts, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    before = os.environ.get("ZCTL_HUGE_PAGES")
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    result = run_ab(export_dir, {"ZCTL_HUGE_PAGES": "0"}, {"ZCTL_HUGE_PAGES": "1"}, 2, 4,
                    runtime_spec("f32", None, "CPU"), tmp_path / "ab")
    assert result["pairs"] == 2 and len(result["samples"]["a"]) == 2
    assert all(v > 0 for vs in result["samples"].values() for v in vs)
    for name in ("a", "b"):  # each cluster ran its own coordinator and node, now stopped
        assert (tmp_path / "ab" / name / "logs" / "coordinator.log").is_file()
    assert os.environ.get("ZCTL_HUGE_PAGES") == before  # this process's environment is back
