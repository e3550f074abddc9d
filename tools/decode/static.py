"""The static NPU path's cost: static, stateless shards (KV on the host) against the stateful ones.

Same model, weights and layer split; the static exports at each ``--contexts`` size
(KV slots per stream; every decode step attends over all of them, masked, and reads
them from the host buffers). Measured in one process on this machine's device (CPU
here: no NPU), the chains stepped token by token in rotating order (``paired_step_ms``)
so the machine's drift hits every system alike; ``static{C}_ratio`` is stateful step
time over static step time (tok/s ratio), and ``prefill_ms`` times one prompt's
prefill per system (static: chunk by chunk). The paper reports its NPU path about 4x
slower than the iGPU for one stream: this tool shows how much of that is the static
formulation itself. ``static{C}_f16``: the largest context with an f16 host KV (``--f16``).

    python -m tools.decode.static [--model smollm2-135m] [--contexts 256,1024] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tools.harness.greedy import paired_step_ms
from tools.harness.models import PROMPT, BenchModel
from tools.harness.options import Json, Model, Weights, fail, parse_numbers
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import StaticKV


def prefill_ms(chain: LocalChain, prompt_ids: list[int], repeats: int = 3,
               stream: int = 9) -> float:
    """Median ms of a whole-prompt prefill (a fresh stream each time)."""
    times = []
    for _ in range(repeats):
        chain.open(stream)
        chain.reset(stream)
        start = time.perf_counter()
        chain.step(stream, np.asarray(prompt_ids), np.arange(len(prompt_ids)))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def parse_contexts(text: str) -> list[int]:
    """``--contexts``: comma-separated positive slot counts."""
    return parse_numbers(text, "--contexts", "slot counts", int, minimum=1)


def static_exports(model: BenchModel, weights: str, stages: int, sizes: list[int], chunk: int,
                   f16: bool) -> dict[str, Path]:
    """The stateful export and a static one per context size (and, ``f16``, the largest
    with an f16 host KV), all with the same split."""
    exports = {"stateful": model.export(stages, weights)}
    for size in sizes:
        exports[f"static{size}"] = model.export(stages, weights,
                                                static_kv=StaticKV(size, min(chunk, size)))
    if f16:
        size = max(sizes)
        exports[f"static{size}_f16"] = model.export(
            stages, weights, static_kv=StaticKV(size, min(chunk, size), "f16"))
    return exports


def static_table(title: str, step_ms: dict[str, float], prefill: dict[str, float]) -> Table:
    """The table printed without --json: one row per system."""
    table = Table(title=title)
    for column in ("system", "decode ms/token", "tok/s", "vs stateful", "prefill ms"):
        table.add_column(column, justify="left" if column == "system" else "right")
    base = step_ms["stateful"]
    for key, value in step_ms.items():
        table.add_row(key, f"{value:.2f}", f"{1e3 / value:.1f}", f"{base / value:.3f}x",
                      f"{prefill[key]:.1f}")
    return table


def static_figures(step_ms: dict[str, float], prefill: dict[str, float]) -> dict[str, Any]:
    """The JSON's figures: step times, tok/s, each static system against the stateful one."""
    base = step_ms["stateful"]
    return {
        "step_ms": {key: round(v, 3) for key, v in step_ms.items()},
        "tok_s": {key: round(1e3 / v, 2) for key, v in step_ms.items()},
        **{f"{key}_ratio": round(base / v, 3) for key, v in step_ms.items() if key != "stateful"},
        "prefill_ms": {key: round(v, 2) for key, v in prefill.items()},
    }


def main(
    model: Model = "smollm2-135m",
    weights: Weights = "int4",
    stages: Annotated[int, typer.Option(help="stages of every chain")] = 2,
    contexts: Annotated[str, typer.Option(
        help="static KV slots per stream, comma-separated")] = "256,1024",
    chunk: Annotated[int, typer.Option(help="the static exports' multi-token step shape")] = 16,
    tokens: Annotated[int, typer.Option(
        help="decode steps per system (token by token, rotating)")] = 128,
    device: Annotated[str, typer.Option(help="device for every chain")] = "CPU",
    f16: Annotated[bool, typer.Option(help="also the largest context with an f16 host KV")] = True,
    as_json: Json = False,
) -> None:
    sizes = parse_contexts(contexts)
    exports = static_exports(BenchModel.resolve(model), weights, stages, sizes, chunk, f16)
    prompt_ids = ChatTokenizer(exports["stateful"]).encode(PROMPT)
    too_long = [s for s in sizes if len(prompt_ids) + tokens + 1 > s]
    if too_long:
        fail(f"contexts {too_long} hold fewer than the prompt's {len(prompt_ids)} tokens + "
             f"{tokens} decode steps")
    config = RuntimeSpec(device=device)
    chains = {key: LocalChain.load(str(path), config) for key, path in exports.items()}
    step_ms = paired_step_ms(chains, prompt_ids, tokens)
    prefill = {key: prefill_ms(chain, prompt_ids) for key, chain in chains.items()}
    result: dict[str, Any] = {
        "model": model, "weights": weights, "stages": stages, "device": device, "chunk": chunk,
        "tokens": tokens, "prompt_tokens": len(prompt_ids), **static_figures(step_ms, prefill),
    }
    if as_json:
        print(json.dumps(result))
        return
    Console().print(static_table(f"static vs stateful, {model} {weights}, {stages} stages, "
                                 f"{device}", step_ms, prefill))


if __name__ == "__main__":
    typer.run(main)
