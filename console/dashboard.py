"""The ``zctl run`` dashboard: a pure builder from a snapshot to a Rich renderable.

``render_run`` knows nothing of sockets or OpenVINO; the run command fills a
``RunSnapshot`` as tokens arrive and hands the result to ``rich.live.Live``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class StageInfo:
    index: int
    node: str
    layers: str
    device: str


@dataclass
class RunSnapshot:
    """Everything the dashboard shows; ``timing`` is ``TimingWindow.summary()`` output."""

    prompt: str
    stages: list[StageInfo]
    text: str = ""
    tokens: int = 0
    ttft_ms: float | None = None
    tok_s: float | None = None
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    status: str = "running"


def _ms(summary: dict[str, dict[str, float]], name: str, q: str = "p50") -> str:
    value = summary.get(name, {}).get(q)
    return "-" if value is None else f"{value:.2f}"


def stage_table(snapshot: RunSnapshot) -> Table:
    """Per stage: where it runs, compute p50/p95, and the hop leaving it (queue/serialise/net)."""
    t = snapshot.timing
    table = Table(title="per-stage latency, ms (hop = this stage to the next)", expand=False,
                  title_justify="left")
    for name in ("stage", "node", "layers", "dev", "compute p50", "p95", "hop queue",
                 "serialise", "network"):
        table.add_column(name, justify="left" if name in ("node", "layers", "dev") else "right",
                         no_wrap=True)
    for stage in snapshot.stages:
        i = stage.index
        hop = f"hop{i}-{i + 1}"
        table.add_row(
            str(i), stage.node, stage.layers, stage.device,
            _ms(t, f"stage{i}.compute"), _ms(t, f"stage{i}.compute", "p95"),
            _ms(t, f"{hop}.queue"), _ms(t, f"{hop}.serialise"), _ms(t, f"{hop}.network"),
        )
    return table


def summary_line(snapshot: RunSnapshot) -> Text:
    parts = [f"tokens {snapshot.tokens}"]
    if snapshot.ttft_ms is not None:
        parts.append(f"TTFT {snapshot.ttft_ms:.0f} ms")
    if snapshot.tok_s is not None:
        parts.append(f"{snapshot.tok_s:.1f} tok/s")
    if "total" in snapshot.timing:
        parts.append(f"step p50 {_ms(snapshot.timing, 'total')} ms")
    if "overhead" in snapshot.timing:
        parts.append(f"framework overhead p50 {_ms(snapshot.timing, 'overhead')} ms")
    parts.append(snapshot.status)
    return Text("  ·  ".join(parts), style="bold")


def render_run(snapshot: RunSnapshot) -> RenderableType:
    """The whole dashboard: generated text, the stage table, and a summary line."""
    body = Text(snapshot.text or "…")
    return Group(
        Panel(body, title=Text(snapshot.prompt[:80], style="italic"), border_style="cyan"),
        stage_table(snapshot),
        summary_line(snapshot),
    )
