"""The benchmarks' command lines: the Typer options that recur (each benchmark gives its own
default) and the refusals of bad values (Typer prints the usage and the reason, exit 2)."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import typer

MODEL_HELP = "smollm2-135m, gemma3-270m, random-1b, random-tiny, or an HF directory"

Model = Annotated[str, typer.Option(help=MODEL_HELP)]
Weights = Annotated[str, typer.Option(help="int4 | int8 | fp16 | fp32")]
Precision = Annotated[str, typer.Option(
    help="INFERENCE_PRECISION_HINT (on both sides where a baseline runs), or 'default'")]
Threads = Annotated[int, typer.Option(
    help="INFERENCE_NUM_THREADS per stage (and baseline) (0: the plugin's default)")]
Tokens = Annotated[int, typer.Option(help="new tokens per run")]
Runs = Annotated[int, typer.Option(help="interleaved runs (the median is reported)")]
Nodes = Annotated[int, typer.Option(help="cluster nodes (= stages)")]
CpuSets = Annotated[str, typer.Option(
    help="shared: every stage may use every core | split: each node its own cores (as "
         "separate PCs)")]
Json = Annotated[bool, typer.Option("--json", help="print one JSON object")]


def fail(message: str) -> NoReturn:
    """Refuse a benchmark's options: Typer prints the usage and ``message``, exit 2."""
    raise typer.BadParameter(message)


def parse_k(value: str) -> int | None:
    """'auto' -> None, else a non-negative int."""
    if value.strip().lower() == "auto":
        return None
    k = int(value)
    if k < 0:
        fail(f"K must be >= 0 or 'auto', got {value}")
    return k


def parse_numbers(text: str, option: str, what: str, kind: type = int,
                  minimum: float = 1) -> list[Any]:
    """Comma-separated numbers of ``kind``, at least one and none below ``minimum``;
    ``option`` and ``what`` name them in the refusal."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{option} takes comma-separated {what}, got {text!r}")
    if not values or min(values) < minimum:
        fail(f"{option} needs {what} >= {minimum:g}, got {text!r}")
    return values
