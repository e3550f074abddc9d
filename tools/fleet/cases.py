"""The arms (a cluster each) and the comparisons between them, with their targets (pure).

Two cores stand for two PCs: the coordinator on the first, node 1 on the second. A third
node, on two cores, shares the second core with node 1 (said with the figures). Planned
arms serve an export in six stages (a cut every five of SmolLM2's 30 layers) placed by
the planner from the nodes' profiles; explicit arms serve an export in as many stages as
nodes, stage i on node i (the equal split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tools.harness.stats import paired_ratio, rounded

MODEL, WEIGHTS = "smollm2-135m", "int4"
STREAMS = (1, 8)  # the stream counts every arm is measured at
PLANNED_STAGES = 6  # the planner's export: it may cut at any of its 5 boundaries
SLOW_SHARE = 0.25  # the slower node's CPU quota: a quarter of a core
FAR_DELAY_MS = 50.0  # the far node's one-way delay on every frame it sends


@dataclass(frozen=True)
class Arm:
    """A local cluster of ``nodes`` processes (the coordinator first) on ``cores`` (the
    index of each one's core), ``planned`` (the planner places the stages; else stage i
    on node i), its last node slowed to ``slow_share`` of a core and/or sending with
    ``delay_ms`` of one-way delay, and, when ``joins``, that node started only once the
    others serve (it joins a running cluster)."""

    name: str
    nodes: int
    cores: tuple[int, ...]
    planned: bool
    slow_share: float = 0.0
    delay_ms: float = 0.0
    joins: bool = False

    def __post_init__(self) -> None:
        if self.nodes < 2 or len(self.cores) != self.nodes or min(self.cores) < 0:
            raise ValueError(f"arm {self.name}: 2 or more nodes, a core index each")
        if not 0 <= self.slow_share < 1 or self.delay_ms < 0:
            raise ValueError(f"arm {self.name}: a slowed node's share is in (0, 1) and a "
                             "delay >= 0")
        if self.joins and not self.planned:
            raise ValueError(f"arm {self.name}: only a planned arm's node joins later (an "
                             "explicit placement names every node from the start)")

    @property
    def stages(self) -> int:
        """The export's stage count."""
        return PLANNED_STAGES if self.planned else self.nodes

    def setup(self) -> dict[str, object]:
        """What the arm runs, as the report shows it."""
        return {"nodes": self.nodes, "cores": list(self.cores),
                "placement": "planner" if self.planned else "explicit: stage i on node i",
                "export_stages": self.stages, "last_node_share": self.slow_share or None,
                "last_node_delay_ms": self.delay_ms or None, "last_node_joins": self.joins}


@dataclass(frozen=True)
class Comparison:
    """``subject``'s tok/s over ``reference``'s at each stream count, against ``bound``:
    kind ``no-drop`` is met at a ratio >= 1 - bound, ``speedup`` at a ratio >= bound.
    ``control``: an arm shown beside it, over the same reference (what happens without
    the planner)."""

    name: str
    kind: str
    subject: str
    reference: str
    bound: float
    control: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("no-drop", "speedup") or self.bound <= 0:
            raise ValueError(f"comparison {self.name}: kind no-drop or speedup, bound > 0")

    def least(self) -> float:
        """The lowest ratio that meets the target."""
        return 1.0 - self.bound if self.kind == "no-drop" else self.bound

    def target_name(self, streams: int) -> str:
        what = (f"drop <= {self.bound:.0%}" if self.kind == "no-drop"
                else f">= {self.bound:g}x")
        return f"{self.name}, {streams} stream{'s' if streams > 1 else ''}: {what}"


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("two", 2, (0, 1), planned=True),
    Arm("two+slow", 3, (0, 1, 1), planned=True, slow_share=SLOW_SHARE, joins=True),
    Arm("two+far", 3, (0, 1, 1), planned=True, delay_ms=FAR_DELAY_MS, joins=True),
    Arm("three-equal-slow", 3, (0, 1, 1), planned=False, slow_share=SLOW_SHARE),
    Arm("three-equal-far", 3, (0, 1, 1), planned=False, delay_ms=FAR_DELAY_MS),
    Arm("uneven-planned", 2, (0, 1), planned=True, slow_share=SLOW_SHARE),
    Arm("uneven-equal", 2, (0, 1), planned=False, slow_share=SLOW_SHARE),
)}

COMPARISONS: tuple[Comparison, ...] = (
    Comparison("slow joiner", "no-drop", "two+slow", "two", 0.05, control="three-equal-slow"),
    Comparison("far joiner", "no-drop", "two+far", "two", 0.05, control="three-equal-far"),
    Comparison("heterogeneity", "speedup", "uneven-planned", "uneven-equal", 1.3),
)


def targets(comparisons: tuple[Comparison, ...],
            runs: Mapping[str, Mapping[int, Sequence[float]]]) -> dict[str, dict[str, object]]:
    """Each comparison's target at each stream count: ``{value, target, met}``, the value
    the subject's ``paired_ratio`` over the reference (None, and not met, when either arm
    has no runs: it failed). Met is judged on the ratio itself; the value is reported to
    3 places."""
    out: dict[str, dict[str, object]] = {}
    for comparison in comparisons:
        for streams in STREAMS:
            value = paired_ratio(runs.get(comparison.subject, {}).get(streams, ()),
                                 runs.get(comparison.reference, {}).get(streams, ()))
            out[comparison.target_name(streams)] = {
                "value": rounded(value), "target": comparison.least(),
                "met": value is not None and value >= comparison.least()}
    return out
