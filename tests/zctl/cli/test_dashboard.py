"""The run dashboard is a pure function of its snapshot."""

from __future__ import annotations

import io

from rich.console import Console

from zctl.cli.dashboard import RunSnapshot, StageInfo, StreamView, render_run, terminal_text

STAGES = [StageInfo(0, "127.0.0.1", "0-14", "CPU"), StageInfo(1, "127.0.0.2", "15-29", "GPU")]
TIMING = {"stage0.compute": {"p50": 12.25, "p95": 13.5}, "stage1.compute": {"p50": 15.0, "p95": 16.0},
          "hop0-1.queue": {"p50": 0.0, "p95": 0.1}, "hop0-1.serialise": {"p50": 0.12, "p95": 0.2},
          "hop0-1.network": {"p50": 0.43, "p95": 0.6}, "total": {"p50": 28.6, "p95": 30.0},
          "overhead": {"p50": 0.56, "p95": 0.7}}


def _text(snapshot: RunSnapshot) -> str:
    console = Console(width=140, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render_run(snapshot))
    return console.export_text()


def test_dashboard_shows_every_stage_and_the_breakdown() -> None:
    stream = StreamView(prompt="why?", text="Because of Rayleigh scattering.", tokens=12,
                        ttft_ms=41.0, tok_s=33.5)
    text = _text(RunSnapshot(STAGES, [stream], TIMING))
    for expected in ("Because of Rayleigh scattering.", "127.0.0.2", "15-29", "GPU", "12.25", "13.50",
                     "0.43", "TTFT 41 ms", "33.5 tok/s", "overhead p50 0.56 ms"):
        assert expected in text, expected
    assert "accept" not in text


def test_dashboard_shows_speculation_figures() -> None:
    stream = StreamView(prompt="code", text="x", tokens=40, tok_s=50.0,
                        spec={"acceptance": 0.72, "k": 5.0, "tokens_per_step": 2.9}, status="done (eos)")
    text = _text(RunSnapshot(STAGES, [stream], TIMING))
    assert "accept 72% · K 5 · 2.90 tok/step" in text and "done (eos)" in text


def test_dashboard_with_several_streams_has_a_row_each_and_the_aggregate() -> None:
    streams = [StreamView(prompt=f"prompt {i}", text=f"answer number {i}", tokens=10 + i, tok_s=20.0 + i,
                          spec={"acceptance": 0.5, "k": 4.0} if i == 1 else {}) for i in range(3)]
    text = _text(RunSnapshot(STAGES, streams, TIMING, aggregate_tok_s=61.5))
    for expected in ("prompt 0", "prompt 2", "answer number 1", "21.0", "50%", "aggregate 61.5 tok/s",
                     "3 streams", "tokens 33"):
        assert expected in text, expected


def test_dashboard_before_any_token() -> None:
    text = _text(RunSnapshot([StageInfo(0, "h", "0-3", "CPU")], [StreamView(prompt="hi")]))
    assert "tokens 0" in text and "running" in text and "-" in text
    # no timing yet: the stage's row shows its place and a dash in each of the 5 figures
    rows = [line for line in text.splitlines() if line.startswith("│")]
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in rows]
    assert ["0", "h", "0-3", "CPU", "-", "-", "-", "-", "-"] in cells, rows
    assert ["…"] in cells  # the text panel waits for the first token
    lines = [line.strip() for line in text.splitlines()]
    assert "tokens 0  ·  running" in lines  # and the summary has no TTFT or tok/s yet
    assert "TTFT" not in text and "tok/s" not in text


def test_run_status_waits_for_every_stream_then_sums_up_the_endings() -> None:
    streams = [StreamView("a", status="done (eos)"), StreamView("b")]
    snapshot = RunSnapshot([], streams)
    assert snapshot.status == "running"
    streams[1].status = "done (max_tokens)"
    assert snapshot.status == "done: 1 eos, 1 max_tokens"
    streams[1].status = "done (eos)"
    assert snapshot.status == "done (eos)"
    assert RunSnapshot([], []).status == "running"


def test_control_characters_in_text_are_shown_not_sent_to_the_terminal() -> None:
    """A model's (or a prompt's) escape sequence must not drive the user's terminal: the
    dashboard shows control characters as symbols, in one stream's panel and in the rows."""
    assert terminal_text("a\x1b[2Jb\x12c\x7fd\x9be\tf\ng") == "a␛[2Jb␒c␡d\ufffde\tf\ng"
    one = StreamView(prompt="hi\x1b]0;title\x07", text="ok\x1b[2Jgone\x12", tokens=3)
    raw = _raw(RunSnapshot(STAGES, [one], TIMING))
    assert "\x1b[2J" not in raw and "\x1b]0;" not in raw and "\x12" not in raw
    assert "ok␛[2Jgone␒" in raw and "hi␛]0;title␇" in raw
    many = [StreamView(prompt=f"p{i}\x1b[H", text=f"t{i}\x1b[K", tokens=1) for i in range(2)]
    raw = _raw(RunSnapshot(STAGES, many, TIMING))
    assert "\x1b[H" not in raw and "\x1b[K" not in raw and "t1␛[K" in raw


def _raw(snapshot: RunSnapshot) -> str:
    """What the dashboard writes to a terminal, escape sequences and all."""
    buffer = io.StringIO()
    Console(width=140, file=buffer, force_terminal=True, color_system=None).print(
        render_run(snapshot))
    return buffer.getvalue()
