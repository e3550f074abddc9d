"""The benchmark's targets and its table: every case identical under the repeatable
setting, at a cost of at most 5% of decode tok/s and of TTFT against today's default
(15%: the most a setting may cost to become the default where 5% cannot be had)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COST_TARGET = 0.05
DEFAULT_BOUND = 0.15


def worst_cost(ratios: Mapping[str, float]) -> dict[str, float | None]:
    """The worst decode and TTFT figures against today's, as costs (0.03: 3% slower
    decoding, or 3% later first tokens; negative: faster)."""
    decode = [1 - r for k, r in ratios.items() if "tok_s" in k]
    ttft = [r - 1 for k, r in ratios.items() if k.startswith("ttft")]
    return {"decode": max(decode, default=None), "ttft": max(ttft, default=None)}


def targets(models: Mapping[str, Mapping[str, Any]], setting: str) -> dict[str, dict[str, Any]]:
    """The issue's targets for ``setting`` over every model's results: each case's least
    identical fraction (target 1.0), the worst decode and TTFT cost (target <= 5%)."""
    out: dict[str, dict[str, Any]] = {}
    cases = sorted({c for m in models.values() for c in m["cases"].get(setting, {})})
    for case in cases:
        values = [m["cases"][setting][case]["fraction"] for m in models.values()
                  if case in m["cases"].get(setting, {})]
        value = min(v for v in values if v is not None) if values else None
        out[f"identical_{case}"] = {"target": "every output identical to the reference",
                                    "value": value, "met": None if value is None else value == 1.0}
    for kind in ("decode", "ttft"):
        costs = [worst_cost(m["costs"]["vs_today"][setting])[kind] for m in models.values()
                 if setting in m.get("costs", {}).get("vs_today", {})]
        costs = [c for c in costs if c is not None]
        value = max(costs) if costs else None
        out[f"{kind}_cost"] = {"target": f"at most {COST_TARGET:.0%} against today's default",
                               "value": value, "met": None if value is None else value <= COST_TARGET}
    return out


def print_report(report: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for model, result in report["models"].items():
        settings = list(result["cases"])
        table = Table(title=f"identical outputs, {model} ({report['cpu']}, {report['commit']})")
        table.add_column("case")
        for s in settings:
            table.add_column(s, justify="right")
        cases = list(dict.fromkeys(c for s in settings for c in result["cases"][s]))
        for case in cases:
            table.add_row(case, *(_fraction(result["cases"][s].get(case)) for s in settings))
        console.print(table)
        costs = result.get("costs")
        if costs:
            table = Table(title=f"cost against today's, medians of {costs['rounds']} rounds")
            table.add_column("figure")
            for s in costs["medians"]:
                table.add_column(s, justify="right")
            for s in costs["vs_today"]:
                table.add_column(f"{s} / today", justify="right")
            for key in costs["medians"]["today"]:
                table.add_row(key, *(f"{costs['medians'][s][key]:.1f}" for s in costs["medians"]),
                              *(f"{costs['vs_today'][s][key]:.3f}" for s in costs["vs_today"]))
            console.print(table)
    for name, t in report["targets"].items():
        met = "met" if t["met"] else "n/a" if t["met"] is None else "MISSED"
        console.print(f"{name}: {t['target']}: {met} ({t['value']})")


def _fraction(case: Mapping[str, Any] | None) -> str:
    if case is None:
        return ""
    return f"{case['identical']}/{case['of']}"
