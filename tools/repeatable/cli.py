"""The benchmark's command line: which models, settings, cases, and how long to measure."""

from __future__ import annotations

import json
import logging
from typing import Annotated

import typer

from tools.harness.options import Json, fail
from tools.repeatable.cases import CASES
from tools.repeatable.settings import parse_settings

MODELS = "smollm2-135m,random-tiny"


def main(
    models: Annotated[str, typer.Option(help="comma-separated: smollm2-135m, random-tiny, "
                                             "random-1b or HF directories")] = MODELS,
    settings: Annotated[str, typer.Option(
        help="comma-separated, of today, repeatable, f16, exact (today's is always measured)")]
        = "repeatable",
    cases: Annotated[str, typer.Option(help=f"comma-separated, of {', '.join(CASES)} "
                                            "('': costs only)")]
        = ",".join(CASES),
    prompts: Annotated[int, typer.Option(help="prompts per case (1-20)")] = 20,
    tokens: Annotated[int, typer.Option(help="new tokens per request")] = 32,
    stages: Annotated[int, typer.Option(help="stages of the export")] = 2,
    weights: Annotated[str, typer.Option(help="int4 | int8 | fp16 | fp32")] = "int8",
    rounds: Annotated[int, typer.Option(help="cost rounds, settings taking turns (0: none)")]
        = 5,
    cost_models: Annotated[str, typer.Option(help="the models whose costs are measured")]
        = "smollm2-135m",
    as_json: Json = False,
) -> None:
    from tools.harness.models import BenchModel
    from tools.harness.report import run_record
    from tools.repeatable.cases import run_cases
    from tools.repeatable.costs import run_costs
    from tools.repeatable.lab import Lab
    from tools.repeatable.prompts import PROMPTS
    from tools.repeatable.report import print_report, targets

    logging.getLogger("zctl.engine").setLevel(logging.ERROR)  # the outages' pause notes
    try:
        chosen = parse_settings(settings)
    except ValueError as exc:
        fail(str(exc))
    case_list = [c.strip() for c in cases.split(",") if c.strip()]
    if any(c not in CASES for c in case_list):
        fail(f"--cases takes some of {', '.join(CASES)} (none: costs only), got {cases!r}")
    if not 1 <= prompts <= len(PROMPTS) or tokens < 2 or stages < 1 or rounds < 0:
        fail(f"--prompts 1-{len(PROMPTS)}, --tokens >= 2, --stages >= 1, --rounds >= 0")
    names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        fail("--models names at least one model")
    results = {}
    for name in names:
        lab = Lab(BenchModel.resolve(name).export(stages, weights), chosen)
        result = {"cases": {s.name: run_cases(lab, s.name, PROMPTS[:prompts], tokens, case_list)
                            for s in chosen} if case_list else {}}
        if rounds and name in cost_models.split(","):
            result["costs"] = run_costs(lab, [s.name for s in chosen], rounds)
        results[name] = result
        del lab
    best = next((s.name for s in chosen if s.name != "today"), "today")
    report = {**run_record(), "settings": {s.name: s.describe() for s in chosen},
              "options": {"prompts": prompts, "tokens": tokens, "stages": stages,
                          "weights": weights, "rounds": rounds},
              "models": results, "targets_setting": best, "targets": targets(results, best)}
    if as_json:
        print(json.dumps(report))
        return
    print_report(report)
