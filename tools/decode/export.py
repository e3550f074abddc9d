"""Export time and peak memory: does peak memory follow the largest stage, not the model?

Each export runs in a child process (``zctl export``) so its peak RSS is measured
cleanly (``RUSAGE_CHILDREN``). Prints a table, or one JSON object with ``--json``.

    python -m tools.decode.export --model DIR --stages 4 --weights int4
    python -m tools.decode.export --random-1b   # make the Llama-3.2-1B-shaped model first
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tools.harness.options import Json, Weights
from tools.harness.report import metric_table
from zctl.manifest import load_manifest


def stage_param_bytes(model_dir: Path, ranges: list[tuple[int, int]]) -> tuple[list[int], int]:
    """fp32 bytes of weights each stage holds (embedding/head included), and of the model."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    sizes: dict[str, int] = {}
    for name in files:
        with safe_open(model_dir / name, framework="np") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                sizes[key] = 4 * count
    embed = sizes["model.embed_tokens.weight"]
    head = sizes.get("lm_head.weight", embed)
    total = sum(sizes.values()) + (0 if "lm_head.weight" in sizes else head)
    per_stage = []
    for i, (start, end) in enumerate(ranges):
        b = sum(v for k, v in sizes.items()
                if k.startswith("model.layers.") and start <= int(k.split(".")[2]) < end)
        b += embed if i == 0 else 0
        b += head + sizes["model.norm.weight"] if i == len(ranges) - 1 else 0
        per_stage.append(b)
    return per_stage, total


def run_export(model: str, stages: int, weights: str, out: Path) -> tuple[float, float]:
    """(seconds, peak RSS MB) of one ``zctl export`` in a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "zctl", "export", model, "--stages", str(stages),
         "--weights", weights, "--out", str(out), "--force"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"export failed: {proc.stderr.strip()[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        raise RuntimeError("a previous child had a higher peak; run one export per process")
    return seconds, peak / 1024


def main(
    model: Annotated[str, typer.Option(help="model to export")] = "smollm2-135m",
    stages: Annotated[int, typer.Option(help="number of stages")] = 4,
    weights: Weights = "int4",
    random_1b: Annotated[bool, typer.Option(
        "--random-1b", help="export a random 1B-shaped Llama")] = False,
    tokenizer_from: Annotated[Path | None, typer.Option(
        help="tokenizer for the random model")] = None,
    as_json: Json = False,
) -> None:
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="zctl-bench-export-") as tmp:
        if random_1b:
            from tools.harness.random_llama import write_random_llama

            console.print("writing a random Llama-3.2-1B-shaped checkpoint ...")
            model = str(write_random_llama(Path(tmp) / "random-1b", tokenizer_from=tokenizer_from))
        seconds, peak_mb = run_export(model, stages, weights, Path(tmp) / "export")
        result: dict[str, object] = {"model": model, "stages": stages, "weights": weights,
                                     "export_s": round(seconds, 1), "peak_rss_mb": round(peak_mb)}
        if Path(model).is_dir():
            manifest = load_manifest(Path(tmp) / "export")
            ranges = [(s.layer_start, s.layer_end) for s in manifest.stages]
            per_stage, total = stage_param_bytes(Path(model), ranges)
            result.update(
                largest_stage_fp32_mb=round(max(per_stage) / 2**20),
                model_fp32_mb=round(total / 2**20),
                peak_over_largest_stage=round(peak_mb * 2**20 / max(per_stage), 2),
                peak_over_model=round(peak_mb * 2**20 / total, 2),
            )
    if as_json:
        print(json.dumps(result))
        return
    Console().print(metric_table("zctl export: time and peak memory", result))


if __name__ == "__main__":
    typer.run(main)
