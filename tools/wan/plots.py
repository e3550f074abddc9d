"""The PNG figures of an experiment, drawn from its rows (matplotlib, no display).

Each figure is drawn only when the rows vary along its x axis (two or more values):

- ``throughput_vs_latency.png``: tok/s against per-hop latency, one line per decoding
  configuration and stream count (top-1 payload), one panel per stage count;
- ``best_k_vs_latency.png``: the best fixed K at each latency, and adaptive K's mean K;
- ``payload_vs_bandwidth.png``: tok/s per payload mode against link bandwidth, with and
  without a relay;
- ``streams_vs_latency.png``: aggregate tok/s against the stream count, one line per
  latency;
- ``throughput_vs_jitter.png``: tok/s against the jitter on every hop.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.wan.analysis import best_fixed_k

Rows = Sequence[dict[str, Any]]


def _series(rows: Rows, x: str, label: Callable[[dict[str, Any]], str]
            ) -> dict[str, list[tuple[float, float]]]:
    """label -> sorted (x, tok/s) points of the rows that have a throughput (labels in the
    rows' order)."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r.get("tok_s"):
            out[label(r)].append((float(r[x]), float(r["tok_s"])))
    return {k: sorted(v) for k, v in out.items()}


def _figure(panels: int, title: str) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(max(7.5, 5.5 * panels), 4.6), squeeze=False)
    fig.suptitle(title, fontsize="medium")
    return fig, list(axes[0])


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw(ax: Any, series: dict[str, list[tuple[float, float]]], xlabel: str,
          ylabel: str = "aggregate tok/s") -> None:
    for label, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize="small")


def _by_stages(rows: Rows) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[int(r["stages"])].append(r)
    return dict(sorted(out.items()))


def _distinct(rows: Rows, column: str) -> int:
    return len({r[column] for r in rows})


def throughput_vs_latency(rows: Rows, path: Path, title: str) -> Path | None:
    top1 = [r for r in rows if r["payload"] == "top1"]
    if _distinct(top1, "delay_ms") < 2:
        return None
    groups = _by_stages(top1)
    fig, axes = _figure(len(groups), f"{title}: throughput against per-hop latency")
    for ax, (stages, group) in zip(axes, groups.items(), strict=True):
        _draw(ax, _series(group, "delay_ms", lambda r: f"{r['config']} x{r['streams']}"),
              "one-way latency per hop (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{stages} stages")
    return _save(fig, path)


def best_k_vs_latency(rows: Rows, path: Path, title: str) -> Path | None:
    best = best_fixed_k(rows)
    if len({v["delay_ms"] for v in best.values()}) < 2:
        return None
    fig, (ax,) = _figure(1, f"{title}: best draft length against per-hop latency")
    for stages in sorted({v["stages"] for v in best.values()}):
        points = sorted((v["delay_ms"], v["k"], v["auto_k_mean"]) for v in best.values()
                        if v["stages"] == stages)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-",
                label=f"best fixed K, {stages} stages")
        auto = [(p[0], p[2]) for p in points if p[2] is not None]
        if auto:
            ax.plot([p[0] for p in auto], [p[1] for p in auto], "s--",
                    label=f"adaptive K (mean), {stages} stages")
    ax.set_xlabel("one-way latency per hop (ms)")
    ax.set_ylabel("draft length K")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def payload_vs_bandwidth(rows: Rows, path: Path, title: str) -> Path | None:
    capped = [r for r in rows if r["rate_mbit"]]
    if _distinct(capped, "rate_mbit") < 2 and _distinct(capped, "payload") < 2:
        return None
    fig, (ax,) = _figure(1, f"{title}: the last stage's payload against bandwidth")
    _draw(ax, _series(capped, "rate_mbit", lambda r: (
        f"{r['payload']}{' via relay' if r['relay'] else ''}"
        f"{' over tbf' if r.get('shaper') == 'tbf' else ''}, {r['config']} x{r['streams']}")),
        "link bandwidth (Mbit/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    return _save(fig, path)


def streams_vs_latency(rows: Rows, path: Path, title: str) -> Path | None:
    picked = [r for r in rows if r["payload"] == "top1"]
    if _distinct(picked, "streams") < 2:
        return None
    groups = _by_stages(picked)
    fig, axes = _figure(len(groups), f"{title}: aggregate throughput against streams")
    for ax, (stages, group) in zip(axes, groups.items(), strict=True):
        group = sorted(group, key=lambda r: (r["delay_ms"], r["config"]))
        _draw(ax, _series(group, "streams",
                          lambda r: f"{r['delay_ms']:g} ms/hop, {r['config']}"),
              "concurrent streams")
        ax.set_yscale("log")
        ax.set_title(f"{stages} stages")
    return _save(fig, path)


def throughput_vs_jitter(rows: Rows, path: Path, title: str) -> Path | None:
    if _distinct(rows, "jitter_ms") < 2:
        return None
    fig, (ax,) = _figure(1, f"{title}: throughput against jitter")
    _draw(ax, _series(rows, "jitter_ms", lambda r: (
        f"{r['delay_ms']:g} ms/hop, {r['config']} x{r['streams']} {r['payload']}")),
        "jitter per frame, uniform 0..J (ms)")
    return _save(fig, path)


FIGURES = {
    "throughput_vs_latency.png": throughput_vs_latency,
    "best_k_vs_latency.png": best_k_vs_latency,
    "payload_vs_bandwidth.png": payload_vs_bandwidth,
    "streams_vs_latency.png": streams_vs_latency,
    "throughput_vs_jitter.png": throughput_vs_jitter,
}


def draw_all(rows: Rows, out_dir: Path, title: str) -> list[Path]:
    """Every figure the rows can fill, written to ``out_dir``; the paths written."""
    written = []
    for name, draw in FIGURES.items():
        path = draw(rows, out_dir / name, title)
        if path is not None:
            written.append(path)
    return written
