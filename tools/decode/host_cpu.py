"""Host CPU time of an in-process chain, measured in CPU time rather than wall time (so a
machine loaded by other work skews it far less than a tok/s figure):

  host_cpu_ms_per_token  the calling thread's CPU time per decode token through the
                         engine's greedy loop (tools.harness.greedy.timed_greedy): the
                         scheduler, the session, sampling, the stages' inputs and the
                         calls into the plugin. The plugin computes on its own threads
                         (start_async + wait), so the waiting is not counted.
  idle_cpu_ms_per_step   the process's other threads' CPU time in an idle window of
                         ``--idle-ms`` right after each decode step: the plugin's worker
                         threads spinning after an inference. On one PC this costs
                         nothing; where two stage processes share cores (a local
                         cluster) it is taken from the stage computing next.

    python -m tools.decode.host_cpu EXPORT_DIR [--tokens 128] [--runs 6] [--idle-ms 5]
        [--paged-attention] [--json]
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
import typer

from tools.harness.greedy import greedy_step, start_stream, timed_greedy
from tools.harness.options import Json, Precision, Runs, Threads, Tokens, fail

if TYPE_CHECKING:
    from zctl.engine.executor import Executor


@dataclass(frozen=True)
class HostCpu:
    host_cpu_ms_per_token: float  # median over runs
    idle_cpu_ms_per_step: float  # median over steps
    idle_cpu_ms_per_step_p90: float
    tokens: list[int]  # the greedy tokens (the same every run)


def process_cpu_s() -> float:
    """This process's CPU time, every thread, in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def host_cpu_runs(chain: Executor, prompt_ids: Sequence[int], tokens: int,
                  runs: int) -> tuple[list[float], list[int]]:
    """The calling thread's CPU ms per token of each greedy run, and the tokens (the same
    in every run, else RuntimeError)."""
    per_token, first = [], None
    for _ in range(runs):
        start = time.thread_time()
        out, _stats = timed_greedy(chain, prompt_ids, tokens)
        per_token.append((time.thread_time() - start) * 1e3 / tokens)
        if first is not None and out != first:
            raise RuntimeError("greedy runs gave different tokens")
        first = out
    return per_token, first or []


def idle_cpu_steps(chain: Executor, prompt_ids: Sequence[int], steps: int,
                   idle_s: float, stream: int = 7) -> list[float]:
    """Per decode step, the CPU ms the process's other threads took in the ``idle_s``
    sleep right after it."""
    token, position = start_stream(chain, stream, prompt_ids)
    spent = []
    for _ in range(steps):
        token, position = greedy_step(chain, stream, token, position)
        process, thread = process_cpu_s(), time.thread_time()
        time.sleep(idle_s)
        other = (process_cpu_s() - process) - (time.thread_time() - thread)
        spent.append(max(0.0, other) * 1e3)  # (two clocks: a few us apart either way)
    return spent


def measure(chain: Executor, prompt_ids: Sequence[int], tokens: int, runs: int,
            idle_s: float) -> HostCpu:
    """Both figures on a warmed-up chain."""
    timed_greedy(chain, prompt_ids, 4)  # warm-up: first inferences pay one-off costs
    host, out = host_cpu_runs(chain, prompt_ids, tokens, runs)
    idle = idle_cpu_steps(chain, prompt_ids, tokens, idle_s)
    return HostCpu(round(statistics.median(host), 4), round(statistics.median(idle), 4),
                   round(float(np.percentile(idle, 90)), 4), out)


def main(export_dir: Annotated[Path, typer.Argument(help="an export directory")],
         tokens: Tokens = 128, runs: Runs = 6, precision: Precision = "f32",
         threads: Threads = 0,
         idle_ms: Annotated[float, typer.Option(help="idle window after each step")] = 5.0,
         paged_attention: Annotated[bool, typer.Option(
             "--paged-attention/--stateful-attention",
             help="the KV in blocks on PagedAttention (a cluster's default on CPUs), or as "
                  "each stream's OpenVINO state")] = False,
         as_json: Json = False) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from tools.harness.models import PROMPT
    from zctl.engine.tokenizer import ChatTokenizer

    if tokens < 2 or runs < 1 or idle_ms <= 0:
        fail("--tokens must be >= 2, --runs >= 1 and --idle-ms > 0")
    if not (export_dir / "manifest.json").is_file():
        fail(f"{export_dir} is not an export (no manifest.json)")
    chain = LocalChain.load(str(export_dir), RuntimeSpec(
        precision=None if precision == "default" else precision, num_threads=threads or None,
        performance_hint="LATENCY", paged_attention=paged_attention))
    result = measure(chain, ChatTokenizer(export_dir).encode(PROMPT), tokens, runs,
                     idle_ms / 1e3)
    record = {k: v for k, v in asdict(result).items() if k != "tokens"}
    print(json.dumps(record) if as_json else "  ".join(f"{k} {v}" for k, v in record.items()))


if __name__ == "__main__":
    typer.run(main)
