"""Does one batched decode step (B streams as rows of one InferRequest) beat B 1-row steps?

Our stage graphs are stateful (KV in ReadValue/Assign behind a Gather on ``beam_idx``) and
every input has a dynamic batch axis, so one InferRequest can hold B streams as B rows:
after ``reset_state()`` the zero initialisers size every state [B, kv_heads, 0, head_dim],
``beam_idx`` is ``arange(B)``, and each row has its own positions (RoPE) and its own
attention-mask row. Rows share the physical slot count, so a row whose prompt is shorter
is left-padded and its padding slots are masked (the same mechanism as mask-based rewind).

This measures, on one compiled 1-stage shard, B separate 1-row requests stepping one
token each against one B-row request stepping one token per row, interleaved step by
step (so load drift on a shared machine hits both alike), and checks that the batched
rows produce the same greedy tokens as the separate streams (they do with
``--kv-cache-precision f32``; with the CPU plugin's default u8 KV cache the left-padded
rows of SmolLM2 drifted from their 1-row streams after 21 and 47 tokens).

    python -m tools.bench_batching [--batch 2 --batch 4] [--tokens 64] [--runs 3] [--json]

The runtime does this as *row groups* (``StageRunner.regroup``/``step_rows``,
``dataplane.runtime.kv.rows``, the scheduler's ``row_groups``): streams prefill alone, then their KV
is copied into rows of a group's request (compacted, shorter rows padded with masked
slots); this tool measures the raw cost of a B-row step on one shard.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.masks import MASK_MIN
from dataplane.runtime.rope import rope_tables
from dataplane.runtime.stateful import StageRunner
from tools.bench_common import Json, Runs, Weights, model_export

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue.",
    "List three uses of a paperclip that are not holding paper together.",
    "What is the capital of France, and what is it famous for?",
    "Describe a sunrise over the mountains in two sentences.",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Summarise the plot of Hamlet.",
)



@dataclass
class Row:
    """One stream's bookkeeping: its token so far, its logical position, its kept slots."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:
        return len(self.prompt) + len(self.tokens) - 1


def _feed(runner: StageRunner, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
          logits_idx: np.ndarray) -> dict[str, np.ndarray]:
    cos, sin = rope_tables(positions, runner.inv_freq, runner.rope_scaling)
    return {"input_ids": ids, "attention_mask": mask, "rope_cos": cos, "rope_sin": sin,
            "logits_idx": logits_idx, "beam_idx": np.arange(ids.shape[0], dtype=np.int32)}


def _run(request: Any, feed: dict[str, np.ndarray]) -> np.ndarray:
    request.start_async(feed, share_inputs=True)
    request.wait()
    return request.get_output_tensor(0).data


def prefill_mask(lengths: list[int]) -> np.ndarray:
    """[B, 1, P, P] for left-padded prompts: causal over each row's real tokens; a padding
    slot is seen by nobody but itself (so no row of softmax is empty)."""
    width = max(lengths)
    causal = np.tril(np.ones((width, width), dtype=bool))
    masks = []
    for n in lengths:
        real = np.arange(width) >= width - n
        see = causal & real[None, :]
        see |= np.eye(width, dtype=bool) & ~real[:, None]
        masks.append(np.where(see, np.float32(0), MASK_MIN))
    return np.stack(masks)[:, None].astype(np.float32)


class Separate:
    """B streams, one 1-row InferRequest each (what the runtime does today)."""

    def __init__(self, runner: StageRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.requests = [runner.compiled.create_infer_request() for _ in prompts]
        self.rows = [Row(p) for p in prompts]

    def prefill(self) -> None:
        for req, row in zip(self.requests, self.rows, strict=True):
            req.reset_state()
            n = len(row.prompt)
            mask = prefill_mask([n])
            out = _run(req, _feed(self.runner, np.asarray([row.prompt], np.int64),
                                  np.arange(n)[None], mask, np.array([n - 1])))
            row.tokens = [int(out[0, -1].argmax())]

    def step(self) -> None:
        for req, row in zip(self.requests, self.rows, strict=True):
            slots = len(row.prompt) + len(row.tokens) - 1
            mask = np.zeros((1, 1, 1, slots + 1), np.float32)
            out = _run(req, _feed(self.runner, np.array([[row.tokens[-1]]], np.int64),
                                  np.array([[row.position]]), mask, np.array([0])))
            row.tokens.append(int(out[0, -1].argmax()))


class Batched:
    """B streams as the rows of one InferRequest; shorter prompts are left-padded (masked)."""

    def __init__(self, runner: StageRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.request = runner.compiled.create_infer_request()
        self.rows = [Row(p) for p in prompts]
        width = max(len(p) for p in prompts)
        # keep[b, slot]: False for row b's padding slots (and, in general, rewound slots)
        self.keep = np.stack([np.arange(width) >= width - len(p) for p in prompts])

    def prefill(self) -> None:
        self.request.reset_state()
        lengths = [len(r.prompt) for r in self.rows]
        width = max(lengths)
        ids = np.zeros((len(self.rows), width), np.int64)
        positions = np.zeros((len(self.rows), width), np.int64)
        for b, row in enumerate(self.rows):
            ids[b, width - len(row.prompt):] = row.prompt
            positions[b, width - len(row.prompt):] = np.arange(len(row.prompt))
        out = _run(self.request, _feed(self.runner, ids, positions, prefill_mask(lengths),
                                       np.array([width - 1])))
        for b, row in enumerate(self.rows):
            row.tokens = [int(out[b, -1].argmax())]

    def step(self) -> None:
        rows = len(self.rows)
        self.keep = np.concatenate((self.keep, np.ones((rows, 1), bool)), axis=1)
        mask = np.where(self.keep, np.float32(0), MASK_MIN).astype(np.float32)[:, None, None, :]
        ids = np.array([[r.tokens[-1]] for r in self.rows], np.int64)
        positions = np.array([[r.position] for r in self.rows], np.int64)
        out = _run(self.request, _feed(self.runner, ids, positions, mask, np.array([0])))
        for b, row in enumerate(self.rows):
            row.tokens.append(int(out[b, -1].argmax()))


def compare(runner: StageRunner, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """One interleaved run: per-step ms of B separate 1-row steps and of one B-row step."""
    separate, batched = Separate(runner, prompts), Batched(runner, prompts)
    separate.prefill()
    batched.prefill()
    sep_ms, bat_ms = [], []
    for i in range(tokens - 1):
        order = (separate, batched) if i % 2 == 0 else (batched, separate)
        for system in order:
            start = time.perf_counter()
            system.step()
            (sep_ms if system is separate else bat_ms).append((time.perf_counter() - start) * 1e3)
    agree = [a.tokens == b.tokens for a, b in zip(separate.rows, batched.rows, strict=True)]
    return {"separate_ms": statistics.median(sep_ms), "batched_ms": statistics.median(bat_ms),
            "rows_identical": sum(agree),
            "first_divergence": [next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True))
                                       if x != y), None)
                                 for a, b in zip(separate.rows, batched.rows, strict=True)]}


def measure(export_dir: Path | str, batches: list[int], tokens: int, runs: int,
            config: RuntimeSpec | None = None,
            prompts: list[list[int]] | None = None) -> dict[str, Any]:
    runner = StageRunner(export_dir, 0, config or RuntimeSpec(), verify=False)
    if not (runner.spec.first and runner.spec.last):
        raise ValueError("bench_batching needs a 1-stage export (token ids in, logits out)")
    if prompts is None:
        from zctl.engine.tokenizer import ChatTokenizer

        tok = ChatTokenizer(export_dir)
        prompts = [tok.encode(p) for p in PROMPTS]
    result: dict[str, Any] = {}
    compare(runner, prompts[:2], 4)  # warm-up: first inferences of each shape pay once
    for b in batches:
        rows = [prompts[i % len(prompts)] for i in range(b)]
        samples = [compare(runner, rows, tokens) for _ in range(runs)]
        sep = statistics.median(s["separate_ms"] for s in samples)
        bat = statistics.median(s["batched_ms"] for s in samples)
        result[str(b)] = {
            "separate_step_ms": round(sep, 2),         # B one-row steps, one after another
            "batched_step_ms": round(bat, 2),          # one B-row step
            "ratio": round(bat / sep, 3),              # < 1: batching wins
            "one_row_step_ms": round(sep / b, 2),
            "batched_ms_per_row": round(bat / b, 2),
            "aggregate_tok_s_separate": round(1e3 * b / sep, 1),
            "aggregate_tok_s_batched": round(1e3 * b / bat, 1),
            "samples": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items()}
                        for s in samples],
        }
    return result


def main(
    batch: Annotated[list[int] | None, typer.Option(
        help="batch sizes to measure (repeatable; default: 2 and 4)")] = None,
    tokens: Annotated[int, typer.Option(help="decode steps per run")] = 64,
    runs: Runs = 3,
    weights: Weights = "int4",
    kv_cache_precision: Annotated[str | None, typer.Option(
        help="KV_CACHE_PRECISION (f32, u8; default: the plugin's)")] = None,
    export_dir: Annotated[Path | None, typer.Option(
        help="a 1-stage export (default: SmolLM2 INT4, exported once like bench_parity)")] = None,
    as_json: Json = False,
) -> None:
    batch = batch or [2, 4]
    if export_dir is None:
        export_dir = model_export("smollm2-135m", 1, weights)
    config = RuntimeSpec(kv_cache_precision=kv_cache_precision)
    result = {"export": str(export_dir), "tokens": tokens, "runs": runs,
              "properties": config.properties(),
              "batches": measure(export_dir, batch, tokens, runs, config)}
    if as_json:
        print(json.dumps(result))
        return
    for b, r in result["batches"].items():
        print(f"B={b}: {b} separate steps {r['separate_step_ms']} ms, one batched step "
              f"{r['batched_step_ms']} ms (ratio {r['ratio']}), aggregate "
              f"{r['aggregate_tok_s_separate']} -> {r['aggregate_tok_s_batched']} tok/s, "
              f"rows identical {[s['rows_identical'] for s in r['samples']]}/{b}")


if __name__ == "__main__":
    typer.run(main)
