"""The Rich view of ``zctl plan``: does the model fit, how each PC is used, how fast it runs."""

from __future__ import annotations

from collections.abc import Mapping

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from controlplane.placement import fmt_bytes, layer_range
from controlplane.planner.search import Placement, Plan
from controlplane.planner.shape import ModelShape
from zctl.manifest import layer_spec


def seconds(value: float) -> str:
    """A time as people read it: 0.43 ms, 125 ms, 1.2 s, 113 s."""
    if value < 1e-3:
        return f"{value * 1e3:.2f} ms"
    if value < 1.0:
        return f"{value * 1e3:.0f} ms" if value >= 0.1 else f"{value * 1e3:.1f} ms"
    return f"{value:.1f} s" if value < 100 else f"{value:.0f} s"


def rate(tok_s: float) -> str:
    return f"{tok_s:.3g} tok/s"


def speed_line(placement: Placement, prompt: int) -> str:
    streams = placement.streams
    groups = (f"{streams.groups} row group{'s' if streams.groups > 1 else ''} of "
              f"{streams.rows} row{'s' if streams.rows > 1 else ''}")
    return (f"1 stream {rate(placement.tok_s)} ({seconds(1 / placement.tok_s)} a token) · "
            f"{streams.streams} streams {rate(streams.tok_s)} ({groups}) · "
            f"TTFT at {prompt:,} tokens {seconds(placement.first_token.seconds)}")


def stages_table(placement: Placement) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in (("stage", "right"), ("PC", "left"), ("layers", "left"),
                          ("memory used", "right"), ("free", "right"), ("step", "right"),
                          ("hop after it", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    nodes = placement.nodes
    for i, stage in enumerate(placement.stages):
        if len(nodes) == 1:
            hop = "none (one PC)"
        elif i < len(nodes) - 1:
            hop = f"{seconds(stage.hop_s)} to {nodes[i + 1]}"
        else:
            hop = f"{seconds(stage.hop_s)} reply to {nodes[0]}"
        table.add_row(str(i), stage.node, layer_range(stage.start, stage.end),
                      fmt_bytes(stage.memory_used), fmt_bytes(stage.memory_free),
                      seconds(stage.step_s), hop)
    return table


def others_table(plan: Plan) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="other placements",
                  title_justify="left")
    for name in ("#", "PCs (layers)", "1 stream", f"{plan.streams} streams", "TTFT"):
        table.add_column(name, justify="left" if name == "PCs (layers)" else "right")
    for rank, placement in enumerate(plan.placements[1:], start=2):
        order = ", ".join(f"{s.node} ({layer_range(s.start, s.end)})" for s in placement.stages)
        table.add_row(str(rank), order, rate(placement.tok_s), rate(placement.streams.tok_s),
                      seconds(placement.first_token.seconds))
    return table


def fits_line(fits: Mapping[str, Plan | str]) -> Text:
    text = Text("fits: ")
    for i, (weights, outcome) in enumerate(fits.items()):
        if i:
            text.append(" · ")
        text.append(weights.upper(), style="bold")
        if isinstance(outcome, str):
            text.append(" no", style="red")
        else:
            best = outcome.placements[0]
            text.append(" yes", style="green")
            text.append(f" ({rate(best.tok_s)} on {len(best.nodes)} of "
                        f"{len(best.nodes) + len(outcome.left_out)} PCs)")
    return text


def render_plan(console: Console, shape: ModelShape, source: str, pcs: int,
                fits: Mapping[str, Plan | str], chosen: str, prompt: int,
                context: int, notes: list[str]) -> None:
    """Print a plan: the shape, where it fits, the best placement, who is left out, the
    other placements, and what the figures rest on."""
    console.print(f"[bold]{shape.name}[/]: {shape.describe()}")
    best_plan = fits[chosen]
    streams = best_plan.streams if not isinstance(best_plan, str) else None
    objective = best_plan.objective if not isinstance(best_plan, str) else "?"
    kv = f"KV reserved for {streams} streams of {context:,} tokens" if streams else ""
    console.print(f"fleet {source}: {pcs} PCs · objective {objective} · {kv}")
    console.print(fits_line(fits))
    if isinstance(best_plan, str):
        console.print(f"[red]{chosen.upper()} does not fit:[/] {best_plan}", soft_wrap=True)
        return
    best = best_plan.placements[0]
    console.print()
    console.print(Group(Text(f"best placement in {chosen.upper()}: ", style="bold")
                        + Text(speed_line(best, prompt)), stages_table(best)))
    console.print(f"its stages as an export: [bold]--layers {layer_spec(best.ranges())}[/] "
                  "(zctl export MODEL --layers ..., or zctl cluster up --model MODEL --fleet FILE)",
                  soft_wrap=True, highlight=False)
    for out in best_plan.left_out:
        console.print(f"left out: [bold]{out.node}[/]: {out.reason}", soft_wrap=True)
    if len(best_plan.placements) > 1:
        console.print(others_table(best_plan))
    for note in notes:
        console.print(f"[dim]{note}[/]", soft_wrap=True)
    for weights, outcome in fits.items():
        if weights != chosen and isinstance(outcome, str):
            console.print(f"[dim]{weights.upper()}: {outcome}[/]", soft_wrap=True)
