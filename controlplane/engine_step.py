"""The coordinator's own work per decode step, timed (a profile's ``engine_decode_s``).

Stage 0's node is also the coordinator: between one reply and the next step it runs the
generation engine (zctl/engine: the scheduler, the sessions' bookkeeping, the reply's
tokens taken, each token detokenized, the clients' chunks made), and around its stage's
compute the head packs the step's hidden states into a frame for the next stage and reads
the last stage's reply. None of it is a stage's compute or a link's time, and the model of
time adds it to stage 0's step.

``time_engine`` measures it with the real engine: ``rows`` greedy streams stepped as one
row group on an ``InstantStages`` executor, whose stages answer at once but whose frames
are made as the data plane makes them (the step's [rows, tokens, hidden] float32 hidden
states encoded, a top-1 reply of each answered row decoded), and a tokenizer of the
model's vocabulary size (a WordLevel model of the ``tokenizers`` library). A profile runs a
synthetic stage's inference in each step, as stage 0's runs beside the engine: the caches it
sweeps make the engine's work 2-4x what it costs in a tight loop (controlplane/
profiling.py); its time is left out. The figure at ``rows`` rows is a decode step's wall
time but the stage's, the lower quartile of several runs of steps (a busy moment only
ever adds time, as for the stages' figures).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from controlplane.planner.profile import ROWS, ProfileError
from dataplane.wire.frames import TOPK_DTYPE, HiddenStateFrame, Kind, decode_frame, encode_frame
from zctl.engine.core import GenerationEngine
from zctl.engine.executor import InlineExecutor, Step, StepReply
from zctl.engine.requests import GenerationRequest
from zctl.engine.tokenizer import ChatTokenizer

PROMPT_TOKENS = 16  # each stream's prompt
STEPS = 20  # decode steps a run times
RUNS = 5  # runs of steps at each row count (the lower quartile counts)
QUANTILE = 0.25


class InstantStages(InlineExecutor):
    """Stages that answer a step with the next token id of each row (modulo the
    vocabulary), the step's hidden-state frame encoded and its top-1 reply frame decoded
    as the coordinator's head does each step; ``stage`` (given the step's rows), when
    given, is run in each step as a stage's inference would be (its time is kept apart, in
    ``stage_s``: it is not the engine's)."""

    row_groups_supported = True
    num_stages = 2

    def __init__(self, hidden: int, vocab: int, stage: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        self.stage, self.clock = stage, clock
        self.groups: dict[int, int] = {}  # row group id -> rows
        self.epoch = 0
        self.steps = 0  # steps computed
        self.stage_s = 0.0  # seconds in ``stage``

    def compute(self, step: Step) -> StepReply:
        rows = self.groups.get(step.stream_id, 1)
        if self.stage is not None:
            start = self.clock()
            self.stage(rows)
            self.stage_s += self.clock() - start
        ids = np.asarray(step.token_ids, dtype=np.int64).reshape(rows, -1)
        positions = np.asarray(step.positions, dtype=np.int64).reshape(-1)
        hidden = np.zeros((rows, ids.shape[1], self.hidden), np.float32)
        sent = HiddenStateFrame(Kind.STEP, step.stream_id, 1, self.epoch, positions=positions,
                                rows=rows)
        decode_frame(encode_frame(sent, hidden))  # what the next stage reads
        answered = rows * (1 if step.logits_idx is None else len(step.logits_idx))
        records = np.zeros((answered, 1), TOPK_DTYPE)
        records["token"][:, 0] = (ids[:, -1:].repeat(answered // rows, axis=0).reshape(-1)
                                  + 1) % self.vocab
        back = HiddenStateFrame(Kind.REPLY, step.stream_id, 1, self.epoch,
                                positions=positions if step.logits_idx is not None else
                                np.zeros(0, np.int64), rows=rows)
        _, payload = decode_frame(encode_frame(back, records))
        assert payload is not None
        self.steps += 1
        return StepReply(tokens=payload["token"][:, 0].astype(np.int64))

    # the rest of the Executor contract (InlineExecutor has the others): stages that keep
    # nothing but the row groups' sizes
    def open(self, stream_id: int) -> None:
        pass

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        self.groups.pop(stream_id, None)
        self.drop_answers(stream_id)

    def close_stream(self, stream_id: int) -> None:
        self.groups.pop(stream_id, None)

    def rewind(self, stream_id: int, count: int | np.ndarray) -> None:
        pass

    def compact(self, stream_id: int) -> None:
        pass

    def cancel(self, stream_id: int, request_ids: list[int], keep: int) -> None:
        self.drop_requests(request_ids)

    def regroup(self, group_id: int, members: list[int]) -> None:
        if members:
            self.groups[group_id] = len(members)
        else:
            self.groups.pop(group_id, None)


def write_tokenizer(directory: Path, vocab: int) -> None:
    """A tokenizer.json of ``vocab`` word-level tokens ("t0", "t1", ...) in ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({}))


def _steps_s(engine: GenerationEngine, stages: InstantStages, rows: int, runs: int,
             steps: int, clock: Callable[[], float], vocab: int) -> list[float]:
    """Each run's seconds a decode step of ``rows`` streams in one row group."""
    requests = [GenerationRequest(f"r{i}", max_tokens=(runs + 2) * steps + 8, chat=False,
                                  ignore_eos=True, temperature=0.0,
                                  prompt_ids=[(1 + i + t) % vocab for t in range(PROMPT_TOKENS)])
                for i in range(rows)]
    for i, request in enumerate(requests):
        engine.submit(i, request)
    _run(engine, stages, steps)  # the prompts, and the streams grouped
    out = [_run(engine, stages, steps, clock) for _ in range(runs)]
    for i, request in enumerate(requests):
        engine.cancel(i, request.request_id)
    while engine.busy:
        engine.poll(0.0)
    return out


def _run(engine: GenerationEngine, stages: InstantStages, steps: int,
         clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds a step, the stage's time left out, while the engine takes ``steps`` steps."""
    start, first, stage_s = clock(), stages.steps, stages.stage_s
    while stages.steps - first < steps:
        events = engine.poll(0.0)
        if not engine.busy:
            raise ProfileError(f"the engine ended its streams before {steps} steps: "
                               f"{[e for _, e in events][-1:]}")
    return (clock() - start - (stages.stage_s - stage_s)) / (stages.steps - first)


def time_engine(hidden: int, vocab: int, runs: int = RUNS, steps: int = STEPS,
                stage: Callable[[int], None] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> tuple[float, ...]:
    """The coordinator's seconds per decode step at ``ROWS`` rows (module docstring),
    ``stage`` run in each step (given its rows) as stage 0's inference."""
    if hidden < 1 or vocab < 2 or runs < 1 or steps < 1:
        raise ProfileError(f"timing the engine needs hidden >= 1, vocab >= 2, runs >= 1 and "
                           f"steps >= 1, got {hidden}, {vocab}, {runs}, {steps}")
    with tempfile.TemporaryDirectory(prefix="zctl-engine-") as tmp:
        write_tokenizer(Path(tmp), vocab)
        tokenizer = ChatTokenizer(tmp)
    stages = InstantStages(hidden, vocab, stage, clock)
    figures = []
    for rows in ROWS:
        engine = GenerationEngine(tokenizer, [], lambda: stages, max_streams=max(ROWS),
                                  row_groups=1, vocab_size=vocab)
        figures.append(float(np.quantile(_steps_s(engine, stages, rows, runs, steps, clock, vocab),
                                          QUANTILE)))
    return tuple(figures)
