"""The arms' figures, the comparisons' ratios paired by round (the control's beside them),
the targets, and the tables."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from tools.fleet.cases import COMPARISONS, STREAMS, Comparison, targets
from tools.harness.stats import paired_ratio, rounded


def arm_figures(runs: Mapping[int, list[float]]) -> dict[str, dict[str, Any]]:
    """Each stream count's median tok/s and its runs."""
    return {str(n): {"median_tok_s": round(statistics.median(r), 2),
                     "runs_tok_s": [round(v, 2) for v in r]} for n, r in runs.items() if r}


def runs_of(arms: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[int, list[float]]]:
    """{arm: {streams: its runs' tok/s, round by round}} of the arms that have figures."""
    return {name: {int(n): f["runs_tok_s"] for n, f in arm["streams"].items()}
            for name, arm in arms.items() if "streams" in arm}


def comparison_report(comparison: Comparison, runs: Mapping[str, Mapping[int, list[float]]]
                      ) -> dict[str, Any]:
    """The subject's and the control's ratios over the reference at each stream count,
    paired by round (``paired_ratio``; None where an arm has no runs)."""
    def over(arm: str | None, streams: int) -> float | None:
        return rounded(paired_ratio(runs.get(arm or "", {}).get(streams, []),
                                    runs.get(comparison.reference, {}).get(streams, [])))

    return {"kind": comparison.kind, "subject": comparison.subject,
            "reference": comparison.reference, "control": comparison.control,
            "ratio": {str(n): over(comparison.subject, n) for n in STREAMS},
            "control_ratio": {str(n): over(comparison.control, n) for n in STREAMS}
            if comparison.control else None}


def fleet_report(arms: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The comparisons and the targets from the arms' reports."""
    runs = runs_of(arms)
    return {"comparisons": {c.name: comparison_report(c, runs) for c in COMPARISONS},
            "targets": targets(COMPARISONS, runs)}


def placement_text(arm: Mapping[str, Any]) -> str:
    """``coordinator 0-14, node1 15-29``: each node's layers, consecutive stages merged."""
    runs: list[list[Any]] = []
    for stage in arm.get("stages", []):
        start, end = stage["layers"]
        if runs and runs[-1][0] == stage["node"]:
            runs[-1][2] = end
        else:
            runs.append([stage["node"], start, end])
    return ", ".join(f"{node} {a}-{b - 1}" for node, a, b in runs)


def print_report(report: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"decode tok/s, median of rounds ({report['cpu']}, {report['date']}, "
                        f"{report['commit']})")
    for column in ("arm", "placement (layers)", "1 stream", "8 streams"):
        table.add_column(column, justify="left" if column != "1 stream" and
                         column != "8 streams" else "right")
    for name, arm in report["arms"].items():
        if "streams" not in arm:
            table.add_row(name, arm.get("failed", ""), "", "")
            continue
        table.add_row(name, placement_text(arm),
                      *(f"{arm['streams'][str(n)]['median_tok_s']:.1f}" for n in STREAMS))
    console.print(table)
    for name, comparison in report["comparisons"].items():
        control = comparison["control_ratio"]
        console.print(f"{name}: {comparison['subject']} / {comparison['reference']} = "
                      + ", ".join(f"{v}x at {n}" for n, v in comparison["ratio"].items())
                      + (f"; control {comparison['control']}: "
                         + ", ".join(f"{v}x at {n}" for n, v in control.items())
                         if control else ""))
    for name, target in report["targets"].items():
        value = "no figure" if target["value"] is None else f"{target['value']:.3f}x"
        mark = "[green]met[/]" if target["met"] else "[red]not met[/]"
        console.print(f"{name}: {value} (at least {target['target']:g}x) · {mark}")
