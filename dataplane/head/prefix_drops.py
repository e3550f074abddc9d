"""Prefix drops on their way down the chain (pure: the head sends them).

The cluster head applies a prefix op on stage 0 at once, then a PREFIX frame carries it
down the chain, in order with the steps. A drop the chain does not take (it is broken) is
kept and sent before the next save or load, which are refused until it is: a stage never
sees a SAVE or LOAD of an entry ahead of an older drop of it.
"""

from __future__ import annotations

from collections.abc import Callable

from dataplane.wire.prefix_ops import PrefixOp


class PrefixDrops:
    """The drops not sent down the chain yet: entries by id, or every entry (``all``, which
    takes the place of the drops of single entries before it)."""

    def __init__(self) -> None:
        self.entries: frozenset[int] = frozenset()
        self.all = False

    def add(self, entry_id: int) -> None:
        self.entries |= {entry_id}

    def add_all(self) -> None:
        self.entries, self.all = frozenset(), True

    def flush(self, send: Callable[[PrefixOp, int], bool]) -> bool:
        """Send the drops with ``send`` (op, entry id; True when the chain took it): a
        DROP_ALL first, then each entry's in id order, until one is not taken. Whether none
        is left."""
        if self.all and send(PrefixOp.DROP_ALL, 0):
            self.all = False
        for entry_id in sorted(self.entries) if not self.all else ():
            if not send(PrefixOp.DROP, entry_id):
                break
            self.entries -= {entry_id}
        return not (self.all or self.entries)
