"""What the families' exactness tests share: an export's chains on every runner, greedy
speculation checked on each, a scheduled session run to its end, and stateful stages
whose sliding layers' states are trimmed soon, with the slots they hold."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from exporter.verify import EXACT_CONFIG, hf_greedy
from tests.zctl.engine.test_drafting import ScriptedDrafter
from zctl.engine.scheduler import StreamScheduler, generate_speculative
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import SpeculativeStats
from zctl.engine.tokenizer import ChatTokenizer


def runner_chains(export_dir: Path) -> dict[str, LocalChain]:
    """The export's chain at exact numerics on the stateful runner (rewinding by mask and
    by trimming) and on the paged one."""
    paged = replace(EXACT_CONFIG, paged_attention=True)
    return {"mask": LocalChain.load(str(export_dir), EXACT_CONFIG, rewind="mask"),
            "trim": LocalChain.load(str(export_dir), EXACT_CONFIG, rewind="trim"),
            "paged": LocalChain.load(str(export_dir), paged)}


def assert_speculation_matches(chains: dict[str, LocalChain], prompt: list[int],
                               reference: list[int]) -> None:
    """Speculative decoding of ``prompt`` on every chain, drafts scripted to be rejected at
    every position (so the stages rewind their KV), gives the ``reference`` greedy tokens."""
    for runner, chain in chains.items():
        stats = speculate_watching(chain, prompt, reference, 1, lambda: None, runner)
        assert stats.rejections > 3 and stats.accepted > 3, runner


def speculate_watching(chain: LocalChain, prompt: list[int], reference: list[int],
                       stream_id: int, watch: Callable[[], None],
                       label: str = "") -> SpeculativeStats:
    """Speculative decoding of ``prompt`` as stream ``stream_id``, drafts scripted to be
    rejected at every position, ``watch()`` called after every token; the tokens must be
    ``reference``. Its statistics."""
    stats = SpeculativeStats()
    drafter = ScriptedDrafter(prompt, reference)
    got = []
    for token in generate_speculative(chain, prompt, len(reference), drafter=drafter, k=4,
                                      stats=stats, stream_id=stream_id):
        got.append(token)
        watch()
    assert got == reference, label
    return stats


def run_to_end(scheduler: StreamScheduler, session: DecodeSession) -> list[int]:
    """Run ``session`` on ``scheduler`` until it ends; its tokens (it must not fail)."""
    scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert session.error is None
    return session.emitted


def assert_next_turn_takes_the_entry(chain: LocalChain, hf: object, tokenizer: ChatTokenizer,
                                     prompt: list[int], first_tokens: int, new_tokens: int,
                                     stream_id: int) -> None:
    """A session of ``prompt`` (``first_tokens`` tokens, stream ``stream_id``), then the next
    turn (its prompt, answer and a few words more, stream ``stream_id + 1``): the turn takes
    the first's whole prefix-cache entry and gives HF's greedy ``new_tokens`` tokens."""
    scheduler = StreamScheduler(chain, prefix_cache_tokens=4096)
    first = run_to_end(scheduler, DecodeSession(stream_id, prompt, first_tokens))
    longer = prompt + first + tokenizer.encode(" and then", chat=False)
    session = DecodeSession(stream_id + 1, longer, new_tokens)
    got = run_to_end(scheduler, session)
    assert session.cached_tokens == len(prompt) + first_tokens - 1  # the whole entry
    assert got == hf_greedy(hf, longer, new_tokens)


class NarrowStatefulWindow(RuntimeSpec):
    """Exact numerics on stateful stages whose sliding layers keep 8 tokens beyond their
    window and let their states grow by 4 slots before a trim (a trim every 4 tokens)."""

    sliding_margin = 8
    sliding_slack = 4


STATEFUL_WINDOW = NarrowStatefulWindow(precision="f32", kv_cache_precision="f32",
                                       dynamic_quantization=False)


def state_slots(chain: LocalChain, sid: int, seen: dict[str, list[int]]) -> None:
    """Note the slots of every stage's sliding and global states of stream (or row group)
    ``sid`` after a step."""
    for runner in chain.runners:
        target = runner.groups.get(sid) or runner.streams.get(sid)
        if target is None:  # (the stream ended)
            continue
        assert runner.sliding is not None
        for state in target.request.query_state():
            kind = "sliding" if runner.sliding.is_sliding(state.name) else "global"
            seen.setdefault(kind, []).append(int(state.state.shape[2]))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Torch on one thread for a test module that imports this fixture: on tensors this
    small, a second thread only waits for the first (and, on a busy machine, makes the
    Hugging Face reference many times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class NarrowMargin(RuntimeSpec):
    """Exact numerics on paged stages whose sliding layers keep 8 tokens beyond their
    window: the deepest rewind of a speculation of 4 drafts, and narrow enough for a
    short generation to free blocks (a block holds 32 tokens)."""

    sliding_margin = 8


def window_blocks(chain: LocalChain, sid: int, seen: dict[int, list[tuple[int, int]]]) -> None:
    """Note each stage's (sliding, global) block counts of stream ``sid`` after a step."""
    for i, runner in enumerate(chain.runners):
        seq = runner.streams.get(sid)
        if seq is None:  # (the stream ended)
            continue
        assert runner.window is not None
        assert len(seq.window_blocks) + seq.window_first == len(seq.blocks)
        seen.setdefault(i, []).append((len(seq.window_blocks), len(seq.blocks)))
