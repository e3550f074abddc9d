"""The model of time: a placement's step, hops, tok/s at 1 and N streams, and TTFT.

A decode step of ``r`` rows on a stage is the node's call cost, plus ``r``-row decoder
layers, plus on the last stage the LM head, plus on the first stage (the coordinator's
node) the coordinator's own work of an ``r``-row step: the generation engine between a
reply and the next step and the head's frames (a profile's ``engine_s``), on every other
stage the node's framework work (the frame it received decoded, the one it sends prepared
and sealed: a profile's ``frame_s``). A profile times its layers' steps as a pipeline's
stage runs them (after an idle gap, their median), and a link's round trip as a hop sees
it: each way to a receiver idle for a step (the probe's round trip after an idle gap less
half of one back to back, controlplane/planner/measured.py: of an idle round trip only the
way out wakes an idle receiver, and a hop's receiver has waited a whole step), so that a
hop's half of it holds the sender's send, the receiver's wake-up and its read; a node's
profile is taken at the host's speed now (controlplane/planner/speed.py: its times scaled
by the speed factor before they get here). A hop carries
the step's hidden states (rows x tokens x hidden, float32) in a frame
(dataplane/wire/frames.py: a fixed header, the positions, a timing record per stage
passed): it takes half the link's round trip plus its bytes at the link's bandwidth, and
occupies the link for the bytes alone. The last stage
answers stage 0 with 8 bytes a row (top-1). One stream waits for every stage, every hop
and the reply: its tok/s is 1 / cycle. N streams run as G row groups of ceil(N / G) rows,
pipelined: a round of G steps takes the longer of one cycle and G times the busiest stage
or link (the bottleneck), and yields N tokens. A stage on a node held to a CPU quota
(controlplane/planner/quota.py) takes its time after an idle gap within the cycle, and
as the bottleneck no less than its CPU time over the quota's share: a round (and one
stream's cycle) is never shorter than that; G is chosen as the engine's ``--row-groups``
would best be set. A prompt is prefilled in chunks pipelined through the stages as the
engine cuts a lone prompt (zctl/engine/prefill.py); its first token comes with the last
chunk's reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.planner.profile import LinkProfile, NodeProfile
from controlplane.planner.shape import ModelShape
from dataplane.wire.frames import FIXED, TIMING, TOP1
from zctl.engine.prefill import MAX_CHUNK, MIN_CHUNK, split

HIDDEN_BYTES = 4  # stages pass float32 hidden states (the manifest's activation_dtype "f32")
POSITION_BYTES = 8  # an int64 logical position per token in a step's header
SHAPE_BYTES = 4 * 3  # [rows, tokens, hidden] as uint32s
PROMPT_TOKENS = 1024  # the prompt a placement's TTFT is predicted for


@dataclass(frozen=True)
class Stage:
    """One stage of a placement: a node and its layers [start, end)."""

    node: str
    profile: NodeProfile
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Pipeline:
    """Stages in order, the links between neighbours, and the reply link (last stage to
    stage 0; None with one stage, whose head answers its own steps)."""

    shape: ModelShape
    stages: tuple[Stage, ...]
    hops: tuple[LinkProfile, ...]
    reply: LinkProfile | None

    def __post_init__(self) -> None:
        if not self.stages or len(self.hops) != len(self.stages) - 1:
            raise ValueError(f"{len(self.stages)} stages need {len(self.stages) - 1} hops, "
                             f"got {len(self.hops)}")
        if (self.reply is None) != (len(self.stages) == 1):
            raise ValueError("a reply link is needed exactly when there are several stages")


# -- one step -------------------------------------------------------------------------------
def stage_terms(profile: NodeProfile, rows: float, last: bool,
                first: bool) -> tuple[float, float]:
    """A stage's decode step of ``rows`` rows as (fixed, per layer) seconds: the step takes
    fixed + layers * per layer (the first stage's node runs the engine as well, whose
    figure holds the head's frames; every other node's frames are its ``frame_s``)."""
    fixed = (profile.call_s + (profile.head_s(rows) if last else 0.0)
             + (profile.engine_s(rows) if first else profile.frame_s(rows)))
    return fixed, profile.layer_s(rows)


def stage_step_s(stage: Stage, rows: float, last: bool, first: bool) -> float:
    fixed, per_layer = stage_terms(stage.profile, rows, last, first)
    return fixed + stage.layers * per_layer


def step_frame_bytes(shape: ModelShape, rows: int, tokens: int, stage: int) -> int:
    """Bytes of the frame stage ``stage`` sends on: ``rows`` x ``tokens`` hidden states."""
    count = rows * tokens
    return (FIXED.size + SHAPE_BYTES + POSITION_BYTES * count + TIMING.size * (stage + 1)
            + HIDDEN_BYTES * count * shape.hidden)


def reply_frame_bytes(rows: int, stages: int) -> int:
    """Bytes of the last stage's top-1 answer for ``rows`` rows."""
    return FIXED.size + SHAPE_BYTES + TIMING.size * stages + TOP1.size * rows


def hop_s(pipe: Pipeline, rows: int, tokens: int = 1) -> list[tuple[float, float]]:
    """Each forward hop's (latency, time it occupies its link) for a step."""
    return [(link.latency_s(n), link.busy_s(n))
            for i, link in enumerate(pipe.hops)
            for n in (step_frame_bytes(pipe.shape, rows, tokens, i),)]


def reply_s(pipe: Pipeline, rows: int) -> tuple[float, float]:
    if pipe.reply is None:
        return 0.0, 0.0
    n = reply_frame_bytes(rows, len(pipe.stages))
    return pipe.reply.latency_s(n), pipe.reply.busy_s(n)


@dataclass(frozen=True)
class StepTimes:
    """A decode step of ``rows`` rows: each stage (after an idle gap), each hop
    (latency), the reply, the cycle (all of them in turn), the bottleneck (the busiest
    stage or link) and each stage's time stepping back to back (its own, unless a CPU
    quota holds its node to less)."""

    rows: int
    stage_s: tuple[float, ...]
    hop_s: tuple[float, ...]
    reply_s: float
    cycle_s: float
    bottleneck_s: float
    busy_s: tuple[float, ...] = ()


def step_times(pipe: Pipeline, rows: int) -> StepTimes:
    last = len(pipe.stages) - 1
    walls = [stage_step_s(s, rows, i == last, i == 0) for i, s in enumerate(pipe.stages)]
    stages = tuple(s.profile.alone_s(w) for s, w in zip(pipe.stages, walls, strict=True))
    busy = tuple(s.profile.busy_s(w) for s, w in zip(pipe.stages, walls, strict=True))
    hops = hop_s(pipe, rows)
    reply, reply_busy = reply_s(pipe, rows)
    cycle = sum(stages) + sum(h for h, _ in hops) + reply
    bottleneck = max([*busy, *(b for _, b in hops), reply_busy])
    return StepTimes(rows, stages, tuple(h for h, _ in hops), reply, cycle, bottleneck, busy)


# -- streams ------------------------------------------------------------------------------
def group_options(streams: int) -> list[tuple[int, int]]:
    """(row groups, rows in the largest group) worth considering for ``streams`` streams:
    for each group size, the fewest groups that hold every stream."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    options = {}
    for rows in range(1, streams + 1):
        groups = math.ceil(streams / rows)
        options.setdefault(groups, math.ceil(streams / groups))
    return sorted(options.items())


def round_s(cycle_s: float, bottleneck_s: float, groups: int) -> float:
    """How long ``groups`` row groups take to each advance a token: one cycle, unless the
    busiest stage or link cannot serve them all in that time."""
    return max(cycle_s, groups * bottleneck_s)


@dataclass(frozen=True)
class Throughput:
    tok_s: float
    streams: int
    groups: int
    rows: int


def grouped(pipe: Pipeline, streams: int, groups: int) -> Throughput:
    """Aggregate tok/s of ``streams`` decoding streams in ``groups`` row groups (at most one
    a stream), the largest group setting each step's rows."""
    if streams < 1 or groups < 1:
        raise ValueError(f"streams and row groups must be >= 1, got {streams} and {groups}")
    groups = min(groups, streams)
    rows = math.ceil(streams / groups)
    times = step_times(pipe, rows)
    return Throughput(streams / round_s(times.cycle_s, times.bottleneck_s, groups), streams,
                      groups, rows)


def throughput(pipe: Pipeline, streams: int) -> Throughput:
    """Aggregate tok/s of ``streams`` decoding streams, with the best number of row groups."""
    return max((grouped(pipe, streams, groups) for groups, _ in group_options(streams)),
               key=lambda t: t.tok_s)


def stream_s(times: StepTimes) -> float:
    """One stream's time a token: its cycle, or the slowest stage's time back to back when
    a quota holds that stage's node to less than the cycle lets it catch up on."""
    return round_s(times.cycle_s, times.bottleneck_s, 1)


def stream_tok_s(pipe: Pipeline) -> float:
    """One stream's tok/s: a token passes every stage, every hop and the reply."""
    return 1.0 / stream_s(step_times(pipe, 1))


# -- a prompt -------------------------------------------------------------------------------
def chunk_s(pipe: Pipeline, index: int, tokens: int, past: int, final: bool) -> float:
    """Stage ``index``'s prefill step of ``tokens`` prompt tokens over ``past`` ones: its
    call, each layer's one-row step and the further tokens at the layer's prefill
    throughput, attention over the past and among the chunk's tokens (at the same rate,
    scaled by the multiply-accumulates a token spends per earlier token), the head for
    the prompt's last token on the last stage, the engine's step on the first and a
    one-row step's frames' work on the others; a node's chunks follow one another, so a
    CPU quota holds each to its time back to back."""
    stage = pipe.stages[index]
    profile, shape = stage.profile, pipe.shape
    token_s = 1.0 / profile.prefill_tokens_per_s
    per_past = token_s * shape.attention_macs_per_past() / shape.active_layer_weights()
    attention = per_past * (tokens * past + tokens * tokens / 2)
    layer = profile.layer_s(1) + (tokens - 1) * token_s + attention
    head = profile.head_s(1) if final and index == len(pipe.stages) - 1 else 0.0
    engine = profile.engine_s(1) if index == 0 else profile.frame_s(1)
    return profile.busy_s(profile.call_s + engine + stage.layers * layer + head)


def prefill_s(pipe: Pipeline, chunks: list[int]) -> float:
    """When the last of ``chunks`` leaves the last stage, chunks following one another
    through the stages and links without waiting for replies."""
    count = len(pipe.stages)
    stage_free = [0.0] * count
    link_free = [0.0] * (count - 1)
    past = 0
    for n, tokens in enumerate(chunks):
        arrive = 0.0
        for i in range(count):
            start = max(stage_free[i], arrive)
            stage_free[i] = start + chunk_s(pipe, i, tokens, past, n == len(chunks) - 1)
            if i < count - 1:
                nbytes = step_frame_bytes(pipe.shape, 1, tokens, i)
                sent = max(link_free[i], stage_free[i]) + pipe.hops[i].busy_s(nbytes)
                link_free[i] = sent
                arrive = sent + pipe.hops[i].rtt_s / 2
        past += tokens
    return stage_free[-1]


@dataclass(frozen=True)
class FirstToken:
    seconds: float
    chunk: int  # the prompt's chunk size


def ttft(pipe: Pipeline, prompt: int = PROMPT_TOKENS) -> FirstToken:
    """Time to the first token of a ``prompt``-token prompt on an idle pipeline: the best
    of the chunkings the engine tries for a lone prompt (whole, halves, quarters, ... down
    to ``MIN_CHUNK`` tokens), and the reply."""
    if prompt < 1:
        raise ValueError(f"a prompt has at least one token, got {prompt}")
    best = None
    parts = 1
    while True:
        chunk = min(MAX_CHUNK, -(-prompt // parts))
        if chunk < MIN_CHUNK and parts > 1:
            break
        seconds = prefill_s(pipe, split(prompt, chunk)) + reply_s(pipe, 1)[0]
        if best is None or seconds < best.seconds:
            best = FirstToken(seconds, chunk)
        if chunk <= MIN_CHUNK or len(pipe.stages) == 1:
            break
        parts *= 2
    assert best is not None
    return best
