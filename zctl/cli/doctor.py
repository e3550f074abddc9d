"""``zctl doctor``: what to run when something is wrong. One line per check, pass, warn or
fail, and exit 1 on any failure (``zctl.doctor.checks`` runs them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from zctl.doctor import verdicts as dx
from zctl.doctor.checks import DEFAULT_API, DoctorOptions, recorded_api, run_checks
from zctl.doctor.verdicts import Check

STYLE = {dx.PASS: "bold green", dx.WARN: "bold yellow", dx.FAIL: "bold red"}


def render(checks: list[Check], console: Console) -> None:
    """One line per check (coloured PASS/WARN/FAIL), then the tally."""
    width = min(30, max(len(c.name) for c in checks))
    for c in checks:
        console.print(Text.assemble((f"{c.status.upper():4}", STYLE[c.status]), "  ",
                                    (c.name.ljust(width), "bold"), "  ", c.detail))
    counts = {s: sum(c.status == s for c in checks) for s in dx.STATUSES}
    console.print(Text(f"{counts[dx.PASS]} pass, {counts[dx.WARN]} warn, {counts[dx.FAIL]} fail",
                       style="bold red" if counts[dx.FAIL] else "bold"))


def doctor(
    endpoint: Annotated[str | None, typer.Option(
        help="coordinator control address (default: the cluster up here)")] = None,
    curve_server_key: Annotated[Path | None, typer.Option(
        help="with --endpoint of a --curve cluster: the coordinator's public key file")] = None,
    curve_keys: Annotated[Path | None, typer.Option(
        help="with --curve-server-key: this client's admitted key pair (its .key_secret)")] = None,
    state_dir: Annotated[list[Path] | None, typer.Option(
        help="a node's state directory outside ZCTL_HOME (its id and shard cache; "
             "repeatable)")] = None,
    api: Annotated[str | None, typer.Option(
        help=f"the HTTP API to ask for /health (default: the one cluster up --api started, "
             f"else {DEFAULT_API}, where a missing server only warns)")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the coordinator")] = 3.0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    lan: Annotated[bool, typer.Option(
        "--lan/--no-lan", help="check LAN discovery: multicast here, the clusters announced, "
                               "their endpoints, clashing names and node ids (2-4 s)")] = True,
) -> None:
    """Check this machine and the cluster: devices, versions, ports, clock, shard hashes, memory."""
    recorded = recorded_api() if api is None else ""
    opts = DoctorOptions(endpoint, curve_server_key, curve_keys, list(state_dir or []),
                         api or recorded or DEFAULT_API, bool(api or recorded), max(0.1, timeout),
                         lan=lan)
    checks = run_checks(opts)
    ok = dx.all_ok(checks)
    if as_json:
        print(json.dumps({"checks": [c.to_dict() for c in checks], "ok": ok}))
    else:
        render(checks, Console(highlight=False, soft_wrap=True))
    if not ok:
        raise typer.Exit(1)
