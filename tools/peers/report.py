"""The comparison's arithmetic and its printing: each figure's ratio, zctl's over
llama.cpp's as the median of the rounds' paired ratios (above 1: zctl better; latencies
inverted so that above 1 still means zctl better), the targets (the greedy check's among
them), and the Rich tables.
Pure functions except ``render``."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tools.harness.stats import paired_ratio, rounded

ZCTL, LLAMA = "zctl", "llama.cpp"
# The figures a ratio is taken of, and whether higher is better.
RATIO_FIGURES = {"decode_tok_s": True, "ttft_ms": False, "tok_s": True, "ttft_ms_p50": False,
                 "ttft_ms_p99": False, "itl_ms_p50": False, "itl_ms_p99": False}
ONE_NODE_TARGETS = {"smollm2-135m": 0.9}  # else 1.0 (the 1B shape's)
ONE_STREAM_TARGET = 1.0
AGGREGATE_TARGET = 1.2
AGGREGATE_CLIENTS = (8, 16)
GREEDY_TARGET = 1.0  # every greedy token at f32 the same, before speed is compared


def flat(figures: Mapping[str, Any]) -> dict[str, float]:
    """A measurement's figures with percentiles flattened (ttft_ms: {p50, p99} ->
    ttft_ms_p50, ttft_ms_p99), numbers only."""
    out: dict[str, float] = {}
    for key, value in figures.items():
        if isinstance(value, Mapping):
            out.update({f"{key}_{k}": v for k, v in value.items() if isinstance(v, int | float)})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    return out


def figure_ratio(zctl: Sequence[Mapping[str, Any]], llama: Sequence[Mapping[str, Any]],
                 figure: str) -> float | None:
    """zctl's ``figure`` over llama.cpp's, paired round by round (``paired_ratio``, not
    rounded), inverted for a latency; the rounds where either lacks a positive figure
    are left out, and None without a single such pair."""
    pairs = [(a, b) for z, ll in zip(zctl, llama, strict=False)
             if (a := flat(z).get(figure)) and (b := flat(ll).get(figure)) and a > 0 and b > 0]
    ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
    return paired_ratio(ours, theirs) if RATIO_FIGURES[figure] else paired_ratio(theirs, ours)


def case_ratios(record: Mapping[str, Any]) -> dict[str, float | None]:
    """Every figure's ratio in a case's record (tools.peers.cases.CaseResult.record), keyed
    ``case/measurement/figure``."""
    figures = record["figures"]
    zctl, llama = figures.get(ZCTL, {}), figures.get(LLAMA, {})
    out: dict[str, float | None] = {}
    for measurement in sorted(set(zctl) | set(llama)):
        names = {f for rounds in (zctl.get(measurement, []), llama.get(measurement, []))
                 for r in rounds for f in flat(r)} & set(RATIO_FIGURES)
        for figure in sorted(names):
            out[f"{record['case']}/{measurement}/{figure}"] = figure_ratio(
                zctl.get(measurement, []), llama.get(measurement, []), figure)
    return out


def target(value: float | None, goal: float, figure: str) -> dict[str, Any]:
    """A target as reported: met judged on the ratio itself, the value to 3 places."""
    return {"value": rounded(value), "target": goal,
            "met": value is not None and value >= goal, "figure": figure}


def targets(records: Sequence[Mapping[str, Any]], ratios: Mapping[str, float | None],
            prompts: Sequence[int]) -> dict[str, dict[str, Any]]:
    """The issue's targets over the cases run: one node (decode, each prompt length) at
    >= 0.9x on SmolLM2 and >= 1.0x otherwise; one stream on more nodes (decode) >= 1.0x;
    aggregate tok/s at 8 and 16 clients on more nodes >= 1.2x."""
    out: dict[str, dict[str, Any]] = {}
    for record in records:
        case, nodes = record["case"], record["nodes"]
        model = case.split("/")[0]
        for length in prompts:
            figure = f"{case}/one_stream.p{length}/decode_tok_s"
            if nodes == 1:
                goal = ONE_NODE_TARGETS.get(model, 1.0)
                out[f"one_node/{case}/p{length}"] = target(ratios.get(figure), goal, figure)
            else:
                out[f"one_stream/{case}/p{length}"] = target(ratios.get(figure),
                                                             ONE_STREAM_TARGET, figure)
        if nodes > 1:
            for clients in AGGREGATE_CLIENTS:
                figure = f"{case}/serve.c{clients}/tok_s"
                if figure in ratios or any(f"serve.c{clients}" in s
                                           for s in record["figures"].values()):
                    out[f"aggregate/{case}/c{clients}"] = target(ratios.get(figure),
                                                                 AGGREGATE_TARGET, figure)
    return out


def unmeasured_targets(not_measured: Mapping[str, str],
                       prompts: Sequence[int]) -> dict[str, dict[str, Any]]:
    """The targets of the cases this machine cannot measure (``not_measured``: case key ->
    why; more nodes with a core each than it has cores): one stream at each prompt length
    and the aggregate at 8 and 16 clients, each without a value, unmet, with the reason."""
    out: dict[str, dict[str, Any]] = {}
    for case, why in not_measured.items():
        for length in prompts:
            figure = f"{case}/one_stream.p{length}/decode_tok_s"
            out[f"one_stream/{case}/p{length}"] = {
                **target(None, ONE_STREAM_TARGET, figure), "not_measured": why}
        for clients in AGGREGATE_CLIENTS:
            figure = f"{case}/serve.c{clients}/tok_s"
            out[f"aggregate/{case}/c{clients}"] = {
                **target(None, AGGREGATE_TARGET, figure), "not_measured": why}
    return out


def greedy_targets(checks: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The check before speed, per model (``checks``: tools.peers.greedy.agreement's
    record, or the check's failure, or why it did not run): the share of zctl's greedy
    tokens llama.cpp's matched, in order, met only when every token did and as many came
    (``match``); None and unmet when the check failed or did not run."""
    out: dict[str, dict[str, Any]] = {}
    for model, check in checks.items():
        value = check["matched"] / check["tokens"] if check.get("tokens") else None
        figure = f"greedy/{model}: matched / tokens"
        out[f"greedy/{model}"] = {**target(value, GREEDY_TARGET, figure),
                                  "met": check.get("match") is True}
    return out


def median_figure(rounds: Sequence[Mapping[str, Any]], figure: str) -> float | None:
    values = [v for r in rounds if (v := flat(r).get(figure)) is not None]
    return round(statistics.median(values), 2) if values else None


def _fmt(value: float | None, ratio: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}x" if ratio else f"{value:.1f}"


def _failure(console: Console, what: str, failure: Mapping[str, str]) -> None:
    console.print(f"[red]{escape(what)} failed:[/] {escape(failure['error'])}", highlight=False)
    if failure.get("log_tail"):
        console.print(escape(failure["log_tail"]), highlight=False)


def render(result: Mapping[str, Any], console: Console) -> None:
    """The run as Rich tables: where and what, the delay check, each case's figures and
    ratios, the targets, and any failure with its log's tail."""
    run = result["run"]
    console.print(f"[bold]zctl bench peers[/]: {run['date']}, {run['cpu']} ({run['cpus']} CPUs), "
                  f"commit {run['commit']}", highlight=False)
    build = result["llama_cpp"]
    console.print(f"llama.cpp: {escape(str(build.get('binaries', '')))} "
                  f"({escape(str(build.get('version', '')))})", highlight=False)
    if plan := build.get("build"):
        console.print(f"  pin {plan['pin']['project']} {plan['pin']['version']} "
                      f"(sha256 {plan['pin']['sha256'][:16]}...)", highlight=False)
        for option, why in plan["reasons"].items():
            console.print(f"  {option}: {escape(why)}", highlight=False)
    for pairing in result.get("ggufs", []):
        console.print(f"  {pairing['model']} zctl {pairing['weights']} vs {pairing['type']} "
                      f"({escape(pairing['made_by'])})", highlight=False)
    for check in result.get("delay_check", []):
        if "error" in check:
            _failure(console, f"per-hop delay check at {check['delay_ms']:g} ms", check)
        else:
            console.print(f"per-hop delay check: {escape(str(check))}", highlight=False)
    for key, greedy in result.get("greedy", {}).items():
        if "error" in greedy:
            _failure(console, f"greedy check {key}", greedy)
        else:
            console.print(f"greedy check {key}: {escape(str(greedy))}", highlight=False)
    for record in result["cases"]:
        table = Table(title=record["case"])
        for column in ("measurement", "figure", ZCTL, LLAMA, "zctl / llama.cpp"):
            table.add_column(column, justify="left" if column in ("measurement", "figure")
                             else "right")
        figures = record["figures"]
        for measurement in sorted(set(figures.get(ZCTL, {})) | set(figures.get(LLAMA, {}))):
            z, ll = figures.get(ZCTL, {}).get(measurement, []), figures.get(LLAMA, {}).get(
                measurement, [])
            for figure in (*RATIO_FIGURES, "errors"):
                if median_figure(z, figure) is None and median_figure(ll, figure) is None:
                    continue
                ratio = result["ratios"].get(f"{record['case']}/{measurement}/{figure}")
                table.add_row(measurement, figure, _fmt(median_figure(z, figure)),
                              _fmt(median_figure(ll, figure)), _fmt(ratio, ratio=True))
        console.print(table)
        if "load_average" in record:
            console.print(f"  load average (1 min) before and after: {record['load_average']}",
                          highlight=False)
            if max(record["load_average"]) > run["cpus"]:
                console.print(f"  [yellow]the machine ran more than {run['cpus']} runnable "
                              "threads: figures of processes with a thread per core are "
                              "not those of a quiet PC[/]", highlight=False)
        if bench := record.get("llama_bench"):
            console.print(f"  llama-bench (reference, in no ratio): {escape(str(bench))}",
                          highlight=False)
        for line in record.get("placement", {}).get(LLAMA, []):
            console.print(f"  placement: {escape(line)}", highlight=False)
        for system, failure in record["failures"].items():
            _failure(console, f"  {system}", failure)
    table = Table(title="targets")
    for column in ("target", "value", "goal", "met"):
        table.add_column(column)
    for key, t in result["targets"].items():
        table.add_row(key, _fmt(t["value"], ratio=True), f">= {t['target']}x",
                      "[green]yes[/]" if t["met"] else "[red]no[/]")
    console.print(table)
    for key, why in result.get("not_measured", {}).items():
        console.print(f"not measured: {key}: {escape(why)}", highlight=False)
