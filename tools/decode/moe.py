"""Mixture of experts: does a decode step read only the experts its token was routed to?

Three random models of Qwen3-30B-A3B's layer shape (tools.moe.models, the models of `zctl
bench moe`), exported INT4 in one stage each and run in this process: 128 experts, 256 experts (the same 8
active), and a dense model with as many MLP weights as the 128-expert one (an MLP 128 x 768
wide). If a step computed every expert, doubling the experts would double the experts'
share of its time; computing only the routed ones, it costs about the same. The dense
model shows what reading every weight costs. Printed: each model's INT4 size, its median
decode step (one token after a 16-token prompt) and 128-token prefill, and the ratios of
each run's figures (the three models interleaved run by run, the median reported: the
machine's noise hits them alike).

    python -m tools.decode.moe [--layers 1] [--tokens 16] [--runs 7] [--keep DIR] [--json]
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

from tools.harness.options import Json, Precision, Runs, Tokens
from tools.harness.order import rotated
from tools.harness.stats import paired_ratio, rounded
from tools.moe.models import MOE_MODELS, moe_model

PROMPT, PREFILL = 16, 128


class _Timed:
    """One model's chain and a stream to time it on."""

    def __init__(self, export_dir: Path, precision: str) -> None:
        from dataplane.head.local_chain import LocalChain
        from dataplane.runtime.config import RuntimeSpec

        self.chain = LocalChain.load(str(export_dir), RuntimeSpec(
            precision=None if precision == "default" else precision))
        self.chain.open(0)
        self.int4_mb = sum(p.stat().st_size for p in export_dir.glob("*.bin")) / 2**20

    def prefill_ms(self, ids: np.ndarray) -> float:
        self.chain.reset(0)
        started = time.perf_counter()
        self.chain.step(0, ids[:PREFILL], np.arange(PREFILL))
        took = 1000 * (time.perf_counter() - started)
        self.chain.reset(0)
        return took

    def decode_ms(self, ids: np.ndarray, tokens: int) -> float:
        """The median step of ``tokens`` one-token steps after a PROMPT-token prompt."""
        self.chain.reset(0)
        self.chain.step(0, ids[:PROMPT], np.arange(PROMPT))
        steps = []
        for position in range(PROMPT, PROMPT + tokens):
            started = time.perf_counter()
            self.chain.step(0, ids[position:position + 1], np.array([position]))
            steps.append(1000 * (time.perf_counter() - started))
        self.chain.reset(0)
        return statistics.median(steps)


def main(layers: Annotated[int, typer.Option(help="decoder layers of each model")] = 1,
         tokens: Tokens = 16, runs: Runs = 7, precision: Precision = "default",
         as_json: Json = False,
         keep: Annotated[Path | None, typer.Option(help="keep the models and exports here")]
         = None) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = keep or Path(scratch)  # the checkpoints and their exports' cache
        timed = {name: _Timed(moe_model(name, layers, root).export(1, "int4"), precision)
                 for name in MOE_MODELS}
        ids = np.random.default_rng(0).integers(4, 384, PREFILL + PROMPT + tokens)
        for model in timed.values():  # warm every shape up once: not counted
            model.prefill_ms(ids)
            model.decode_ms(ids, 2)
        decode: dict[str, list[float]] = {name: [] for name in timed}
        prefill: dict[str, list[float]] = {name: [] for name in timed}
        names = list(timed)
        for run in range(runs):  # interleaved, the order turning: noise hits all alike
            for name in rotated(names, run):
                decode[name].append(timed[name].decode_ms(ids, tokens))
                prefill[name].append(timed[name].prefill_ms(ids))
        results = {name: {"int4_mb": round(timed[name].int4_mb),
                          "decode_ms": round(statistics.median(decode[name]), 2),
                          "prefill_ms": round(statistics.median(prefill[name]), 1)}
                   for name in names}
    ratios = {name: rounded(paired_ratio(values, bases)) for name, values, bases in (
        ("decode 256 / 128 experts", decode["experts-256"], decode["experts-128"]),
        ("decode dense-equal / 128 experts", decode["dense-equal"], decode["experts-128"]),
        ("prefill 256 / 128 experts", prefill["experts-256"], prefill["experts-128"]),
        ("prefill dense-equal / 128 experts", prefill["dense-equal"], prefill["experts-128"]),
    )}
    if as_json:
        print(json.dumps({"layers": layers, "runs": runs, "models": results, "ratios": ratios}))
        return
    for name, figures in results.items():
        print(f"{name:12s} INT4 {figures['int4_mb']:5d} MB   decode {figures['decode_ms']:7.2f} ms"
              f"   prefill {PREFILL} tokens {figures['prefill_ms']:8.1f} ms")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f} (median of {runs} interleaved runs)")


if __name__ == "__main__":
    typer.run(main)
