"""KV blocks of a paged stage (pure: no inference): the allocator and per-sequence tables.

A paged stage keeps every sequence's KV in fixed-size blocks of one shared cache (as
vLLM and openvino_genai do): a sequence is a block table plus a length. Rewinding a
sequence only shortens it (its later slots are written over); a cached prefix shares
its blocks with the streams that start with it, reference-counted, and a block is
copied before a sequence writes into one it shares (copy-on-write).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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


@dataclass
class PagedSequence:
    """One stream's KV: ``blocks`` hold its ``length`` tokens (slot i is block i // size)."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0

    # the slot-table interface of the other runners (held_slots, stats)
    @property
    def physical(self) -> int:
        return self.length

    @property
    def logical(self) -> int:
        return self.length

    @property
    def keep(self) -> np.ndarray:
        return np.ones(self.length, dtype=bool)


@dataclass(frozen=True)
class PrefixBlocks:
    """A stored prefix: the first ``length`` tokens' KV in ``blocks`` (each retained)."""

    blocks: list[int]
    length: int
