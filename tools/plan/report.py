"""A case's predicted against measured tok/s, the targets, and the table.

A case's error at a stream count is (predicted - measured) / measured, the measured figure
the median of its rounds: positive when the prediction is too fast. The targets: within
15% at one stream and 25% at eight, for every case that ran (a case this machine cannot
run is listed as skipped and does not count; one that failed does, and misses them).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from controlplane.planner.running import relative_error, streams_prediction
from controlplane.records import PredictionStatus

TARGETS = {1: 0.15, 8: 0.25}  # streams -> the largest relative error allowed


def target_name(streams: int, bound: float) -> str:
    return f"{streams} stream{'s' if streams > 1 else ''} within {bound:.0%}"


def stream_figures(prediction: PredictionStatus, streams: int, runs: list[float]
                   ) -> dict[str, Any]:
    """One stream count's prediction, the median of its ``runs`` and the error."""
    if not runs:
        raise ValueError(f"no measured runs of {streams} streams")
    predicted = streams_prediction(prediction, streams)
    measured = statistics.median(runs)
    return {"predicted_tok_s": round(predicted.tok_s, 2), "measured_tok_s": round(measured, 2),
            "error": round(relative_error(predicted.tok_s, measured), 4),
            "row_groups": predicted.row_groups, "rows": predicted.rows,
            "runs_tok_s": [round(r, 2) for r in runs]}


def case_report(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """A measured case (tools.plan.measure.run_case's outcome) as the report shows it."""
    prediction: PredictionStatus = outcome["prediction"]
    return {**outcome["setup"], "placement": outcome["placement"],
            "slowed_by": outcome["slowed_by"],
            "predicted_step_ms": [round(v, 3) for v in prediction.stage_ms],
            "predicted_hop_ms": [round(v, 3) for v in prediction.hop_ms],
            "streams": {str(n): stream_figures(prediction, n, runs)
                        for n, runs in outcome["measured"].items()}}


def targets(cases: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target: the largest |error| among the cases at its stream count (None: no case
    measured), the bound, and whether every case that ran is within it."""
    out = {}
    for streams, bound in TARGETS.items():
        errors = [abs(c["streams"][str(streams)]["error"]) for c in cases.values()
                  if "streams" in c and str(streams) in c["streams"]]
        failed = any("failed" in c for c in cases.values())
        worst = max(errors) if errors else None
        out[target_name(streams, bound)] = {
            "value": worst, "target": bound,
            "met": worst is not None and worst <= bound and not failed}
    return out


def print_report(report: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"predicted against measured decode tok/s ({report['cpu']}, "
                        f"{report['date']}, {report['commit']})")
    for column in ("case", "streams", "predicted", "measured", "error", "row groups"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for name, case in report["cases"].items():
        if "streams" not in case:
            table.add_row(name, "", "", "", case.get("failed", ""), "")
            continue
        for streams, got in case["streams"].items():
            table.add_row(name, streams, f"{got['predicted_tok_s']:.1f}",
                          f"{got['measured_tok_s']:.1f}", f"{got['error']:+.1%}",
                          str(got["row_groups"]))
    console.print(table)
    for name, why in report["skipped"].items():
        console.print(f"[dim]{name} skipped: {why}[/]")
    for name, target in report["targets"].items():
        value = "no case" if target["value"] is None else f"{target['value']:.1%}"
        mark = "[green]met[/]" if target["met"] else "[red]not met[/]"
        console.print(f"{name}: worst {value} · {mark}")
