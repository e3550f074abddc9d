"""The stage runtime's contract: ``StageRuntime``, what a head, a stage worker and a chain
of stages drive, the ``StageError`` it raises, and the checks of a step's arguments every
runtime applies alike.

``StageRunner`` (dataplane.runtime.stateful: KV as OpenVINO state), ``PagedStageRunner``
(dataplane.runtime.paged: KV in blocks), ``StaticStageRunner`` (dataplane.runtime.static:
the static NPU path, KV on the host) and ``StageChain`` (dataplane.runtime.stage_chain:
consecutive stages as one) are StageRuntimes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from zctl.manifest import ExportManifest, StageSpec

if TYPE_CHECKING:
    import openvino as ov


class StageError(RuntimeError):
    """A stage cannot be loaded, or a step's inputs do not fit it."""


class StreamKV(Protocol):
    """A stream's KV bookkeeping on a stage, as others read it."""

    @property
    def physical(self) -> int:
        """KV slots the stream holds (kept or masked)."""

    @property
    def held(self) -> int:
        """KV slots it holds, averaged over its stage's layers (a sliding layer may hold
        fewer than the others): what a stage reports in its status."""


class RowGroupKV(Protocol):
    """A row group's KV bookkeeping on a stage, as others read it."""

    @property
    def members(self) -> list[int]:
        """The rows' stream ids, in row order."""

    @property
    def keep(self) -> np.ndarray:
        """The rows' slot tables, bool [rows, slots]."""

    @property
    def held(self) -> int:
        """KV slots its rows hold, averaged over its stage's layers (as StreamKV.held)."""


class StageRuntime(Protocol):
    """One stage of an export (or consecutive stages run as one) and the KV of every stream
    it serves.

    Streams are opened, reset (their KV forgotten) and closed (freed), and step alone;
    where ``row_groups_supported``, ``regroup`` makes streams the rows of a row group that
    steps them in one inference (``step_rows``; where ``paged_attention``, rows of
    different token counts too: ``step_ragged``). ``prepare`` binds a step's inputs but x
    ahead of ``run``, so the stages of a chain can be bound before any runs; ``prefetch``
    binds a stream's likely next step while the stage is idle. Where
    ``one_query_supported``, a step may be ``one_query``: each of its tokens is computed
    as a sequence of one token after its row's tokens before it, exactly as that many
    decode steps compute them (a verification step: the last token and K drafts; a
    replay of emitted tokens); elsewhere such a step raises StageError. A rewind drops a stream's
    last tokens: a step's own (``mask_step_tail``: a stream's count, or a row group's one
    per row), to a length (``truncate``, a cancel's), by mask (``mask_tail``, cheap: the
    slots stay, ``compact`` drops them once ``compaction_due``) or by trimming the state
    (``trim_tail``). Where ``prefix_cache_supported``, prefix entries keep the KV of a
    stream's first tokens by id for streams that start alike (``save_prefix``,
    ``load_prefix``, ``drop_prefix``, ``drop_all_prefixes``); elsewhere saves and loads
    raise StageError. Anything a runtime refuses raises StageError and leaves its streams
    as they were, unless a method says otherwise.
    """

    spec: StageSpec  # the stage (a chain's: its first stage's index, every stage's layers)
    manifest: ExportManifest
    hidden_size: int
    paged_attention: bool  # KV in blocks: a row group's step may be ragged
    row_groups_supported: bool  # streams can be batched as rows (not a static export's)
    prefix_cache_supported: bool  # prefix entries are kept (not a static export's)
    one_query_supported: bool  # a step's tokens can be one-query sequences (paged stages)

    @property
    def streams(self) -> Mapping[int, StreamKV]:
        """The streams stepped alone, by id (a row group's members are its rows)."""

    @property
    def groups(self) -> Mapping[int, RowGroupKV]:
        """The row groups, by id."""

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's KV costs here, in bytes."""

    # -- streams -------------------------------------------------------------------------
    def warm_up(self, stream_id: int = -1) -> None:
        """Step a scratch stream ``stream_id`` and drop it, so the first real request does not
        pay the plugin's first-inference costs."""

    def open_stream(self, stream_id: int) -> object:
        """Open the stream (an open one stays as it is)."""

    def reset_stream(self, stream_id: int, long_rope: bool = False) -> None:
        """Forget the stream's KV (opening it if need be) and begin a new sequence on it:
        ``long_rope``, one turning with LongRoPE's long set throughout (its prompt is longer
        than the model's threshold; StageError on a model with one set)."""

    def close_stream(self, stream_id: int) -> None:
        """Free the stream, or the row group ``stream_id`` and its rows (unknown: no error)."""

    def check_input(self, x: np.ndarray, positions: np.ndarray) -> None:
        """Raise StageError unless x and positions have the shapes a stream's step takes."""

    # -- stepping ------------------------------------------------------------------------
    def step(self, stream_id: int, x: np.ndarray, positions: np.ndarray,
             logits_idx: np.ndarray | None = None, one_query: bool = False) -> np.ndarray:
        """One step of a stream: x token ids [1, T] (the first stage) or hidden states
        [1, T, H], ``positions`` [T] logical; returns hidden states [1, T, H] or, on the
        last stage, logits [1, K, V] of the ``logits_idx`` tokens (default: the last). The
        result is a view, valid until the stream's next step. ``one_query``: each token
        its own query (StageError unless ``one_query_supported``)."""

    def step_rows(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                  logits_idx: np.ndarray | None = None, one_query: bool = False
                  ) -> np.ndarray:
        """One step of every row of a group: x [rows, T] or [rows, T, H], positions
        [rows, T]; returns [rows, T, H] or logits [rows, K, V] (a view)."""

    def step_ragged(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                    row_tokens: np.ndarray, logits_idx: np.ndarray | None = None,
                    one_query: bool = False) -> np.ndarray:
        """One step of every row of a group, row i stepping ``row_tokens[i]`` tokens, one
        row's after another: x [1, N] or [1, N, H], positions [N]; ``logits_idx`` indexes
        the N tokens (None: every row's last). StageError unless ``paged_attention``."""

    def prepare(self, stream_id: int, positions: np.ndarray,
                logits_idx: np.ndarray | None = None, inputs: Any = None,
                row_tokens: np.ndarray | None = None, one_query: bool = False) -> Any:
        """Bind every input of a stream's (or row group's) next step but x: ``positions``
        [rows, T], or with ``row_tokens`` (ragged rows) the rows' positions one after the
        other; ``one_query``: every token a query of its own. ``inputs``, the step an
        earlier stage of a chain prepared, may be reused. Returns the prepared step, for
        ``run`` (and the next stage's ``prepare``)."""

    def run(self, stream_id: int, x: np.ndarray | ov.Tensor, step: Any) -> ov.Tensor:
        """Run the step ``prepare`` bound on x (token ids, hidden states, or the previous
        stage's output tensor as it is); returns the output tensor, valid until the stream's
        next step."""

    def prefetch(self, stream_id: int) -> bool:
        """Bind the stream's (or row group's) likely next step while the stage is idle;
        whether anything was bound."""

    # -- row groups ------------------------------------------------------------------------
    def regroup(self, group_id: int, members: list[int]) -> None:
        """Make ``group_id`` the row group of ``members`` (open streams, or its rows), in that
        row order; rows not listed any more are dropped, no members disbands it."""

    def row_of(self, stream_id: int) -> tuple[int, int] | None:
        """(group id, row) of the row group the stream is a row of, if any."""

    # -- rewinds ---------------------------------------------------------------------------
    def mask_step_tail(self, stream_id: int, mask_tail: int | np.ndarray) -> bool:
        """The rewind a step carries: a row group's rows by their own counts, a stream by
        one count. Whether anything was rewound."""

    def truncate(self, stream_id: int, length: int) -> bool:
        """Rewind the stream to its first ``length`` logical tokens (it may hold that many
        already). Whether anything was rewound; StageError if it holds fewer."""

    def mask_tail(self, stream_id: int, count: int) -> None:
        """Drop the stream's last ``count`` tokens by mask (the slots stay until compacted)."""

    def trim_tail(self, stream_id: int, count: int) -> None:
        """Drop the stream's last ``count`` physical slots from its state."""

    def masked_slots(self, stream_id: int) -> int:
        """The slots of a stream (or row group) that compaction would free."""

    def compaction_due(self, stream_id: int, threshold: int | None) -> bool:
        """Whether the stream (or row group) has more than ``threshold`` masked slots (None:
        never)."""

    def compact(self, stream_id: int) -> int:
        """Drop the stream's masked slots; how many went."""

    # -- prefix entries ----------------------------------------------------------------------
    def save_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False
                    ) -> None:
        """Keep the first ``length`` logical KV slots of the stream (alone, or a row of a row
        group) as entry ``entry_id``, replacing one of that id; ``take`` (a stream alone):
        the stream's own KV becomes the entry and the stream is closed."""

    def load_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False
                    ) -> None:
        """Give an open stream stepped alone entry ``entry_id``'s first ``length`` slots: its
        next step continues at position ``length``; ``take`` moves the entry to it."""

    def drop_prefix(self, entry_id: int) -> None:
        """Free entry ``entry_id`` (unknown: no error)."""

    def drop_all_prefixes(self) -> None:
        """Free every entry."""

    def prefix_bytes(self) -> int:
        """Bytes the prefix entries hold (safe to call from another thread)."""


def check_step_input(spec: StageSpec, hidden_size: int, x: np.ndarray,
                     positions: np.ndarray) -> None:
    """Raise StageError unless x and positions have the shapes a stream step of ``spec``
    takes: int token ids [1, T] on the first stage, float32 [1, T, hidden] after it."""
    if spec.first:
        if x.ndim != 2 or x.dtype.kind not in "iu":  # (np.issubdtype costs more, per step)
            raise StageError(f"stage 0 takes int token ids [batch, tokens], got {x.dtype} {x.shape}")
    elif x.ndim != 3 or x.shape[2] != hidden_size or x.dtype != np.float32:
        raise StageError(
            f"stage {spec.index} takes float32 hidden states [batch, tokens, "
            f"{hidden_size}], got {x.dtype} {x.shape}"
        )
    if x.shape[0] != 1 or x.shape[1] < 1:
        raise StageError(f"a stream step takes batch 1 and at least one token, got {x.shape}")
    if positions.shape != (x.shape[1],):
        raise StageError(f"positions shape {positions.shape} does not match {x.shape[1]} tokens")


def check_rows_step(group_id: int, rows: int, x: np.ndarray, positions: np.ndarray) -> None:
    """Raise StageError unless x and positions have a ``rows``-row group step's shapes:
    x [rows, T] or [rows, T, H], positions [rows, T]."""
    if x.ndim < 2 or x.shape[0] != rows or positions.shape != x.shape[:2]:
        raise StageError(f"row group {group_id} has {rows} rows: it takes x [{rows}, T, ...] "
                         f"and positions [{rows}, T], got {x.shape} and {positions.shape}")


def check_ragged_step(group_id: int, rows: int, x: np.ndarray, positions: np.ndarray,
                      row_tokens: np.ndarray) -> np.ndarray:
    """The rows' token counts of a ragged step, checked: StageError unless there is one
    positive count per row, they add up to the step's positions [N], and x is [1, N] or
    [1, N, H]."""
    counts = np.asarray(row_tokens, dtype=np.int64).reshape(-1)
    if counts.size != rows or (counts.size and int(counts.min()) < 1):
        raise StageError(f"row group {group_id} has {rows} rows: a ragged step needs one "
                         f"positive token count per row, got {counts.tolist()}")
    total = int(counts.sum())
    if positions.shape != (total,) or x.ndim < 2 or x.shape[:2] != (1, total):
        raise StageError(f"a ragged step of rows {counts.tolist()} takes x [1, {total}, ...] and "
                         f"positions [{total}], got {x.shape} and {positions.shape}")
    return counts


def check_row_rewinds(group_id: int, counts: np.ndarray, held: Sequence[int]) -> np.ndarray:
    """The per-row rewind counts as int64, checked against the tokens each row ``held``:
    StageError unless there is one count per row, each in 0..held."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    if counts.size != len(held):
        raise StageError(f"row group {group_id} has {len(held)} rows, got {counts.size} "
                         "rewinds")
    if any(not 0 <= c <= h for c, h in zip(counts, held, strict=True)):
        raise StageError(f"cannot rewind rows by {counts.tolist()}: they hold "
                         f"{list(held)} tokens")
    return counts


def one_query_needs_paged_attention() -> StageError:
    """What a stage that cannot compute a step's tokens as one-query sequences raises."""
    return StageError("a one-query step (each token a query of its own, as single decode "
                      "steps compute them) needs paged attention on every stage; this stage "
                      "keeps its KV as state or on the host")


def ragged_needs_paged_attention() -> StageError:
    """What a stage without paged attention raises for ragged rows."""
    return StageError("ragged rows (rows of different token counts) need paged attention on "
                      "every stage; this stage runs stateful KV")
