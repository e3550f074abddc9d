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


@dataclass
class StreamSlots:
    """Per-stream KV bookkeeping: keep[i] is False for masked (rewound) physical slots."""

    request: ov.InferRequest
    keep: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # Tensors bound to the request over numpy memory: an ov.Tensor does not keep that memory
    # alive for the request, so they are held here until the next step binds new ones.
    bound: list[ov.Tensor] = field(default_factory=list)
    last: StepInputs | None = None  # the inputs of the last step run
    prefetched: StepInputs | None = None  # inputs bound ahead for the guessed next step

    @property
    def physical(self) -> int:
        return int(self.keep.shape[0])

    @property
    def logical(self) -> int:
        return int(self.keep.sum())


@dataclass
class RowGroup:
    """Streams stepped together as the rows of one request: ``members[r]`` is row r's
    stream id and ``keep[r]`` its slot table (rows share the slot count)."""

    request: ov.InferRequest
    members: list[int]
    keep: np.ndarray  # bool [rows, slots]
    bound: list[ov.Tensor] = field(default_factory=list)  # as StreamSlots.bound
    last: StepInputs | None = None  # as StreamSlots.last
    prefetched: StepInputs | None = None


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


def shared_tensor(array: np.ndarray) -> ov.Tensor:
    """An ov.Tensor over the array's memory (a copy if it is not contiguous or writeable, as
    the arrays of a received frame are)."""
    if not array.flags.writeable:
        array = array.copy()
    return ov.Tensor(np.ascontiguousarray(array), shared_memory=True)
