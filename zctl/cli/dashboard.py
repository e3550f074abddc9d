"""The ``zctl run`` dashboard: a pure builder from a snapshot to a Rich renderable.

``render_run`` knows nothing of sockets or OpenVINO; the run command fills a
``RunSnapshot`` as tokens arrive and hands the result to ``rich.live.Live``. One stream
shows its text; several show a row each (tokens, tok/s, acceptance, K) and the aggregate.
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
class StreamView:
    """One generation as the client sees it; ``spec`` is the service's spec_summary."""

    prompt: str
    text: str = ""
    tokens: int = 0
    ttft_ms: float | None = None
    tok_s: float | None = None
    spec: dict[str, float] = field(default_factory=dict)
    status: str = "running"
    notes: list[str] = field(default_factory=list)  # what happened to it (paused, resumed)


@dataclass
class RunSnapshot:
    """Everything the dashboard shows; ``timing`` is ``TimingWindow.summary()`` output."""

    stages: list[StageInfo]
    streams: list[StreamView]
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    aggregate_tok_s: float | None = None

    @property
    def status(self) -> str:
        """'running' while any stream runs; then the one final status all share, or a
        count of each ('done: 1 eos, 1 max_tokens')."""
        states = [s.status for s in self.streams]
        if not states or "running" in states:
            return "running"
        kinds = sorted(set(states))
        if len(kinds) == 1:
            return kinds[0]
        counts = [f"{states.count(k)} {k.removeprefix('done (').removesuffix(')')}" for k in kinds]
        return "done: " + ", ".join(counts)


def _ms(summary: dict[str, dict[str, float]], name: str, q: str = "p50") -> str:
    value = summary.get(name, {}).get(q)
    return "-" if value is None else f"{value:.2f}"


def spec_text(spec: dict[str, float]) -> str:
    """'accept 72% · K 5 · 2.9 tok/step' for a speculative stream, '' otherwise."""
    if not spec:
        return ""
    return (f"accept {spec.get('acceptance', 0.0):.0%} · K {spec.get('k', 0):.0f} · "
            f"{spec.get('tokens_per_step', 0.0):.2f} tok/step")


def _numeric(table: Table, *names: str) -> None:
    for name in names:
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))


def stage_table(snapshot: RunSnapshot) -> Table:
    """Per stage: where it runs, compute p50/p95, and the hop leaving it (queue/serialise/net)."""
    t = snapshot.timing
    table = Table(title="per stage, ms: compute p50 p95 · hop to the next: queue, serialise, "
                        "network", expand=False, title_justify="left")
    _numeric(table, "#")
    table.add_column("node", overflow="ellipsis", no_wrap=True)
    table.add_column("layers", no_wrap=True, min_width=5)
    table.add_column("dev", overflow="ellipsis", no_wrap=True, max_width=8)
    _numeric(table, "p50", "p95", "queue", "ser", "net")
    for stage in snapshot.stages:
        i = stage.index
        hop = f"hop{i}-{i + 1}"
        table.add_row(
            str(i), stage.node, stage.layers, stage.device,
            _ms(t, f"stage{i}.compute"), _ms(t, f"stage{i}.compute", "p95"),
            _ms(t, f"{hop}.queue"), _ms(t, f"{hop}.serialise"), _ms(t, f"{hop}.network"),
        )
    return table


# Control characters a model (or a prompt) may carry, shown as symbols rather than sent to
# the terminal: C0 (but tab and newline) as their Control Pictures (ESC is "␛"), DEL "␡",
# C1 as U+FFFD. Sent raw, an ESC sequence in generated text would drive the user's terminal.
_SHOWN_CONTROLS = ({c: 0x2400 + c for c in range(0x20) if c not in (0x09, 0x0A)}
                   | {0x7F: 0x2421} | {c: 0xFFFD for c in range(0x80, 0xA0)})


def terminal_text(text: str) -> str:
    """``text`` safe to show on a terminal: its control characters as visible symbols."""
    return text.translate(_SHOWN_CONTROLS)


def _tail(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def stream_table(snapshot: RunSnapshot, tail: int = 32) -> Table:
    """One row per stream: tokens, TTFT, tok/s, acceptance and K, status, the latest text."""
    table = Table(title="streams", expand=True, title_justify="left")
    _numeric(table, "#")
    table.add_column("prompt", overflow="ellipsis", no_wrap=True, ratio=1)
    _numeric(table, "tok", "TTFT", "tok/s", "acc", "K")
    table.add_column("status", no_wrap=True, min_width=4)
    table.add_column("latest", no_wrap=True, ratio=2)
    for i, s in enumerate(snapshot.streams):
        table.add_row(
            str(i), terminal_text(s.prompt), str(s.tokens),
            "-" if s.ttft_ms is None else f"{s.ttft_ms:.0f}",
            "-" if s.tok_s is None else f"{s.tok_s:.1f}",
            f"{s.spec['acceptance']:.0%}" if "acceptance" in s.spec else "-",
            f"{s.spec['k']:.0f}" if "k" in s.spec else "-",
            s.status.removeprefix("done (").removesuffix(")"),
            _tail(terminal_text(s.text.replace("\n", " ")), tail),
        )
    return table


def summary_line(snapshot: RunSnapshot) -> Text:
    streams = snapshot.streams
    parts = [f"tokens {sum(s.tokens for s in streams)}"]
    if len(streams) == 1:
        one = streams[0]
        if one.ttft_ms is not None:
            parts.append(f"TTFT {one.ttft_ms:.0f} ms")
        if one.tok_s is not None:
            parts.append(f"{one.tok_s:.1f} tok/s")
        if one.spec:
            parts.append(spec_text(one.spec))
    else:
        parts.append(f"{len(streams)} streams")
        if snapshot.aggregate_tok_s is not None:
            parts.append(f"aggregate {snapshot.aggregate_tok_s:.1f} tok/s")
    if "total" in snapshot.timing:
        parts.append(f"step p50 {_ms(snapshot.timing, 'total')} ms")
    if "overhead" in snapshot.timing:
        parts.append(f"framework overhead p50 {_ms(snapshot.timing, 'overhead')} ms")
    parts.append(snapshot.status)
    return Text("  ·  ".join(parts), style="bold")


def render_run(snapshot: RunSnapshot) -> RenderableType:
    """The whole dashboard: generated text (or a row per stream), the stage table, a summary."""
    if len(snapshot.streams) == 1:
        one = snapshot.streams[0]
        top: RenderableType = Panel(Text(terminal_text(one.text) or "…"),
                                    title=Text(terminal_text(one.prompt[:80]), style="italic"),
                                    border_style="cyan")
    else:
        top = stream_table(snapshot)
    return Group(top, stage_table(snapshot), summary_line(snapshot))
