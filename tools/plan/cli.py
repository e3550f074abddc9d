"""The benchmark's command line: which cases, how many tokens and rounds."""

from __future__ import annotations

import json
import logging
import os
from typing import Annotated, Any

import typer

from tools.harness.options import Json, fail
from tools.plan.cases import CASES, QUICK


def main(
    cases: Annotated[str, typer.Option(
        help=f"comma-separated, of {', '.join(CASES)}; quick ({', '.join(QUICK)}) or all "
             "(every case but 8b-4n-shared, which writes a 16 GB checkpoint and a ~5 GB "
             "export first, and tiny-2n-shared: name them to run them)")] = "quick",
    tokens: Annotated[int, typer.Option(help="new tokens per stream")] = 64,
    rounds: Annotated[int, typer.Option(help="runs of each stream count (the median counts)")]
        = 3,
    timeout: Annotated[float, typer.Option(
        help="seconds to wait for a case's profiles and links to be measured")] = 600.0,
    as_json: Json = False,
) -> None:
    from tools.harness.report import err, run_record
    from tools.plan.cases import select_cases
    from tools.plan.measure import run_case
    from tools.plan.report import case_report, print_report, targets
    from zctl.paths import zctl_home

    logging.getLogger("zctl.engine").setLevel(logging.ERROR)
    try:
        chosen, skipped = select_cases(cases, len(os.sched_getaffinity(0)))
    except ValueError as exc:
        fail(str(exc))
    if tokens < 2 or rounds < 1 or timeout <= 0:
        fail("--tokens >= 2, --rounds >= 1 and --timeout > 0")
    results: dict[str, dict[str, Any]] = {}
    for case in chosen:
        try:
            outcome = run_case(case, zctl_home() / "bench-plan" / case.name, tokens, rounds,
                               timeout)
            results[case.name] = case_report(outcome)
        except (RuntimeError, OSError, ValueError) as exc:  # a ClusterError too
            err.print(f"[red]{case.name} failed:[/] {exc}", highlight=False)
            results[case.name] = {**case.setup(), "failed": str(exc)}
    report = {**run_record(), "options": {"tokens": tokens, "rounds": rounds},
              "cases": results, "skipped": skipped, "targets": targets(results)}
    if as_json:
        print(json.dumps(report))
    else:
        print_report(report)
