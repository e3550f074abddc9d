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

    python -m tools.bench_static [--model smollm2-135m] [--contexts 256,1024] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from common.manifest import StaticKV
from dataplane.local_chain import LocalChain
from dataplane.runtime import RuntimeConfig
from engine.tokenizer import ChatTokenizer
from tools.bench_common import PROMPT, cached_export, export_name, model_hf_dir, paired_step_ms

err = Console(stderr=True)


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
    try:
        contexts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"--contexts takes comma-separated slot counts, got {text!r}") from None
    if not contexts or min(contexts) < 1:
        raise typer.BadParameter(f"--contexts needs positive slot counts, got {text!r}")
    return contexts


def main(
    model: str = typer.Option("smollm2-135m", help="smollm2-135m, random-1b, or an HF directory"),
    weights: str = typer.Option("int4", help="int4 | int8 | fp16 | fp32"),
    stages: int = typer.Option(2, help="stages of every chain"),
    contexts: str = typer.Option("256,1024", help="static KV slots per stream, comma-separated"),
    chunk: int = typer.Option(16, help="the static exports' multi-token step shape"),
    tokens: int = typer.Option(128, help="decode steps per system (token by token, rotating)"),
    device: str = typer.Option("CPU", help="device for every chain"),
    f16: bool = typer.Option(True, help="also the largest context with an f16 host KV"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    from common.paths import zctl_home

    sizes = parse_contexts(contexts)
    cache = zctl_home()
    hf_dir = model_hf_dir(model, cache)
    name = export_name(model, hf_dir)
    exports = {"stateful": cached_export(hf_dir, name, stages, weights, True, cache)}
    for size in sizes:
        exports[f"static{size}"] = cached_export(hf_dir, name, stages, weights, True, cache,
                                                 static_kv=StaticKV(size, min(chunk, size)))
    if f16:
        size = max(sizes)
        exports[f"static{size}_f16"] = cached_export(
            hf_dir, name, stages, weights, True, cache,
            static_kv=StaticKV(size, min(chunk, size), "f16"))
    prompt_ids = ChatTokenizer(exports["stateful"]).encode(PROMPT)
    too_long = [s for s in sizes if len(prompt_ids) + tokens + 1 > s]
    if too_long:
        raise typer.BadParameter(f"contexts {too_long} hold fewer than the prompt's "
                                 f"{len(prompt_ids)} tokens + {tokens} decode steps")
    config = RuntimeConfig(device=device)
    chains = {key: LocalChain.load(str(path), config) for key, path in exports.items()}
    step_ms = paired_step_ms(chains, prompt_ids, tokens)
    prefill = {key: prefill_ms(chain, prompt_ids) for key, chain in chains.items()}
    base = step_ms["stateful"]
    result: dict[str, Any] = {
        "model": model, "weights": weights, "stages": stages, "device": device, "chunk": chunk,
        "tokens": tokens, "prompt_tokens": len(prompt_ids),
        "step_ms": {key: round(v, 3) for key, v in step_ms.items()},
        "tok_s": {key: round(1e3 / v, 2) for key, v in step_ms.items()},
        **{f"{key}_ratio": round(base / v, 3) for key, v in step_ms.items() if key != "stateful"},
        "prefill_ms": {key: round(v, 2) for key, v in prefill.items()},
    }
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"static vs stateful, {model} {weights}, {stages} stages, {device}")
    for column in ("system", "decode ms/token", "tok/s", "vs stateful", "prefill ms"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for key, value in step_ms.items():
        table.add_row(key, f"{value:.2f}", f"{1e3 / value:.1f}", f"{base / value:.3f}x",
                      f"{prefill[key]:.1f}")
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
