"""``python -m tools.wan run FILE`` (``zctl experiment run FILE``, ``zctl bench
experiment run FILE``): run a scenario.

``run`` measures every cell of the scenario's grid (tools/wan/scenario.py) on local
clusters with emulated WAN links, with a progress bar over the grid, and writes into the
output directory (default ``experiment-results/NAME``):

- ``results.csv``: one row per cell, its parameters and figures (analysis.COLUMNS);
- ``results.json``: the rows, the ratios below, and where and when it ran;
- the PNG figures the grid can fill (plots.py).

It prints a summary table, or with ``--json`` one object: the rows' ratios
``best_over_plain`` (per per-hop latency ms: the fastest cell over plain single-stream
greedy), ``top1_over_full`` (per link, e.g. ``relay-20mbit``: top-1 payload over full
logits), ``topk_over_full`` and ``fp16_over_full`` (likewise, for a logprobs request's
top-k and float16 payloads), ``tbf_over_ours`` (per rate and payload: the kernel's tbf
over our link layer's shaping), ``lookup_over_plain`` (per lookup configuration and stream
count: speculation's speedup), ``streams_over_one`` (per configuration and stream count:
the streams' aggregate over one stream), ``auto_k_over_best_fixed`` (per latency),
``best_k`` and ``best_configuration``.
``check`` reads the file and shows its grid without running anything. A bad scenario file
is one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tools.harness.options import Json, Precision, Threads
from tools.harness.report import err, run_record
from tools.wan.analysis import comparisons, write_csv
from tools.wan.scenario import Scenario, ScenarioError, load_scenario

ACTIONS = ("run", "check")


class ProgressReporter:
    """A Rich progress bar over a scenario's measurements (runner.Reporter)."""

    def __init__(self, progress: Progress, per_cluster: int, total: int) -> None:
        self.progress = progress
        self.per_cluster = per_cluster
        self.clusters_done = 0
        self.task = progress.add_task("starting", total=total)

    def cluster(self, text: str) -> None:
        self.progress.update(self.task, description=f"cluster: {text}")

    def sample(self, text: str) -> None:
        self.progress.update(self.task, advance=1, description=text)

    def cluster_done(self) -> None:
        self.clusters_done += 1
        self.progress.update(self.task, completed=self.clusters_done * self.per_cluster)


def grid_summary(scenario: Scenario) -> dict[str, Any]:
    """What ``check`` shows: the grid's size."""
    return {"scenario": scenario.name, "clusters": len(scenario.topologies),
            "workloads": len(scenario.workloads), "cells": len(scenario.cells()),
            "measurements": len(scenario.cells()) * scenario.repetitions,
            "tokens": scenario.tokens, "stages": sorted({t.stages for t in scenario.topologies})}


def results_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for column in ("stages", "ms/hop", "link", "config", "streams", "payload", "tok/s",
                   "mean K", "acceptance", "error"):
        table.add_column(column, justify="left" if column in ("link", "config", "error")
                         else "right")
    for r in rows:
        table.add_row(*("-" if v is None or v == "" else str(v) for v in (
            r["stages"], f"{r['delay_ms']:g}", r["link"] + (" *" if r["hops"] else ""),
            r["config"], r["streams"], r["payload"], r["tok_s"], r["k_mean"],
            r["acceptance"], r["error"][:60])))
    return table


def ratios_table(ratios: dict[str, Any]) -> Table:
    table = Table(title="comparisons")
    table.add_column("figure")
    table.add_column("key")
    table.add_column("value", justify="right")
    for name, values in ratios.items():
        for key, value in values.items():
            table.add_row(name, key, str(value))
    return table


def export_dirs(scenario: Scenario) -> dict[int, Path]:
    """An export per stage count: the scenario's own, else the benchmark cache's (made on
    first use)."""
    if scenario.exports:
        return scenario.exports
    from tools.harness.models import BenchModel

    model = BenchModel.resolve(scenario.model)
    return {s: model.export(s, scenario.weights)
            for s in sorted({t.stages for t in scenario.topologies})}


def run(scenario: Scenario, out: Path, precision: str, threads: int) -> dict[str, Any]:
    """Measure the grid, write results.csv, results.json and the figures; the result."""
    from tools.harness.models import plugin_properties
    from tools.wan.plots import draw_all
    from tools.wan.runner import RunSettings, run_scenario
    from zctl.launcher.processes import runtime_spec

    props = plugin_properties(precision, threads)
    settings = RunSettings(runtime_spec(props.get("INFERENCE_PRECISION_HINT"), threads or None,
                                        "CPU"), out / "clusters")
    exports = export_dirs(scenario)
    record = run_record()
    per_cluster = len(scenario.workloads) * scenario.repetitions
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=err) as progress:
        reporter = ProgressReporter(progress, per_cluster,
                                    per_cluster * len(scenario.topologies))
        rows = run_scenario(scenario, exports, settings, record, reporter)
    write_csv(rows, out / "results.csv")
    title = f"{scenario.name}: {scenario.model} {scenario.weights}, {scenario.tokens} tokens"
    plots = draw_all(rows, out, title)
    result = {"scenario": scenario.name, "file": str(scenario.source or ""), **record,
              "out": str(out), "csv": str(out / "results.csv"),
              "plots": [str(p) for p in plots], **comparisons(rows), "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return result


def main(
    action: Annotated[str, typer.Argument(help="run: measure the grid | check: read the file "
                                               "and show its grid")],
    scenario_file: Annotated[Path, typer.Argument(
        metavar="FILE", help="a scenario (tools/wan/scenarios/*.toml)")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="results directory (default: experiment-results/NAME)")] = None,
    precision: Precision = "f32",
    threads: Threads = 0,
    as_json: Json = False,
) -> None:
    """Scripted WAN experiments: a scenario file's grid on local clusters, CSV and plots."""
    if action not in ACTIONS:
        err.print(f"error: the action is {' or '.join(ACTIONS)}, not {action!r}")
        raise typer.Exit(2)
    try:
        scenario = load_scenario(scenario_file)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    if action == "check":
        summary = grid_summary(scenario)
        if as_json:
            print(json.dumps(summary))
        else:
            Console().print(" ".join(f"{k}={v}" for k, v in summary.items()))
        return
    out = (out or Path("experiment-results") / scenario.name).resolve()
    result = run(scenario, out, precision, threads)
    if as_json:
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
        return
    console = Console()
    console.print(results_table(f"{scenario.name} ({result['date']}, {result['cpu']}, "
                                f"commit {result['commit']})", result["rows"]))
    console.print(ratios_table({k: result[k] for k in (
        "best_over_plain", "top1_over_full", "topk_over_full", "fp16_over_full",
        "tbf_over_ours", "lookup_over_plain", "streams_over_one", "auto_k_over_best_fixed",
        "best_k",
        "best_configuration")}))
    console.print(f"results: {result['csv']}; figures: {', '.join(result['plots']) or 'none'}")
