"""``zctl plan MODEL``: will a model fit a fleet of PCs, how each PC is used, how fast it runs.

Planning reads the model's shape only (a preset, a config.json, a GGUF header, or what
``zctl export`` takes, whose config.json alone is fetched): no weights are loaded. The
fleet is a file of PCs (reference figures, or profiles measured on them), or a running
cluster (``--endpoint``: its nodes' measured profiles and its links' measured figures).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from controlplane.placement import PlacementError
from controlplane.planner.cluster_fleet import cluster_fleet
from controlplane.planner.fleet import Fleet, FleetError, load_fleet
from controlplane.planner.memory import DEFAULT_CONTEXT
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import Links, NodeProfile, ProfileError
from controlplane.planner.references import REFERENCE_LINKS, REFERENCE_SPEEDS
from controlplane.planner.report import plan_dict
from controlplane.planner.search import Plan, PlanRequest, objective_problem, plan
from controlplane.planner.shape import ModelShape, ShapeError
from controlplane.planner.shape_sources import resolve_shape
from controlplane.planner.timing import PROMPT_TOKENS
from zctl.cli.exports import AUTO, resolve_weights
from zctl.cli.plan_view import render_plan
from zctl.weights import EXACT_EXPERT_BYTES_PER_WEIGHT, EXACT_EXPERT_GROUP, WEIGHT_FORMATS

err = Console(stderr=True)
out = Console()
FIT_FORMATS = ("int4", "int8")  # whether a model fits is told for these when --weights is auto
REFERENCE_NOTE = ("predicted from reference profiles, not measurements of these PCs "
                  "(docs/design.md, \"Planning\")")
MEASURED_NOTE = ("predicted from profiles measured on the PCs (zctl node profile) and, "
                 "for a running cluster, its links as probed")
EXACT_EXPERTS_NOTE = (f"the experts exact: i8 codes with a scale per {EXACT_EXPERT_GROUP} "
                      f"weights, {EXACT_EXPERT_BYTES_PER_WEIGHT:.4g} bytes a weight in every "
                      "format (zctl export --exact-experts)")
MODEL_HELP = (f"a preset ({', '.join(PRESETS)}), a config.json, a .gguf file, a model "
              "directory or a hub id (its config.json only)")


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


@dataclass(frozen=True)
class PlanFleet:
    """What a plan runs on: each node's profile and the links for a format, the node that
    runs stage 0, how many PCs, the formats that can be planned, notes, and whether the
    experts are planned exact."""

    source: str
    size: int
    formats: tuple[str, ...]  # None of a file's PCs rule a format out; a cluster: its own
    inputs: Callable[[ModelShape, str], tuple[dict[str, NodeProfile], Links]]
    head: str | None
    notes: tuple[str, ...]
    exact_experts: bool = False


def file_fleet(path: Path, exact_experts: bool = False) -> PlanFleet:
    fleet: Fleet = load_fleet(path)
    notes = (MEASURED_NOTE if fleet.profiled else REFERENCE_NOTE,
             *((EXACT_EXPERTS_NOTE,) if exact_experts else ()))
    return PlanFleet(str(path), len(fleet.pcs), tuple(WEIGHT_FORMATS),
                     lambda shape, fmt: (fleet.profiles(shape, fmt, exact_experts),
                                         fleet.links()),
                     fleet.head, notes, exact_experts)


def running_fleet(endpoint: str, shape: ModelShape, weights: str,
                  exact_experts: bool = False) -> PlanFleet:
    """The cluster at ``endpoint`` (ValueError when it cannot be reached or planned on);
    its experts exact when ``exact_experts`` says so or every profile it holds timed them
    so (it serves an export with exact experts)."""
    from controlplane.client import ClusterUnreachable, query_status

    try:
        status = query_status(endpoint)
    except (ClusterUnreachable, OSError) as exc:
        raise ValueError(str(exc)) from None
    profiles = [n.profile for n in status.nodes if n.profile is not None]
    profiled = {p.weights for p in profiles}
    fmt = weights if weights != AUTO else (profiled.pop() if len(profiled) == 1 else
                                           resolve_weights(shape.name, AUTO))
    exact = exact_experts or bool(profiles) and all(p.exact_experts for p in profiles)
    fleet = cluster_fleet(status, shape, fmt)
    return PlanFleet(f"cluster at {endpoint}", len(fleet.profiles), (fmt,),
                     lambda _shape, _fmt: (fleet.profiles, fleet.links), fleet.head,
                     (*fleet.notes, MEASURED_NOTE, *((EXACT_EXPERTS_NOTE,) if exact else ())),
                     exact)


def plan_command(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    fleet: Annotated[Path | None, typer.Option(
        help="a TOML file of PCs (examples/fleets/); each PC's profile is one of "
             f"{', '.join(REFERENCE_SPEEDS)} or its own figures, its link one of "
             f"{', '.join(REFERENCE_LINKS)} or its own")] = None,
    endpoint: Annotated[str | None, typer.Option(
        help="a running cluster's coordinator: plan on its nodes' measured profiles and "
             "its links")] = None,
    objective: Annotated[str, typer.Option(
        help="latency: one stream's tok/s; throughput: N streams' aggregate tok/s")] = "latency",
    streams: Annotated[int, typer.Option(
        help="N: the streams throughput is judged at and KV is reserved for", min=1)] = 4,
    weights: Annotated[str, typer.Option(
        help=f"{AUTO} | {' | '.join(WEIGHT_FORMATS)}; auto: the model's default format, and "
             "whether it fits in INT4 and INT8")] = AUTO,
    context: Annotated[int, typer.Option(help="tokens of KV per stream", min=1)] = DEFAULT_CONTEXT,
    prompt: Annotated[int, typer.Option(help="the prompt TTFT is predicted for",
                                        min=1)] = PROMPT_TOKENS,
    top: Annotated[int, typer.Option(help="placements to list", min=1)] = 5,
    exact_experts: Annotated[bool, typer.Option(
        "--exact-experts", help="a mixture of experts' weights exact, as `zctl export "
                                "--exact-experts` keeps MXFP4 experts")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Plan a model on a fleet of PCs before any export: does it fit (in INT4 and INT8),
    which PCs take which layers, predicted tok/s at 1 and N streams and time to first token."""
    problem = objective_problem(objective)
    if problem:
        fail(problem)
    if weights != AUTO and weights not in WEIGHT_FORMATS:
        fail(f"--weights is {AUTO} or one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    if (fleet is None) == (endpoint is None):
        fail("give --fleet FILE (the PCs to plan for: examples/fleets/four-pcs.toml) or "
             "--endpoint ADDR (a running cluster), one of them")
    try:
        shape = resolve_shape(model)
        if exact_experts and not shape.moe:
            fail(f"--exact-experts: {shape.name} has no mixture of experts")
        pcs = (file_fleet(fleet, exact_experts) if fleet is not None
               else running_fleet(endpoint, shape, weights, exact_experts))
    except (ShapeError, FleetError, ProfileError, ValueError) as exc:
        fail(str(exc))
    chosen = resolve_weights(model, weights) if fleet is not None else pcs.formats[0]
    formats = [chosen] if weights != AUTO else list(dict.fromkeys((chosen, *FIT_FORMATS)))
    fits: dict[str, Plan | str] = {}
    notes = list(pcs.notes)
    for fmt in sorted((f for f in formats if f in pcs.formats), key=WEIGHT_FORMATS.index):
        try:
            profiles, links = pcs.inputs(shape, fmt)
        except ProfileError as exc:
            if fmt == chosen:
                fail(str(exc))
            notes.append(f"{fmt.upper()} not planned: {exc}")
            continue
        request = PlanRequest(shape, fmt, profiles, links, exact_experts=pcs.exact_experts,
                              objective=objective,
                              streams=streams, head=pcs.head, context=context, prompt=prompt,
                              top=top)
        try:
            fits[fmt] = plan(request)
        except PlacementError as exc:
            fits[fmt] = str(exc)
        except (ProfileError, ValueError) as exc:
            fail(str(exc))
    if as_json:
        print(json.dumps({
            "model": shape.as_dict(), "fleet": pcs.source, "weights": chosen,
            "exact_experts": pcs.exact_experts,
            "objective": objective, "streams": streams, "context": context, "prompt": prompt,
            "fits": {fmt: ({"fits": True, **plan_dict(outcome)} if isinstance(outcome, Plan)
                           else {"fits": False, "error": outcome})
                     for fmt, outcome in fits.items()},
            "notes": notes}))
    else:
        render_plan(out, shape, pcs.source, pcs.size, fits, chosen, prompt, context, notes)
    if isinstance(fits[chosen], str):
        raise typer.Exit(1)
