"""What each setting costs against today's default, measured in the same run: TTFT of a
cold prompt (short, middling, long), of the long one sent again (found whole in the
prefix cache) and with more after it, of a follow-up turn (a first turn's prompt and
answer, then more), decode tok/s of one stream (short and long past)
and of 8 streams in row groups. Settings take turns within every round, in a rotating
order, so the machine's drift hits them alike; the report gives each figure's median
over the rounds and the median of its per-round ratios to today's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from tools.harness.order import rotated
from tools.harness.stats import paired_ratio
from tools.repeatable.lab import Lab, Request
from tools.repeatable.prompts import DOCUMENT

COLD_LENGTHS = (35, 300, 1000)  # prompt tokens
CACHED_LENGTH, MORE = 1000, 20
FOLLOW_UP_LENGTH, FOLLOW_UP_ANSWER = 300, 48  # a first turn's prompt and answer, in tokens
DECODE_TOKENS = 64
STREAMS, STREAM_TOKENS = 8, 48


def prompt_ids(lab: Lab, length: int) -> tuple[int, ...]:
    """``length`` tokens of a long document (repeated as needed)."""
    ids = lab.tokenizer.encode(DOCUMENT, chat=False)
    while len(ids) < length:
        ids = ids + ids
    return tuple(int(t) for t in ids[:length])


def measure(lab: Lab, setting: str) -> dict[str, float]:
    """One round's figures of one setting."""
    def raw(length: int, tokens: int = 1) -> Request:
        return Request(prompt_ids=prompt_ids(lab, length), max_tokens=tokens, ignore_eos=True,
                       streamed=True)

    out: dict[str, float] = {}
    for length in COLD_LENGTHS:
        out[f"ttft_cold_{length}_ms"] = lab.run(lab.engine(setting), [raw(length)])[0].ttft_ms
    engine = lab.engine(setting, cache=True)
    lab.run(engine, [raw(CACHED_LENGTH)])
    out[f"ttft_cached_{CACHED_LENGTH}_ms"] = lab.run(engine, [raw(CACHED_LENGTH)])[0].ttft_ms
    out[f"ttft_cached_{CACHED_LENGTH}+{MORE}_ms"] = lab.run(
        engine, [raw(CACHED_LENGTH + MORE)])[0].ttft_ms
    # a follow-up turn: the first turn's prompt and answer cached, then more
    engine = lab.engine(setting, cache=True)
    first = raw(FOLLOW_UP_LENGTH, FOLLOW_UP_ANSWER)
    answer = lab.run(engine, [first])[0].tokens
    more = prompt_ids(lab, FOLLOW_UP_LENGTH + MORE)[FOLLOW_UP_LENGTH:]
    turn = Request(prompt_ids=first.prompt_ids + tuple(answer) + more, max_tokens=1,
                   ignore_eos=True, streamed=True)
    out["ttft_follow_up_ms"] = lab.run(engine, [turn])[0].ttft_ms
    for past in (COLD_LENGTHS[0], COLD_LENGTHS[-1]):
        done = lab.run(lab.engine(setting), [raw(past, DECODE_TOKENS)])[0]
        out[f"decode_tok_s_at_{past}"] = done.tok_s
    batch = [raw(COLD_LENGTHS[0] + 7 * i, STREAM_TOKENS) for i in range(STREAMS)]
    engine = lab.engine(setting, row_groups=lab.stages)
    start = time.perf_counter()
    done_all = lab.run(engine, batch)
    out[f"{STREAMS}_streams_tok_s"] = (sum(len(d.tokens) for d in done_all)
                                       / (time.perf_counter() - start))
    return out


def run_costs(lab: Lab, settings: Sequence[str], rounds: int) -> dict[str, Any]:
    """Every setting's figures over ``rounds`` rounds, turns rotating: per setting the
    medians, and against the first setting (today's) the medians of per-round ratios."""
    if rounds < 1 or not settings:
        raise ValueError("at least one round and one setting")
    samples: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    for i in range(rounds):
        for setting in rotated(settings, i):
            samples[setting].append(measure(lab, setting))
    return summarize(samples, settings[0])


def summarize(samples: dict[str, list[dict[str, float]]], baseline: str) -> dict[str, Any]:
    """Medians per setting and figure; ratios (setting / baseline, round by round, their
    median: ``paired_ratio``, which refuses a baseline figure of 0) for every other
    setting."""
    medians = {s: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
               for s, rows in samples.items()}
    ratios = {}
    for setting, rows in samples.items():
        if setting == baseline:
            continue
        ratios[setting] = {k: paired_ratio([a[k] for a in rows], [b[k] for b in samples[baseline]])
                           for k in rows[0]}
    return {"rounds": len(samples[baseline]), "medians": medians, "vs_" + baseline: ratios}
