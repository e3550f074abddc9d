"""zctl cluster's refusals, made before anything is exported or started: no cluster to
show, bad options, and messages with [brackets] printed as they are. (Clusters that start:
tests/e2e/test_cluster_commands.py.)"""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from zctl.cli.app import app

runner = CliRunner()


def test_status_without_cluster_is_a_clear_error(zctl_home: Path) -> None:
    result = runner.invoke(app, ["cluster", "status"])
    assert result.exit_code == 1 and "no cluster is up" in result.output
    result = runner.invoke(app, ["cluster", "status", "--endpoint", "tcp://127.0.0.1:1"])
    assert result.exit_code == 1 and "no answer" in result.output
    for flag in ("--resume-timeout", "--reassign-after"):
        result = runner.invoke(app, ["cluster", "up", "--local", "2", flag, "-1"])
        assert result.exit_code == 1 and "must be >= 0 seconds" in result.output
    assert not (zctl_home / "cluster.json").exists()


def test_foreground_local_is_refused_before_any_export(zctl_home: Path, monkeypatch) -> None:
    """--foreground with --local is refused at once: nothing is exported or started."""
    import zctl.cli.cluster as cluster_cli

    def no_export(*args, **kwargs):
        raise AssertionError("exported before refusing")

    monkeypatch.setattr(cluster_cli, "ensure_export", no_export)  # as cluster up calls it
    result = runner.invoke(app, ["cluster", "up", "--foreground", "--local", "2"])
    assert result.exit_code == 1
    assert "--foreground runs only the coordinator" in result.output
    assert not (zctl_home / "exports").exists() and not (zctl_home / "cluster.json").exists()


def test_a_bad_replan_gain_is_refused_before_any_export(zctl_home: Path, monkeypatch) -> None:
    import zctl.cli.cluster as cluster_cli

    def no_export(*args, **kwargs):
        raise AssertionError("exported before refusing")

    monkeypatch.setattr(cluster_cli, "ensure_export", no_export)
    for gain in ("-0.1", "nan", "50"):
        result = runner.invoke(app, ["cluster", "up", "--local", "2", "--replan-gain", gain])
        assert result.exit_code == 1 and "--replan-gain is a fraction" in result.output
    assert not (zctl_home / "cluster.json").exists()


def test_an_objective_the_planner_lacks_is_refused_before_any_export(zctl_home: Path,
                                                                     monkeypatch) -> None:
    import zctl.cli.cluster as cluster_cli

    def no_export(*args, **kwargs):
        raise AssertionError("exported before refusing")

    monkeypatch.setattr(cluster_cli, "ensure_export", no_export)
    result = runner.invoke(app, ["cluster", "up", "--local", "2", "--objective", "fastest"])
    assert result.exit_code == 1
    assert "--objective is latency or throughput, not 'fastest'" in result.output


def test_errors_print_brackets_as_they_are(zctl_home: Path) -> None:
    """A message with [brackets] (an extra's name, a bad value) is not taken for markup."""
    result = runner.invoke(app, ["cluster", "up", "--local", "2", "--api", "host[serve]"])
    assert result.exit_code == 1 and "not 'host[serve]'" in result.output, result.output
    result = runner.invoke(app, ["serve", "--port", "0"])
    assert result.exit_code == 1 and "--port must be in 1..65535" in result.output
    for origin in ("localhost:3000", "http://ui.example/chat", "ftp://ui.example"):
        result = runner.invoke(app, ["serve", "--cors-origin", origin])
        assert result.exit_code == 1 and "--cors-origin takes" in result.output, result.output
        result = runner.invoke(app, ["cluster", "up", "--local", "2", "--api", "127.0.0.1:8000",
                                     "--api-cors-origin", origin])
        assert result.exit_code == 1 and "--api-cors-origin takes" in result.output
    result = runner.invoke(app, ["cluster", "up", "--local", "2", "--api-cors-origin", "*"])
    assert result.exit_code == 1 and "--api-cors-origin needs --api" in result.output
    for command in (["cluster", "up", "--local", "2"], ["serve"]):
        result = runner.invoke(app, [*command, "--max-streams", "0"])
        assert result.exit_code == 1 and "--max-streams must be in 1..256" in result.output
        result = runner.invoke(app, [*command, "--kv-memory-mb", "0"])
        assert result.exit_code == 1 and "--kv-memory-mb must be at least 1" in result.output
        result = runner.invoke(app, [*command, "--kv-memory-mb", "100", "--prefix-cache-mb", "200"])
        assert result.exit_code == 1 and "--prefix-cache-mb must be in 0..--kv-memory-mb (100)" in (
            result.output.replace("\n", " ")), result.output
