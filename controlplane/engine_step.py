"""The coordinator's own work per decode step, timed (a profile's ``engine_decode_s``).

Stage 0's node is also the coordinator: between one reply and the next step it runs the
generation engine (zctl/engine: the scheduler, the sessions' bookkeeping, the reply's
tokens taken, each token detokenized, the clients' chunks made), and around its stage's
compute the head packs the step's hidden states into a frame for the next stage and reads
the last stage's reply. None of it is a stage's compute or a link's time, and the model of
time adds it to stage 0's step.

``time_engine`` measures it with the real engine: ``rows`` greedy streams stepped as one
row group on an ``InstantStages`` executor, whose stages answer over real sockets as the
cluster's do (controlplane/loopback_stages.py: the step's [rows, tokens, hidden] float32
hidden states sent in a frame over a loopback pair, the top-1 reply of each answered row
waited for asleep and read, after as long as the later stages' step), and a tokenizer of the
model's vocabulary size (a WordLevel model of the ``tokenizers`` library; the model's own
BPE tokenizer costs the same a token). A profile runs a synthetic stage's inference in each
step, as stage 0's runs beside the engine: the caches it sweeps make the engine's work 2-4x
what it costs in a tight loop (controlplane/profiling.py); its time is left out. The figure
at ``rows`` rows is the calling thread's CPU time a decode step, the median of several runs
of steps (as the stages' figures), so that neither the waits for the reply nor other jobs
on the PC count, while what the sockets and the wake-ups after each wait cost the thread
does (an in-process encode and decode of the frames, timed by the wall clock's lower
quartile, gave a third of what a running coordinator's generation thread spent).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from controlplane.loopback_stages import LoopbackStages
from controlplane.planner.profile import ROWS, ProfileError
from dataplane.wire.frames import HiddenStateFrame, Kind
from dataplane.wire.transport import TransportError
from zctl.engine.core import GenerationEngine
from zctl.engine.executor import InlineExecutor, Step, StepReply
from zctl.engine.requests import GenerationRequest
from zctl.engine.tokenizer import ChatTokenizer

PROMPT_TOKENS = 16  # each stream's prompt
STEPS = 20  # decode steps a run times
RUNS = 5  # runs of steps at each row count (the lower quartile counts)
QUANTILE = 0.5  # the median, as the stages' figures
FAR_S = 0.002  # the later stages' step when no stage is run in each step
# the longest wait for the later stages: a thread's wake-up after a wait grows with it up to
# some 10 ms (docs/design.md, links) and a longer one would only lengthen the profile
FAR_MAX_S = 0.010


class InstantStages(InlineExecutor):
    """Stages that answer a step with the next token id of each row (modulo the
    vocabulary), over real loopback sockets (``LoopbackStages``: the step's hidden-state
    frame sent as the coordinator's head sends it, the top-1 reply waited for and read) after
    ``far_s`` seconds, the later stages' step, or as long as ``stage`` took when it is given
    (a 2-stage pipeline's later stage is about as long as stage 0), at most ``FAR_MAX_S``.
    ``stage`` (given the step's rows) is run in each step as stage 0's inference would be;
    its time by ``clock`` is kept apart, in ``stage_s``: it is not the engine's. ``close``
    ends the loopback."""

    row_groups_supported = True
    num_stages = 2

    def __init__(self, hidden: int, vocab: int, stage: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.thread_time, far_s: float = FAR_S) -> None:
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        self.stage, self.clock, self.far_s = stage, clock, far_s
        self.groups: dict[int, int] = {}  # row group id -> rows
        self.epoch = 0
        self.steps = 0  # steps computed
        self.stage_s = 0.0  # seconds in ``stage``
        self.loopback = LoopbackStages(vocab)

    def compute(self, step: Step) -> StepReply:
        rows = self.groups.get(step.stream_id, 1)
        far_s = self.far_s
        if self.stage is not None:
            start, wall = self.clock(), time.perf_counter()
            self.stage(rows)
            far_s = min(FAR_MAX_S, time.perf_counter() - wall)
            self.stage_s += self.clock() - start
        ids = np.asarray(step.token_ids, dtype=np.int64).reshape(rows, -1)
        positions = np.asarray(step.positions, dtype=np.int64).reshape(-1)
        hidden = np.zeros((rows, ids.shape[1], self.hidden), np.float32)
        hidden[:, :, 0] = ids  # the later stages' answer follows from them
        sent = HiddenStateFrame(Kind.STEP, step.stream_id, 1, self.epoch, positions=positions,
                                rows=rows)
        answered = rows * (1 if step.logits_idx is None else len(step.logits_idx))
        tokens = self.loopback.step(sent, hidden, answered, far_s)
        self.steps += 1
        return StepReply(tokens=tokens)

    def close(self) -> None:
        self.loopback.close()

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
         clock: Callable[[], float] = time.thread_time) -> float:
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
                clock: Callable[[], float] = time.thread_time) -> tuple[float, ...]:
    """The coordinator's seconds per decode step at ``ROWS`` rows (module docstring): the
    calling thread's time by ``clock`` (its CPU time), ``stage`` run in each step (given
    its rows) as stage 0's inference."""
    if hidden < 1 or vocab < 2 or runs < 1 or steps < 1:
        raise ProfileError(f"timing the engine needs hidden >= 1, vocab >= 2, runs >= 1 and "
                           f"steps >= 1, got {hidden}, {vocab}, {runs}, {steps}")
    with tempfile.TemporaryDirectory(prefix="zctl-engine-") as tmp:
        write_tokenizer(Path(tmp), vocab)
        tokenizer = ChatTokenizer(tmp)
    try:
        stages = InstantStages(hidden, vocab, stage, clock)
    except TransportError as exc:
        raise ProfileError(f"timing the engine needs a loopback socket pair: {exc}") from None
    figures = []
    try:
        for rows in ROWS:
            engine = GenerationEngine(tokenizer, [], lambda: stages, max_streams=max(ROWS),
                                      row_groups=1, vocab_size=vocab)
            figures.append(float(np.quantile(
                _steps_s(engine, stages, rows, runs, steps, clock, vocab), QUANTILE)))
    except TransportError as exc:
        raise ProfileError(f"timing the engine: {exc}") from None
    finally:
        stages.close()
    return tuple(figures)
