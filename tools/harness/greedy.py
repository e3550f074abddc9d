"""The greedy reference loop, stepped token by token on any executor (zctl.engine.executor):
a stream opened and prefilled, one step after another, several executors stepped in
rotating order (their step times paired token by token), and one whole generation through
the engine's own loop with its figures."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tools.harness.order import rotated

if TYPE_CHECKING:
    from zctl.engine.executor import Executor
    from zctl.engine.stats import GenerationStats


def start_stream(chain: Executor, stream: int, prompt_ids: Sequence[int]) -> tuple[int, int]:
    """Open ``stream`` afresh on ``chain`` and prefill the prompt: (the greedy next token,
    its position)."""
    chain.open(stream)
    chain.reset(stream)
    reply = chain.step(stream, np.asarray(prompt_ids), np.arange(len(prompt_ids)))
    return int(reply.tokens[-1]), len(prompt_ids)


def greedy_step(chain: Executor, stream: int, token: int, position: int) -> tuple[int, int]:
    """Feed ``token`` at ``position``: (the greedy next token, its position)."""
    reply = chain.step(stream, np.array([token]), np.array([position]))
    return int(reply.tokens[-1]), position + 1


def paired_step_ms(chains: Mapping[str, Executor], prompt_ids: Sequence[int], tokens: int,
                   stream: int = 7) -> dict[str, float]:
    """Median ms per greedy decode step of each chain, the chains stepped token by token
    in rotating order (each on its own stream): drift of the machine, which moves whole
    runs by +-10% here, hits every chain alike, so their ratios are exact to ~1%."""
    state = {key: start_stream(chain, stream, prompt_ids) for key, chain in chains.items()}
    keys = list(chains)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for i in range(tokens):
        for key in rotated(keys, i):
            start = time.perf_counter()
            state[key] = greedy_step(chains[key], stream, *state[key])
            times[key].append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def timed_greedy(pipeline: Executor, prompt_ids: Sequence[int], tokens: int,
                 **options: Any) -> tuple[list[int], GenerationStats]:
    """One greedy generation through the engine's loop: its tokens and figures."""
    from zctl.engine.scheduler import generate_greedy
    from zctl.engine.stats import GenerationStats

    stats = GenerationStats()
    out = list(generate_greedy(pipeline, list(prompt_ids), tokens, stats=stats, **options))
    return out, stats
