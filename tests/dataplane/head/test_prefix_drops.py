"""PrefixDrops: the drops the chain has not taken yet go down in order, a DROP_ALL first,
and stay until taken."""

from __future__ import annotations

from dataplane.head.prefix_drops import PrefixDrops
from dataplane.wire.prefix_ops import PrefixOp


class Chain:
    """Takes drops until ``broken``; records what it took."""

    def __init__(self) -> None:
        self.broken = False
        self.taken: list[tuple[PrefixOp, int]] = []

    def send(self, op: PrefixOp, entry_id: int) -> bool:
        if self.broken:
            return False
        self.taken.append((op, entry_id))
        return True


def test_drops_go_in_id_order_and_wait_while_the_chain_is_broken() -> None:
    drops, chain = PrefixDrops(), Chain()
    assert drops.flush(chain.send) and chain.taken == []  # nothing to send
    chain.broken = True
    for entry_id in (5, 2, 9):
        drops.add(entry_id)
    assert not drops.flush(chain.send) and drops.entries == {2, 5, 9}
    chain.broken = False
    assert drops.flush(chain.send)
    assert chain.taken == [(PrefixOp.DROP, 2), (PrefixOp.DROP, 5), (PrefixOp.DROP, 9)]
    assert not drops.entries and not drops.all


def test_a_drop_all_goes_first_and_replaces_the_drops_before_it() -> None:
    drops, chain = PrefixDrops(), Chain()
    chain.broken = True
    drops.add(3)
    drops.add_all()
    drops.add(7)  # dropped after the DROP_ALL: sent after it
    assert not drops.flush(chain.send) and drops.all and drops.entries == {7}
    chain.broken = False
    assert drops.flush(chain.send)
    assert chain.taken == [(PrefixOp.DROP_ALL, 0), (PrefixOp.DROP, 7)]


def test_a_flush_stops_at_the_first_drop_not_taken() -> None:
    drops, chain = PrefixDrops(), Chain()
    for entry_id in (1, 2, 3):
        drops.add(entry_id)

    def take_one(op: PrefixOp, entry_id: int) -> bool:
        chain.broken = bool(chain.taken)  # the chain breaks after the first
        return chain.send(op, entry_id)

    assert not drops.flush(take_one)
    assert chain.taken == [(PrefixOp.DROP, 1)] and drops.entries == {2, 3}
