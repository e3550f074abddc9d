"""The coordinator's figures of the pipeline's links, and the probes that measure them.

No sockets: once the pipeline serves a new wiring (an epoch), each link between
neighbours of the chain (stage 0's node to the next, ..., the last back to stage 0's) is
probed once by its first node, ``a``, against the echo of the second, ``b``
(controlplane/link_probe.py): the coordinator probes its own links, and asks a node with
``LinkProbe`` to probe its. The coordinator also probes its link to each spare (a node
that runs no stage) once, so that a plan can weigh every node. A link keeps its last
figures until measured again; a probe whose report does not come within its deadline
leaves the link with an error saying so (and the figures it had). The frames probed are
those the model sends: hidden states of one row and of eight, and a prompt's chunk of 128
and of 1,024 tokens, as far as the link carries each quickly (a slow link's probe leaves
out the frames that would hold it long: link_probe.MESSAGE_BUDGET_S).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from controlplane.link_probe import MAX_PROBE_BYTES
from controlplane.planner.profile import LinkProfile
from controlplane.planner.shape import ModelShape
from controlplane.planner.timing import step_frame_bytes
from controlplane.records import LinkStatus

PROBE_FRAMES = ((1, 1), (8, 1), (1, 128), (1, 1024))  # (rows, tokens) of the frames probed
PROBE_ROUNDS = 5
PROBE_TIMEOUT_S = 5.0  # for one round trip
REPORT_GRACE_S = 10.0  # beyond the probe's own time, before a missing report is an error


def probe_sizes(shape: ModelShape) -> list[int]:
    """The frame sizes a link of ``shape``'s pipeline is probed at."""
    return sorted({min(MAX_PROBE_BYTES, step_frame_bytes(shape, rows, tokens, 0))
                   for rows, tokens in PROBE_FRAMES})


@dataclass(frozen=True)
class Probe:
    """A probe to run: ``a`` times round trips to ``b``'s echo at ``b_addr``."""

    probe_id: int
    a: str
    b: str
    b_addr: str


def chain_links(chain: Sequence[str]) -> list[tuple[str, str]]:
    """The links of a chain of nodes (stage order), the last back to the first."""
    if len(chain) < 2:
        return []
    return [(chain[i], chain[(i + 1) % len(chain)]) for i in range(len(chain))]


class LinkTable:
    """Each link's figures (by its ordered pair) and the probes under way."""

    def __init__(self, rounds: int = PROBE_ROUNDS, timeout_s: float = PROBE_TIMEOUT_S,
                 grace_s: float = REPORT_GRACE_S) -> None:
        self.rounds, self.timeout_s, self.grace_s = rounds, timeout_s, grace_s
        self.links: dict[tuple[str, str], LinkStatus] = {}
        self.probed_epoch = -1
        self._pending: dict[int, tuple[Probe, float]] = {}  # probe id -> (probe, deadline)
        self._next_id = 1

    def deadline_s(self, sizes: Sequence[int]) -> float:
        """How long a probe of ``sizes`` may take before its missing report is an error."""
        return self.rounds * (2 * len(sizes) + 1) * self.timeout_s + self.grace_s

    def due(self, epoch: int, chain: Sequence[str], addrs: dict[str, str], sizes: list[int],
            now: float, refused: str = "", spares: Sequence[str] = ()) -> list[Probe]:
        """The probes to start: for the wiring of ``epoch`` (once per epoch) one per link of
        ``chain``, and one from the chain's first node to each of ``spares`` not probed yet.
        A node without a probe endpoint, or ``refused`` (why none may run), leaves its link
        with that error."""
        pairs = [(chain[0], spare) for spare in spares
                 if chain and (chain[0], spare) not in self.links]
        if epoch != self.probed_epoch:
            self.probed_epoch = epoch
            self._pending.clear()
            pairs = chain_links(chain) + pairs
        probes = []
        for a, b in pairs:
            old = self.links.get((a, b), LinkStatus(a, b))
            why = refused or ("" if addrs.get(b) else f"node {b} has no probe endpoint")
            if why:
                self.links[(a, b)] = replace(old, error=why)
                continue
            probe = Probe(self._next_id, a, b, addrs[b])
            self._next_id += 1
            self._pending[probe.probe_id] = (probe, now + self.deadline_s(sizes))
            self.links[(a, b)] = replace(old, frame_bytes=list(sizes),
                                         error="" if old.measured_at else "probing")
            probes.append(probe)
        return probes

    def result(self, probe_id: int, reporter: str, figures: LinkProfile | None,
               error: str = "") -> bool:
        """A probe's outcome from ``reporter`` (its ``a``); False when no such probe of
        that node is under way (a late or foreign report, ignored)."""
        pending = self._pending.get(probe_id)
        if pending is None or pending[0].a != reporter:
            return False
        probe, _ = self._pending.pop(probe_id)
        old = self.links[(probe.a, probe.b)]
        if figures is None:
            self.links[(probe.a, probe.b)] = replace(old, error=error or "the probe failed")
        else:
            self.links[(probe.a, probe.b)] = replace(
                old, rtt_s=figures.rtt_s, forward_bps=figures.forward_bps,
                backward_bps=figures.backward_bps, measured_at=time.time(), error="")
        return True

    def expire(self, now: float) -> None:
        """Probes whose report is overdue: their links say so."""
        for probe_id, (probe, deadline) in list(self._pending.items()):
            if now > deadline:
                self.result(probe_id, probe.a, None,
                            f"node {probe.a} did not report its probe of {probe.b} in time")

    def forget(self, node: str) -> None:
        """Drop the links of a node that left the pipeline for good."""
        for pair in [p for p in self.links if node in p]:
            del self.links[pair]

    def status(self) -> list[LinkStatus]:
        return list(self.links.values())
