"""A case's predicted against measured tok/s, the targets, and the table.

A case's error at a stream count is (predicted - measured) / measured, the measured figure
the median of its rounds: positive when the prediction is too fast. The targets: within
15% at one stream and 25% at eight, for every case that ran (a case this machine cannot
run is listed as skipped and does not count; one that failed does, and misses them).

Beside them, one stream's token term by term, predicted (each node's step with its host
work: the coordinator's engine on stage 0, the frames on the others; each hop, the reply
last) against the pipeline's own timing of its steps (each stage's compute, each hop's
serialisation, queueing and network, the framework's overhead in the step, and the time
between steps: the engine's work), the median of the rounds' p50s.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
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


def pipeline_terms(timings: Sequence[Mapping[str, Mapping[str, float]]],
                   runs: Sequence[float]) -> dict[str, Any]:
    """One stream's token as the running pipeline timed it (module docstring), from each
    round's step timing (``stage0.compute``, ``hop0-1.network``, ... as p50s) and its tok/s;
    {} without timings. ValueError when the rounds' timings name other stages."""
    rounds = [t for t in timings if t]
    if not rounds or not runs:
        return {}
    names = set(rounds[0])
    if any(set(t) != names for t in rounds):
        raise ValueError("the rounds' step timings name different stages or hops")

    def p50(name: str) -> float:
        return statistics.median(t[name]["p50"] for t in rounds)

    stages = sorted((n for n in names if n.startswith("stage") and n.endswith(".compute")),
                    key=lambda n: int(n[len("stage"):-len(".compute")]))
    hops = sorted({n.split(".")[0] for n in names if n.startswith("hop")},
                  key=lambda h: int(h[len("hop"):].split("-")[0]))
    token_ms = 1e3 / statistics.median(runs)
    return {"stage_ms": [round(p50(s), 3) for s in stages],
            "hop_ms": [round(sum(p50(f"{h}.{part}") for part in ("serialise", "queue",
                                                                 "network")), 3)
                       for h in hops],
            "overhead_ms": round(p50("overhead"), 3),
            "between_ms": round(token_ms - p50("total"), 3), "token_ms": round(token_ms, 3)}


def case_report(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """A measured case (tools.plan.measure.run_case's outcome) as the report shows it."""
    prediction: PredictionStatus = outcome["prediction"]
    return {**outcome["setup"], "placement": outcome["placement"],
            "speed_factors": outcome.get("speed_factors", {}),
            "slowed_by": outcome["slowed_by"],
            "predicted_step_ms": [round(v, 3) for v in prediction.stage_ms],
            "predicted_hop_ms": [round(v, 3) for v in prediction.hop_ms],
            "predicted_token_ms": round(1e3 / prediction.tok_s, 3) if prediction.tok_s else None,
            "measured_terms": pipeline_terms(outcome.get("timing", []),
                                             outcome["measured"].get(1, [])),
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
    for name, case in report["cases"].items():
        terms = case.get("measured_terms")
        if terms:
            console.print(
                f"{name}, one stream's token (ms): predicted steps "
                f"{_ms(case['predicted_step_ms'])}, hops {_ms(case['predicted_hop_ms'])}, "
                f"a token {case['predicted_token_ms']}; measured compute "
                f"{_ms(terms['stage_ms'])}, hops {_ms(terms['hop_ms'])}, overhead "
                f"{terms['overhead_ms']}, between steps {terms['between_ms']}, a token "
                f"{terms['token_ms']}", highlight=False, soft_wrap=True)
    for name, why in report["skipped"].items():
        console.print(f"[dim]{name} skipped: {why}[/]")
    for name, target in report["targets"].items():
        value = "no case" if target["value"] is None else f"{target['value']:.1%}"
        mark = "[green]met[/]" if target["met"] else "[red]not met[/]"
        console.print(f"{name}: worst {value} · {mark}")


def _ms(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)
