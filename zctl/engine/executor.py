"""The engine's contract with whatever runs the stages: an ``Executor``.

An executor takes ``Step``s (a chunk of token ids at explicit logical positions for a
stream or a row group) and answers each with the last stage's ``StepReply``. ``LocalChain``
(dataplane.head.local_chain) runs every stage in this process; ``ClusterHead``
(dataplane.head.cluster_head) runs stage 0 here and the rest on nodes over ZeroMQ. The scheduler
drives both in the same way, through ``Executor`` only: ``submit`` a step, then
``collect_any`` answers as they come. ``InlineExecutor`` gives an executor that computes
a step when it is submitted (in process) that half of the contract, written once.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from zctl.engine.payloads import Want, as_payload, reply_rows


# Not frozen: one is built every step, and a frozen one costs ~2 us to build where this
# costs ~0.3. Compared by identity: it holds arrays.
@dataclass(slots=True, eq=False)
class Step:
    """One step of a stream (or of a row group: ``stream_id`` is the group's id).

    ``token_ids`` at logical ``positions``; ``logits_idx`` the positions answered (None:
    the last only); ``want_logits`` what of the logits the reply carries
    (zctl.engine.payloads); ``mask_tail`` the stream's last tokens dropped first, on
    every stage (one count per row on a row group); ``row_tokens`` each row's token count
    when a row group's rows are ragged (None: they share one); ``guessed`` whether a
    pipelined greedy step's tokens are a guess (see ``Executor``); ``one_query`` that
    every stage computes each token as a query of its own (see ``Executor``)."""

    stream_id: int
    token_ids: np.ndarray
    positions: np.ndarray
    logits_idx: np.ndarray | None = None
    want_logits: Want = False
    mask_tail: int | np.ndarray = 0
    row_tokens: np.ndarray | None = None
    guessed: bool | None = None
    one_query: bool = False


@dataclass
class StepReply:
    """What the last stage returns: greedy token per requested position, logits if asked.

    ``request_id`` is the id ``submit`` returned for the step; ``stage_ms`` each stage's
    compute time."""

    tokens: np.ndarray
    logits: np.ndarray | None = None
    stage_ms: list[float] = field(default_factory=list)
    request_id: int = 0
    logprob_rows: bool = False  # logits holds a top-k payload's log-probabilities (payloads)


def reply_from_logits(logits: np.ndarray, want_logits: Want = False) -> StepReply:
    """Top-1 per row of [1, K, V] (or [K, V]) logits, and the logits rows the step asked
    for (``want_logits``, see zctl.engine.payloads), as a cluster's reply would carry them."""
    rows = logits.reshape(-1, logits.shape[-1])
    payload = as_payload(want_logits)
    if payload is None:
        return StepReply(tokens=rows.argmax(axis=-1))
    shaped = reply_rows(rows, payload)
    tokens = rows.argmax(axis=-1) if payload.top else shaped.argmax(axis=-1)
    return StepReply(tokens=tokens, logits=shaped, logprob_rows=bool(payload.top))


class StepError(RuntimeError):
    """A submitted step could not be answered. ``request_id`` names it (0: the executor
    cannot tell which step, so every step in flight is lost)."""

    request_id: int = 0


class PipelineUnreachable(StepError):
    """The next stage took no frame (its node is gone, or the link to it is down): the
    pipeline failed, not the step. The engine holds the generations it hit and resumes them
    by replay once the pipeline serves again, as after any outage it is told of."""


class PrefixCacheUnsupported(RuntimeError):
    """The executor's stages keep no prefix cache (``prefix_cache_supported`` is False)."""


class Executor(Protocol):
    """What the engine needs of whatever runs the stages.

    Streams are opened and reset (a reset forgets the stream's KV on every stage) before
    their first step; ``close_stream`` frees a finished stream's KV slots on every stage.
    A model with LongRoPE's two sets of frequencies has a threshold
    (``rope_short_context``; 0: one set): a reset with ``long_rope`` begins a sequence
    whose every token turns with the long set, as Hugging Face turns a prompt longer than
    the threshold (``zctl.engine.long_rope``), however its prompt is cut into steps; on
    other sequences each token turns by its own position (a step starting at position 0
    by its highest).
    ``submit`` takes a ``Step`` and returns its request id. A step's ``mask_tail`` first
    drops that many of the stream's last
    tokens on every stage (on a row group: one count per row); ``rewind`` does the same
    on its own, applied before the stream's next step. ``regroup`` makes ``group_id`` the
    row group of ``members`` (streams stepped as the rows of one inference per stage)
    where ``row_groups_supported``; ``compact`` drops a stream's masked KV slots.
    Where ``paged_attention``, a row group's step may be ragged: ``row_tokens`` gives each
    row's token count, ids and positions hold the rows' tokens one after the other,
    ``logits_idx`` indexes them all (None: every row's last token) and the reply answers
    those positions in order (a decoding row's token beside a prompt's chunk: one
    inference, split-fuse). Where ``one_query_supported``, a step may be ``one_query``:
    every stage computes each of its tokens as a query of its own, after its row's tokens
    before it, bit for bit as that many single decode steps would (a verification step: the
    last token and K drafts; a replay of emitted tokens); elsewhere such a step fails. A
    pipelined greedy step says whether its tokens are a guess
    (``guessed``: True, or False for a step a guessed one may follow; None: neither), so
    a last stage that knows the answer to the step before can skip a refuted one early.
    ``cancel`` drops a stream's newest steps (those submitted after
    its last answered one; their answers are never collected) and rewinds it to its first
    ``keep`` logical tokens on every stage, in order with its steps: pipelined speculation's
    steps on a wrong guess. ``abandon_all`` forgets every step in flight (the stages are known to be broken):
    streams must be reset before they step again. ``overlaps_steps``: later stages compute
    a step while ``submit`` computes the next on stage 0 (a stream's steps answer in order).

    Where ``prefix_cache_supported``, the stages keep prefix entries by id, in order with
    the steps: ``save_prefix`` stores the first ``length`` logical KV slots of a stream
    (alone, or a row of a row group) as an entry, replacing one of that id (``take``, for a
    finishing stream alone: its own KV becomes the entry and the stream is closed);
    ``load_prefix`` gives an open, just reset stream stepped alone an entry's first
    ``length`` slots, so its next step continues at position ``length`` (``take`` moves the
    entry to the stream instead of copying it); ``drop_prefix`` / ``drop_all_prefixes``
    free entries; ``prefix_bytes`` is what the entries of the stages run in this process
    hold (stage index -> bytes). Elsewhere saves and loads raise PrefixCacheUnsupported.
    ``wirings`` counts the times the stages were rewired or abandoned: when it has moved,
    the later stages may have lost their prefix entries.
    """

    num_stages: int
    overlaps_steps: bool
    paged_attention: bool  # the stages keep KV in blocks (a past costs a prefill step little)
    wirings: int
    rope_short_context: int  # LongRoPE's threshold (0: the model has one set of frequencies)

    @property
    def row_groups_supported(self) -> bool: ...
    @property
    def one_query_supported(self) -> bool: ...
    def open(self, stream_id: int) -> None: ...
    def reset(self, stream_id: int, long_rope: bool = False) -> None: ...
    def close_stream(self, stream_id: int) -> None: ...
    def submit(self, step: Step) -> int: ...
    def collect_any(self, timeout_s: float | None = None) -> StepReply | None: ...
    def rewind(self, stream_id: int, count: int) -> None: ...
    def compact(self, stream_id: int) -> None: ...
    def cancel(self, stream_id: int, request_ids: Sequence[int], keep: int) -> None: ...
    def regroup(self, group_id: int, members: list[int]) -> None: ...
    def abandon_all(self, why: str) -> None: ...
    def timing_summary(self) -> dict[str, dict[str, float]]: ...
    def clear_timings(self) -> None: ...
    @property
    def prefix_cache_supported(self) -> bool: ...
    def save_prefix(self, stream_id: int, entry_id: int, length: int, *,
                    take: bool = False) -> None: ...
    def load_prefix(self, stream_id: int, entry_id: int, length: int, *,
                    take: bool = False) -> None: ...
    def drop_prefix(self, entry_id: int) -> None: ...
    def drop_all_prefixes(self) -> None: ...
    def prefix_bytes(self) -> dict[int, int]: ...


class InlineExecutor:
    """The submit/collect half of ``Executor`` for an executor that computes a step as it is
    submitted: ``submit`` runs ``compute`` and keeps its reply until ``collect_any``.

    Subclasses implement ``compute`` (with ``mask_tail``) and the rest of ``Executor``, and
    call ``drop_answers`` when they reset a stream; ``abandon_all`` drops every reply not
    yet collected. Prefix entries are refused unless a subclass keeps them."""

    row_groups_supported = False  # an executor that can regroup says so
    one_query_supported = False  # one that computes one-query steps says so
    overlaps_steps = False  # a step is computed whole when it is submitted
    paged_attention = False
    prefix_cache_supported = False  # one that keeps prefix entries says so
    wirings = 0  # every stage runs here: never rewired
    rope_short_context = 0  # one set of RoPE frequencies, unless a subclass says otherwise

    def __init__(self) -> None:
        self._request_ids = itertools.count(1)
        self._answered: deque[tuple[int, StepReply]] = deque()  # (stream id, reply)

    def compute(self, step: Step) -> StepReply:
        """The step's reply, computed now (nothing is kept for ``collect_any``)."""
        raise NotImplementedError

    def submit(self, step: Step) -> int:
        """Run the step now; its reply waits for ``collect_any``. Raises what ``compute``
        raises. (``step.guessed`` asks stages that check a pipelined guess to do so:
        nothing to check here, the step is computed whole before the next is submitted.)"""
        reply = self.compute(step)
        reply.request_id = next(self._request_ids)
        self._answered.append((step.stream_id, reply))
        return reply.request_id

    def collect_any(self, timeout_s: float | None = None) -> StepReply | None:
        """The oldest answer not yet collected (None if there is none: nothing waits)."""
        return self._answered.popleft()[1] if self._answered else None

    def drop_requests(self, request_ids: Sequence[int]) -> None:
        """Forget the answers of these requests (cancelled steps)."""
        dropped = set(request_ids)
        if any(reply.request_id in dropped for _, reply in self._answered):
            self._answered = deque(a for a in self._answered if a[1].request_id not in dropped)

    def drop_answers(self, stream_id: int) -> None:
        """Forget the stream's answers not yet collected (its KV was reset)."""
        if any(sid == stream_id for sid, _ in self._answered):
            self._answered = deque(a for a in self._answered if a[0] != stream_id)

    def abandon_all(self, why: str) -> None:
        self._answered.clear()

    def timing_summary(self) -> dict[str, dict[str, float]]:
        return {}

    def clear_timings(self) -> None:
        pass

    def save_prefix(self, stream_id: int, entry_id: int, length: int, *,
                    take: bool = False) -> None:
        raise PrefixCacheUnsupported(f"{type(self).__name__} keeps no prefix cache")

    def load_prefix(self, stream_id: int, entry_id: int, length: int, *,
                    take: bool = False) -> None:
        raise PrefixCacheUnsupported(f"{type(self).__name__} keeps no prefix cache")

    def drop_prefix(self, entry_id: int) -> None:
        """Nothing to drop: no entry is ever held."""

    def drop_all_prefixes(self) -> None:
        """Nothing to drop: no entry is ever held."""

    def prefix_bytes(self) -> dict[int, int]:
        return {}
