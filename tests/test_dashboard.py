"""The run dashboard is a pure function of its snapshot."""

from __future__ import annotations

from rich.console import Console

from console.dashboard import RunSnapshot, StageInfo, render_run


def _text(snapshot: RunSnapshot) -> str:
    console = Console(width=120, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render_run(snapshot))
    return console.export_text()


def test_dashboard_shows_every_stage_and_the_breakdown() -> None:
    snap = RunSnapshot(
        prompt="why?", text="Because of Rayleigh scattering.", tokens=12, ttft_ms=41.0, tok_s=33.5,
        stages=[StageInfo(0, "127.0.0.1", "0-14", "CPU"), StageInfo(1, "127.0.0.2", "15-29", "GPU")],
        timing={"stage0.compute": {"p50": 12.25, "p95": 13.5}, "stage1.compute": {"p50": 15.0, "p95": 16.0},
                "hop0-1.queue": {"p50": 0.0, "p95": 0.1}, "hop0-1.serialise": {"p50": 0.12, "p95": 0.2},
                "hop0-1.network": {"p50": 0.43, "p95": 0.6}, "total": {"p50": 28.6, "p95": 30.0},
                "overhead": {"p50": 0.56, "p95": 0.7}},
    )
    text = _text(snap)
    for expected in ("Because of Rayleigh scattering.", "127.0.0.2", "15-29", "GPU", "12.25", "13.50",
                     "0.43", "TTFT 41 ms", "33.5 tok/s", "overhead p50 0.56 ms"):
        assert expected in text, expected


def test_dashboard_before_any_token() -> None:
    text = _text(RunSnapshot(prompt="hi", stages=[StageInfo(0, "h", "0-3", "CPU")]))
    assert "tokens 0" in text and "running" in text and "-" in text
