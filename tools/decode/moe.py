"""Mixture of experts: does a decode step read only the experts its token was routed to?

Three random models of Qwen3-30B-A3B's layer shape (tools/harness/random_moe.py), exported
INT4 in one stage each and run in this process: 128 experts, 256 experts (the same 8
active), and a dense model with as many MLP weights as the 128-expert one (an MLP 128 x 768
wide). If a step computed every expert, doubling the experts would double the experts'
share of its time; computing only the routed ones, it costs about the same. The dense
model shows what reading every weight costs. Printed: each model's INT4 size, its median
decode step (one token after a 16-token prompt) and 128-token prefill (after one to
warm up), and the ratios.

    python -m tools.decode.moe [--layers 1] [--tokens 48] [--json]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from tools.harness.options import Json, Precision, Tokens

MODELS = {"experts-128": dict(experts=128), "experts-256": dict(experts=256),
          "dense-equal": dict(experts=128, dense=True)}
PROMPT, PREFILL = 16, 128


def _time_model(export_dir: Path, tokens: int, precision: str) -> dict[str, float]:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec

    chain = LocalChain.load(str(export_dir), RuntimeSpec(
        precision=None if precision == "default" else precision))
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 384, PREFILL + PROMPT + tokens).astype(np.int64)
    chain.open(0)
    prefills = []
    for _ in range(4):  # the first one warms the plugin up for this shape: not counted
        chain.reset(0)
        started = time.perf_counter()
        chain.step(0, ids[:PREFILL], np.arange(PREFILL))
        prefills.append(1000 * (time.perf_counter() - started))
    prefill_ms = statistics.median(prefills[1:])
    chain.reset(0)
    chain.step(0, ids[:PROMPT], np.arange(PROMPT))
    steps = []
    for position in range(PROMPT, PROMPT + tokens):  # each token a step of its own
        started = time.perf_counter()
        chain.step(0, ids[position:position + 1], np.array([position]))
        steps.append(1000 * (time.perf_counter() - started))
    chain.reset(0)
    return {"decode_ms": statistics.median(steps[2:]), "prefill_ms": prefill_ms}


def main(layers: Annotated[int, typer.Option(help="decoder layers of each model")] = 1,
         tokens: Tokens = 48, precision: Precision = "default", as_json: Json = False,
         keep: Annotated[Path | None, typer.Option(help="keep the models and exports here")]
         = None) -> None:
    from exporter.export import export_model
    from exporter.sources import open_source
    from tools.harness.random_moe import write_random_moe

    with tempfile.TemporaryDirectory(dir=keep) as scratch:
        root = keep or Path(scratch)
        results: dict[str, dict[str, float]] = {}
        for name, shape in MODELS.items():
            model_dir = root / name / "model"
            export_dir = root / name / "int4"
            if not (export_dir / "manifest.json").is_file():
                write_random_moe(model_dir, layers=layers, **shape)
                export_model(open_source(str(model_dir)), [(0, layers)], "int4", export_dir,
                             force=True)
            size = sum(p.stat().st_size for p in export_dir.glob("*.bin"))
            results[name] = {"int4_mb": size / 2**20,
                             **_time_model(export_dir, tokens, precision)}
    ratios = {
        "decode 256 / 128 experts": results["experts-256"]["decode_ms"]
        / results["experts-128"]["decode_ms"],
        "decode dense-equal / 128 experts": results["dense-equal"]["decode_ms"]
        / results["experts-128"]["decode_ms"],
        "prefill 256 / 128 experts": results["experts-256"]["prefill_ms"]
        / results["experts-128"]["prefill_ms"],
    }
    if as_json:
        print(json.dumps({"layers": layers, "models": results, "ratios": ratios}))
        return
    for name, figures in results.items():
        print(f"{name:12s} INT4 {figures['int4_mb']:7.0f} MB   decode {figures['decode_ms']:7.2f} ms"
              f"   prefill {PREFILL} tokens {figures['prefill_ms']:8.1f} ms")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}")


if __name__ == "__main__":
    typer.run(main)
