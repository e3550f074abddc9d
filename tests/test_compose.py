"""The compose file's entry points must be valid zctl commands (no Docker engine here)."""

from __future__ import annotations

import typer
import yaml

from tests.helpers.repo import ROOT
from zctl.cli.app import app

COMPOSE = ROOT / "compose" / "compose.yaml"


def parse_zctl(args: list[str]):  # noqa: ANN201 - typer's (possibly vendored) click Context
    """Resolve sub-commands and parse options exactly as `zctl ARGS` would (without running)."""
    command = typer.main.get_command(app)
    ctx = command.make_context("zctl", list(args))
    while hasattr(command, "resolve_command"):  # a group (typer may vendor its own click)
        name, sub, rest = command.resolve_command(ctx, [*getattr(ctx, "_protected_args", []), *ctx.args])
        assert sub is not None, f"unknown zctl command in {args}"
        command, ctx = sub, sub.make_context(name, rest, parent=ctx)
    return ctx


def test_every_service_runs_a_valid_zctl_command() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert set(services) == {"coordinator", "node1", "node2"}
    coordinator = parse_zctl(services["coordinator"]["command"])
    assert coordinator.params["foreground"] and coordinator.params["stages"] == 3
    # the stages wait for both nodes (else the coordinator serves alone, then hands stages on)
    assert coordinator.params["expect_nodes"] == len(services) - 1
    for name in ("node1", "node2"):
        ctx = parse_zctl(services[name]["command"])
        assert ctx.params["coordinator"] == "tcp://coordinator:5550"
        assert ctx.params["host"] == name
        assert services[name]["build"]["target"] == "worker"


def test_parse_zctl_rejects_bad_commands() -> None:
    import pytest

    with pytest.raises(Exception, match="Missing (argument|parameter)"):
        parse_zctl(["cluster", "authorize"])  # missing the node's key file
    with pytest.raises(Exception, match="No such option"):
        parse_zctl(["cluster", "up", "--no-such-flag"])
