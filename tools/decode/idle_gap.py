"""What an idle gap costs a stage's next step, against running back to back.

A pipeline stage sits idle while the other stages compute, so each of its steps starts
after a gap of the other stages' compute plus the hops; a monolithic model runs its layers
back to back. Where a machine loses its warm state within a few ms of idling (caches,
TLB, threads gone to sleep; VMs notably), every pipeline step pays for it and the
monolithic model does not. This tool measures that in one process, the modes rotated
step by step so the machine's drift hits them alike:

- the stages of an export stepped as a chain (greedy decode), each stage's step run back
  to back with the previous one, after a ``--gap-ms`` sleep, or after a busy spin of the
  same length on the calling thread;
- with ``--ops``, the chain again with the plugin's per-op counters (PERF_COUNT): the sum
  of each stage's op times per mode, which splits the gap's cost into op time and the
  time around the ops (waking the plugin's threads, shape and memory updates, returning);
- a one-MatMul model's whole ``start_async()`` + ``wait()``: the bare dispatch cost.

    python -m tools.decode.idle_gap [--model smollm2-135m] [--stages 2] [--gap-ms 12] [--ops] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from dataplane.runtime.config import RuntimeSpec
from tools.harness.greedy import start_stream
from tools.harness.options import Json, Model, Precision, Weights

MODES = ("back_to_back", "sleep", "spin")


@dataclass(frozen=True)
class CountingConfig(RuntimeSpec):
    """The runtime's properties plus the plugin's per-op counters (PERF_COUNT)."""

    def properties(self, int4_group: int | None = None) -> dict[str, Any]:
        return {**super().properties(int4_group), "PERF_COUNT": True}


def idle(mode: str, gap_s: float) -> None:
    """Spend ``gap_s`` the way ``mode`` says: nothing, asleep, or spinning on this thread."""
    if mode == "sleep":
        time.sleep(gap_s)
    elif mode == "spin":
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
    elif mode != "back_to_back":
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")


def mode_of(step: int) -> str:
    """The modes in rotation, one per decode step."""
    return MODES[step % len(MODES)]


def summarise(samples: dict[str, list[list[float]]], skip: int = 1) -> dict[str, Any]:
    """Per-mode, per-stage medians of ``samples[mode][stage]`` (ms; the first ``skip`` of
    each dropped), each mode's extra ms per step summed over the stages against back to
    back, and back to back's share of that mode's time (``ratio``: below 1, the gap costs)."""
    p50 = {mode: [statistics.median(s[skip:] or s) for s in per_stage]
           for mode, per_stage in samples.items()}
    base = sum(p50["back_to_back"])
    return {
        "p50_ms": {mode: [round(v, 3) for v in values] for mode, values in p50.items()},
        "extra_ms_per_step": {mode: round(sum(values) - base, 3)
                              for mode, values in p50.items() if mode != "back_to_back"},
        "ratio": {mode: round(base / sum(values), 3) if sum(values) else 0.0
                  for mode, values in p50.items() if mode != "back_to_back"},
    }


@dataclass
class ChainSamples:
    """Per mode, per stage: each step's wall ms and (when counted) the sum of its op ms;
    and the greedy tokens the steps produced."""

    wall: dict[str, list[list[float]]]
    ops: dict[str, list[list[float]]]
    tokens: list[int]


def op_ms(request: Any) -> float:
    """The sum of the last inference's per-op real times (PERF_COUNT must be on)."""
    return sum(info.real_time.total_seconds() for info in request.profiling_info) * 1e3


def step_chain(chain: Any, prompt_ids: Sequence[int], tokens: int, gap_s: float,
               count_ops: bool = False, stream_id: int = 1) -> ChainSamples:
    """Greedy-decode ``tokens`` steps through ``chain`` (a dataplane.head.local_chain.LocalChain),
    each step in the next mode of the rotation, that mode's idle time spent before every
    stage's inference."""
    from zctl.engine.executor import reply_from_logits

    stages = chain.runners
    wall: dict[str, list[list[float]]] = {m: [[] for _ in stages] for m in MODES}
    ops: dict[str, list[list[float]]] = {m: [[] for _ in stages] for m in MODES}
    token, position = start_stream(chain, stream_id, prompt_ids)
    produced = [token]
    for step in range(tokens):
        mode = mode_of(step)
        positions = np.array([[position]], dtype=np.int64)
        out: Any = np.array([[token]], dtype=np.int64)
        for i, runner in enumerate(stages):
            inputs = runner.prepare(stream_id, positions, None)
            idle(mode, gap_s)
            start = time.perf_counter()
            out = runner.run(stream_id, out, inputs)
            wall[mode][i].append((time.perf_counter() - start) * 1e3)
            if count_ops:
                ops[mode][i].append(op_ms(runner.streams[stream_id].request))
        token, position = int(reply_from_logits(out.data).tokens[-1]), position + 1
        produced.append(token)
    return ChainSamples(wall, ops if count_ops else {}, produced)


def dispatch_us(gap_s: float, reps: int = 200, width: int = 64,
                make: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median µs of one start_async()+wait() of a one-MatMul model ([1, 576] x [576,
    ``width``], f32) per mode, the modes rotated call by call."""
    request = (make or (lambda: _matmul_request(width)))()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(reps):
        mode = mode_of(rep)
        idle(mode, gap_s)
        start = time.perf_counter()
        request.start_async()
        request.wait()
        times[mode].append((time.perf_counter() - start) * 1e6)
    return {m: round(statistics.median(v[2:] or v), 1) for m, v in times.items()}


def _matmul_request(width: int) -> Any:
    import openvino as ov
    from openvino import opset13 as ops

    from dataplane.runtime.ov_core import shared_core

    x = ops.parameter([1, 576], ov.Type.f32)
    weights = ops.constant(np.random.default_rng(0).random((576, width), dtype=np.float32))
    model = ov.Model([ops.matmul(x, weights, False, False)], [x])
    compiled = shared_core().compile_model(model, "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                          "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    request.set_input_tensor(ov.Tensor(np.ones((1, 576), np.float32)))
    return request


def run(export_dir: str, prompt_ids: Sequence[int], tokens: int, gap_ms: float,
        count_ops: bool, precision: str = "f32", threads: int = 0) -> dict[str, Any]:
    """Every measurement of the tool on one export, as one JSON-ready dict."""
    from dataplane.head.local_chain import LocalChain

    gap_s = gap_ms / 1e3
    config = RuntimeSpec(precision=None if precision == "default" else precision,
                         num_threads=threads or None)
    chain = LocalChain.load(export_dir, config)
    result: dict[str, Any] = {"export": export_dir, "stages": len(chain.runners),
                              "tokens": tokens, "gap_ms": gap_ms, "modes": list(MODES)}
    result["step"] = summarise(step_chain(chain, prompt_ids, tokens, gap_s).wall)
    if count_ops:
        counted = CountingConfig(precision=config.precision, num_threads=config.num_threads)
        samples = step_chain(LocalChain.load(export_dir, counted), prompt_ids, tokens, gap_s,
                             count_ops=True)
        result["counted_step"] = summarise(samples.wall)
        result["ops"] = summarise(samples.ops)
    result["dispatch_us"] = dispatch_us(gap_s)
    return result


def main(
    model: Model = "smollm2-135m",
    stages: Annotated[int, typer.Option(help="stages of the export stepped as a chain")] = 2,
    weights: Weights = "int4",
    tokens: Annotated[int, typer.Option(help="decode steps (rotated over the three modes)")] = 120,
    gap_ms: Annotated[float, typer.Option(
        help="idle time before each stage's step (about the other stages' compute in a "
             "pipeline)")] = 12.0,
    ops: Annotated[bool, typer.Option(
        "--ops", help="also split the cost into op time and the rest (a second chain with "
                      "PERF_COUNT)")] = False,
    precision: Precision = "f32",
    threads: Annotated[int, typer.Option(help="INFERENCE_NUM_THREADS (0: the plugin's)")] = 0,
    as_json: Json = False,
) -> None:
    from tools.harness.models import PROMPT, model_export
    from zctl.engine.tokenizer import ChatTokenizer

    export_dir = model_export(model, stages, weights)
    result = run(str(export_dir), ChatTokenizer(export_dir).encode(PROMPT), tokens, gap_ms, ops,
                 precision, threads)
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"idle gap of {gap_ms:g} ms before each step, {model} in {stages} stages")
    table.add_column("measure")
    for mode in MODES:
        table.add_column(mode, justify="right")
    for key, label in (("step", "stage step ms (p50 per stage)"),
                       ("counted_step", "with PERF_COUNT"), ("ops", "sum of op ms")):
        if key in result:
            p50 = result[key]["p50_ms"]
            table.add_row(label, *(" / ".join(f"{v:.2f}" for v in p50[m]) for m in MODES))
            table.add_row("  extra ms per step", "",
                          *(f"{result[key]['extra_ms_per_step'][m]:+.2f}" for m in MODES[1:]))
    table.add_row("one-MatMul dispatch us", *(f"{result['dispatch_us'][m]:.0f}" for m in MODES))
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
