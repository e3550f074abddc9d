"""What a stage keeps per stream and per step: slot tables, row groups, bound step inputs.

Plain data (no inference): ``StreamSlots`` is a stream's InferRequest and slot table,
``RowGroup`` several streams stepped as the rows of one request, ``StepInputs`` the
host-built inputs of one step (RoPE tables, attention mask, beam_idx), shared by the
stages of a chain and bound ahead of time by ``StageRunner.prefetch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import openvino as ov

from dataplane.runtime.base import StageRuntime


class SlotCounts:
    """``physical`` and ``logical`` slot counts of a record holding a ``keep`` slot table (the
    base of a stateful stream's ``StreamSlots`` and a static one's ``HostKV``)."""

    keep: np.ndarray

    @property
    def physical(self) -> int:
        return int(self.keep.shape[0])

    @property
    def logical(self) -> int:
        return int(self.keep.sum())

    @property
    def held(self) -> int:
        """KV slots it holds, averaged over its stage's layers (what status reports):
        every layer holds the whole table here."""
        return self.physical


@dataclass
class StreamSlots(SlotCounts):
    """Per-stream KV bookkeeping: keep[i] is False for masked (rewound) physical slots."""

    request: ov.InferRequest
    keep: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # on a stage whose sliding layers' states are trimmed (kv.sliding_states): the slot
    # those states begin at, and the first tokens whose keys they lack
    sliding_start: int = 0
    sliding_gone: int = 0
    # the share of its stage's layers that slide (0: none, or their states keep every slot)
    sliding_share: float = 0.0
    # Tensors bound to the request, by input name. Some are over numpy memory, which an
    # ov.Tensor does not keep alive for the request: they are held here until replaced.
    # A name whose tensor is already bound is not bound again.
    bound: dict[str, ov.Tensor] = field(default_factory=dict)
    last: StepInputs | None = None  # the inputs of the last step run
    prefetched: StepInputs | None = None  # inputs bound ahead for the guessed next step
    decode: DecodeBuffers | None = None  # the one-token steps' input tensors, made on first use
    output: StepOutput | None = None  # the tensor the request writes its output to

    @property
    def held(self) -> int:
        """KV slots it holds, averaged over its stage's layers: the slots before the
        sliding start, which its sliding layers' states no longer hold, not counted."""
        return held_by_layers(self.physical, self.sliding_start, self.sliding_share)


@dataclass
class RowGroup:
    """Streams stepped together as the rows of one request: ``members[r]`` is row r's
    stream id and ``keep[r]`` its slot table (rows share the slot count)."""

    request: ov.InferRequest
    members: list[int]
    keep: np.ndarray  # bool [rows, slots]
    sliding_start: int = 0  # as StreamSlots'; the rows share it
    sliding_gone: np.ndarray | None = None  # each row's (None: no row lacks any)
    sliding_share: float = 0.0  # as StreamSlots'
    bound: dict[str, ov.Tensor] = field(default_factory=dict)  # as StreamSlots.bound
    last: StepInputs | None = None  # as StreamSlots.last
    prefetched: StepInputs | None = None
    decode: DecodeBuffers | None = None  # one-row groups only (as StreamSlots.decode)
    output: StepOutput | None = None  # as StreamSlots.output

    @property
    def held(self) -> int:
        """KV slots its rows hold, averaged over its stage's layers (as StreamSlots.held)."""
        rows, slots = self.keep.shape
        return rows * held_by_layers(slots, self.sliding_start, self.sliding_share)


def held_by_layers(slots: int, sliding_start: int, sliding_share: float) -> int:
    """The KV slots a table of ``slots`` slots holds averaged over its stage's layers, when
    a ``sliding_share`` of them (the sliding layers) hold only the slots from
    ``sliding_start`` on."""
    return slots - round(sliding_share * min(sliding_start, slots))


@dataclass(frozen=True)
class StepInputs:
    """One step's host-built inputs besides x: RoPE tables, attention mask, beam_idx.

    They depend only on the positions and the slot table(s), so the stages of a chain
    whose tables agree build them once and share them (``StageRunner.prepare``).
    """

    positions: np.ndarray  # int64 [rows, T]
    keep: np.ndarray  # the slot table(s) the mask was built from
    after: np.ndarray  # the slot table(s) once the step ran (shared: never written in place)
    attention_mask: ov.Tensor
    rope_cos: ov.Tensor
    rope_sin: ov.Tensor
    beam_idx: ov.Tensor

    def fits(self, positions: np.ndarray, keep: np.ndarray) -> bool:
        """True when these inputs are the ones ``positions`` over ``keep`` would give."""
        return (self.positions.shape == positions.shape and np.array_equal(self.positions, positions)
                and (self.keep is keep or (self.keep.shape == keep.shape
                                           and np.array_equal(self.keep, keep))))


class StepOutput:
    """An output tensor bound to a request once, and a numpy view of it kept across steps.

    ``get_output_tensor`` and ``.data`` are pybind calls that cost ~70 us right after an
    inference (cold caches). The plugin writes every step's output into this tensor,
    resizing it when a step's output shape differs (which may move its memory), so the
    view is taken again whenever the shape changes and reused while it does not. Like a
    request's own output, it is valid until the target's next step.
    """

    def __init__(self, element_type: ov.Type, last_dim: int) -> None:
        self.tensor = ov.Tensor(element_type, [1, 1, last_dim])
        self.tensor_dim = last_dim
        self._view: np.ndarray = self.tensor.data

    def view(self, shape: tuple[int, int, int]) -> np.ndarray:
        """The output of the step just run, whose shape is ``shape``."""
        if self._view.shape != shape:
            self._view = self.tensor.data
        return self._view


class DecodeBuffers:
    """The input tensors of a one-row target's one-token steps, written in place.

    Right after an inference the host path runs with cold caches, where every fresh
    ov.Tensor and every set_tensor costs tens of microseconds. A decode step instead
    writes its RoPE row into ``rope_cos``/``rope_sin`` and its mask into ``attention_mask``,
    which stay bound to the request: the mask is a capacity buffer kept in sync with the
    slot table it was last written for (``source``, by identity: slot tables are replaced,
    never written in place) and reshaped to the step's slot count, so a step only appends
    the new slot's 0. The tensors own their memory: whoever holds one keeps it valid.
    A target's buffers hold one step at a time: a step's inputs are valid until the
    target's next step (or prefetch) is built, as a request's output is.
    """

    INITIAL_CAPACITY = 256  # mask slots; doubles when a stream outgrows it

    def __init__(self, head_dim: int, capacity: int | None = None) -> None:
        self.rope_cos = ov.Tensor(ov.Type.f32, [1, 1, head_dim])
        self.rope_sin = ov.Tensor(ov.Type.f32, [1, 1, head_dim])
        self.cos = self.rope_cos.data.reshape(-1)  # flat views, written by RopeRows.into
        self.sin = self.rope_sin.data.reshape(-1)
        self.source: np.ndarray | None = None
        self.input: ov.Tensor | None = None  # x of the last step (see input_from)
        self._input_view = np.zeros(0)
        self._allocate(capacity or self.INITIAL_CAPACITY)

    def _allocate(self, capacity: int) -> None:
        self.attention_mask = ov.Tensor(ov.Type.f32, [1, 1, 1, capacity])
        self.mask = self.attention_mask.data.reshape(-1)
        self.capacity = capacity

    def input_from(self, x: np.ndarray) -> ov.Tensor:
        """``x`` copied into a tensor kept for steps of its shape and dtype (a received
        frame's payload is read-only: it is copied either way)."""
        if self._input_view.shape != x.shape or self._input_view.dtype != x.dtype:
            self.input = ov.Tensor(np.array(x))  # owns a copy of its own
            self._input_view = self.input.data
        else:
            np.copyto(self._input_view, x)
        return self.input

    def mask_after(self, keep: np.ndarray, after: np.ndarray, mask_min: np.float32) -> ov.Tensor:
        """The [1, 1, 1, slots + 1] mask of a one-token step over the one-row slot table
        ``keep`` ([slots] or [1, slots]); ``after`` is that table once the step ran."""
        slots = keep.shape[-1]
        if slots + 1 > self.capacity:
            # the old tensor owns the old view's memory: hold it through the copy
            old_tensor, old, synced = self.attention_mask, self.mask, self.source is keep
            self._allocate(max(2 * self.capacity, slots + 1))
            if synced:
                self.mask[:slots] = old[:slots]
            del old_tensor
        elif self.source is not keep:
            synced = False
        else:
            synced = True
        if not synced:
            np.copyto(self.mask[:slots], np.where(keep.reshape(-1), np.float32(0.0), mask_min))
        self.mask[slots] = 0.0
        self.source = after
        self.attention_mask.shape = [1, 1, 1, slots + 1]
        return self.attention_mask


def shared_tensor(array: np.ndarray) -> ov.Tensor:
    """An ov.Tensor over the array's memory (a copy if it is not contiguous or writeable, as
    the arrays of a received frame are)."""
    if not array.flags.writeable:
        array = array.copy()
    return ov.Tensor(np.ascontiguousarray(array), shared_memory=True)


def request_states(request: ov.InferRequest) -> dict[str, np.ndarray]:
    """A request's KV state tensors by variable name (the CPU plugin hands out copies; treat
    them as views, valid until the request's next step)."""
    return {state.name: state.state.data for state in request.query_state()}


def held_slots(runner: StageRuntime) -> int:
    """KV slots a stage runner holds now, averaged over its layers: every stream's, and
    every row group's rows x slots, without those its sliding layers dropped. Safe to call
    from a thread other than the one stepping it (the tables are copied first; a table that
    changed meanwhile is read again); -1 if it kept changing."""
    for _ in range(8):
        try:
            streams = list(runner.streams.values())
            groups = list(runner.groups.values())
        except RuntimeError:  # changed size while being copied
            continue
        return sum(s.held for s in streams) + sum(g.held for g in groups)
    return -1
