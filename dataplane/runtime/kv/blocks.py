"""KV blocks of a paged stage (pure: no inference): the allocator and per-sequence tables.

A paged stage keeps every sequence's KV in fixed-size blocks of one shared cache (as
vLLM and openvino_genai do): a sequence is a block table plus a length. Rewinding a
sequence only shortens it (its later slots are written over); a cached prefix shares
its blocks with the streams that start with it, reference-counted, and a block is
copied before a sequence writes into one it shares (copy-on-write).

A stage whose layers include sliding-window ones (Gemma 3) keeps their KV in blocks of a
pool of their own, and a sequence a second table for them (``window_blocks``): the blocks
of its last ``window + margin`` tokens (``SlidingWindow``), the earlier ones freed as the
sequence grows. Its table as PagedAttention reads it is as long as the global layers'
(the two share ``block_indices_begins``), the freed blocks' entries pointing to a block
that is never written (``window_table``): the kernel gives the keys outside a query's
window a weight of 0, so what a freed entry points at never counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.sliding_states import SlidingStates, window_kept_tokens
from zctl.manifest import ModelSpec


class BlockPool:
    """Block ids 0..capacity-1, each with a reference count; ``grow`` adds ids."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a block pool needs at least one block")
        self.refs = np.zeros(capacity, dtype=np.int64)
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest id

    @property
    def capacity(self) -> int:
        return int(self.refs.size)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        old = self.capacity
        self.refs = np.concatenate([self.refs, np.zeros(capacity - old, dtype=np.int64)])
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free

    def alloc(self) -> int | None:
        """A free block (reference count 1), or None if there is none."""
        if not self._free:
            return None
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def retain(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refs[block] < 1:
                raise ValueError(f"block {block} is not in use")
            self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refs[block] < 1:
                raise ValueError(f"block {block} released more often than held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free.append(block)

    def shared(self, block: int) -> bool:
        return bool(self.refs[block] > 1)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class SlidingWindow:
    """What a sliding layer of ``window`` keys (a query's latest, itself included) keeps in
    blocks of ``block_size``: every block holding one of a sequence's last ``window - 1 +
    margin`` tokens, so a rewind of up to ``margin`` tokens finds the window of the query
    after it whole (``margin``: the deepest rewind the engine asks for)."""

    window: int
    margin: int
    block_size: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.margin < 0 or self.block_size < 1:
            raise ValueError(f"a sliding window of at least 1 key, a margin >= 0 and blocks "
                             f"of at least 1 slot, not {self.window}, {self.margin}, "
                             f"{self.block_size}")

    def needed_from(self, length: int) -> int:
        """The first block a sequence of ``length`` tokens needs to go on: its next query
        (position ``length``) sees the keys from ``length - window + 1``."""
        return max(0, length - self.window + 1) // self.block_size

    def kept_from(self, length: int) -> int:
        """The first block a sequence of ``length`` tokens keeps: the block needed after a
        rewind of ``margin`` tokens."""
        return self.needed_from(max(0, length - self.margin))

    def blocks_bound(self, tokens: int) -> int:
        """The most blocks a sequence holds for its sliding layers while a step writes
        ``tokens`` more: its kept tokens and the step's, over block edges."""
        return blocks_for(window_kept_tokens(self.window, self.margin) + tokens,
                          self.block_size) + 1


@dataclass(frozen=True)
class KvLayout:
    """How a paged stage keeps its layers' KV: in blocks of ``block_size`` slots, ``sliding``
    of its ``layers`` layers sliding (they free the blocks before their window:
    ``SlidingWindow``)."""

    block_size: int
    layers: int
    sliding: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.layers < 1 or not 0 <= self.sliding <= self.layers:
            raise ValueError(f"a KV layout needs blocks of at least 1 slot, at least 1 layer "
                             f"and 0 to {self.layers} sliding ones, not {self.block_size}, "
                             f"{self.layers}, {self.sliding}")

    def held_slots(self, length: int, window_first: int) -> int:
        """KV slots a sequence of ``length`` tokens holds, averaged over the layers: the
        slots of the blocks before table entry ``window_first``, which its sliding layers
        freed, not counted."""
        freed = min(length, window_first * self.block_size)
        return length - round(self.sliding / self.layers * freed)


@dataclass
class PagedSequence:
    """One stream's KV on a stage laid out as ``layout``: ``blocks`` hold its ``length``
    tokens (slot i is block i // size); on a stage with sliding layers, ``window_blocks``
    hold theirs from table entry ``window_first`` on (the entries before it are freed)."""

    layout: KvLayout
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    window_blocks: list[int] = field(default_factory=list)
    window_first: int = 0

    # the slot-table interface of the other runners (held_slots, stats)
    @property
    def physical(self) -> int:
        return self.length

    @property
    def held(self) -> int:
        """KV slots it holds, averaged over its stage's layers (``KvLayout.held_slots``)."""
        return self.layout.held_slots(self.length, self.window_first)

    @property
    def logical(self) -> int:
        return self.length

    @property
    def keep(self) -> np.ndarray:
        return np.ones(self.length, dtype=bool)


def window_table(seq: PagedSequence, entries: int, freed: int) -> list[int]:
    """The sliding layers' first ``entries`` table entries of ``seq``: block ``freed`` for
    each entry whose block was freed, then its kept blocks."""
    first = min(seq.window_first, entries)
    return [freed] * first + seq.window_blocks[:entries - first]


@dataclass(frozen=True)
class PrefixBlocks:
    """A stored prefix: the first ``length`` tokens' KV in ``blocks`` (each retained), and
    its sliding layers' kept blocks from table entry ``window_first`` on."""

    blocks: list[int]
    length: int
    window_blocks: list[int] = field(default_factory=list)
    window_first: int = 0


CPU_BLOCK_TOKENS = 32  # a KV block of the CPU plugin's PagedAttention, in tokens


def sliding_tokens(spec: RuntimeSpec | None, model: ModelSpec) -> int | None:
    """The most tokens of a stream a sliding layer of ``model`` holds on stages compiled as
    ``spec``: on paged stages its window, margin and a step's token over block edges
    (``SlidingWindow.blocks_bound``); on stateful ones its window, margin, slack and a
    step's token (``SlidingStates.bound``) where the export's graphs let its state be
    trimmed; None where it holds every token (an export made before, no sliding layer, or
    ``spec`` not known)."""
    window = model.sliding_window
    if spec is None or window < 1 or not model.sliding_layers:
        return None
    if spec.paged_attention:
        return SlidingWindow(window, spec.sliding_margin, CPU_BLOCK_TOKENS).blocks_bound(1) * \
            CPU_BLOCK_TOKENS
    if not model.sliding_kv_trimmable:
        return None
    return SlidingStates(frozenset(model.sliding_layers), window, spec.sliding_margin,
                         spec.sliding_slack).bound(1)
