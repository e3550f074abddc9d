"""The benchmark's command line: how many tokens and rounds, the start-up timeout."""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack
from typing import Annotated, Any

import typer

from tools.harness.options import Json, fail


def main(
    tokens: Annotated[int, typer.Option(help="new tokens per stream")] = 64,
    rounds: Annotated[int, typer.Option(help="rounds of every arm at 1 and 8 streams (the "
                                             "median counts)")] = 3,
    timeout: Annotated[float, typer.Option(
        help="seconds to wait for an arm to serve, be profiled and settle")] = 600.0,
    as_json: Json = False,
) -> None:
    from tools.fleet.cases import ARMS
    from tools.fleet.measure import arm_cpu_lists, final_status, run_rounds, start_arm
    from tools.fleet.report import arm_figures, fleet_report, print_report
    from tools.harness.report import err, run_record
    from zctl.paths import zctl_home

    logging.getLogger("zctl.engine").setLevel(logging.ERROR)
    if tokens < 2 or rounds < 1 or timeout <= 0:
        fail("--tokens >= 2, --rounds >= 1 and --timeout > 0")
    available = sorted(os.sched_getaffinity(0))
    try:
        cpus = {name: arm_cpu_lists(arm, available) for name, arm in ARMS.items()}
    except ValueError as exc:
        fail(str(exc))
    base = zctl_home() / "bench-fleet"
    seed = base / "profiles"  # the two nodes' profiles, measured once for every planned arm
    try:
        with ExitStack() as profiling:
            start_arm(ARMS["two"], seed, profiling, cpus["two"], timeout)
    except (RuntimeError, OSError, ValueError) as exc:
        fail(f"the nodes' profiles were not measured: {exc}")
    arms: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        running = {}
        for name, arm in ARMS.items():
            try:
                running[name] = start_arm(arm, base / name, stack, cpus[name], timeout,
                                          seed if arm.planned else None)
            except (RuntimeError, OSError, ValueError) as exc:  # a ClusterError too
                err.print(f"[red]{name} failed:[/] {exc}", highlight=False)
                arms[name] = {**arm.setup(), "failed": str(exc)}
        run_rounds(running, rounds, tokens)
        for name, arm_run in running.items():
            if arm_run.failed:
                arms[name] = {**arm_run.arm.setup(), "failed": arm_run.failed,
                              "runs_before": arm_figures(arm_run.measured)}
                continue
            arms[name] = {**arm_run.arm.setup(), **final_status(arm_run),
                          "streams": arm_figures(arm_run.measured)}
    arms = {name: arms[name] for name in ARMS if name in arms}
    report = {**run_record(), "options": {"tokens": tokens, "rounds": rounds},
              "arms": arms, **fleet_report(arms)}
    if as_json:
        print(json.dumps(report))
    else:
        print_report(report)
