"""The cases: a model on a number of nodes, their CPU sets, a delay per hop, and perhaps
one node slowed as an older PC would be; which of them run by default, and which cannot
run on this machine (split CPU sets need a core per node).

The Llama-3.1-8B-shaped case writes a random 16 GB checkpoint and a ~5 GB INT4 export
before its first run (an hour or more on a 2-vCPU VM): it runs only when named, as does
the tiny model's (a smoke test's, which says nothing of the model of time).
"""

from __future__ import annotations

from dataclasses import dataclass

STREAMS = (1, 8)  # the stream counts every case is measured at


@dataclass(frozen=True)
class Case:
    """``model`` (a benchmark model: smollm2-135m, random-1b, random-8b) in ``weights`` on
    ``nodes`` nodes with ``cpu_sets`` (split: a core each, as separate PCs; shared: every
    core for every node), ``delay_ms`` added to every hop, and the last node slowed to
    ``slow_share`` of a core (0: none)."""

    name: str
    model: str
    weights: str
    nodes: int
    cpu_sets: str
    delay_ms: float = 0.0
    slow_share: float = 0.0
    opt_in: bool = False  # runs only when named (too slow to make for a default run)

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.cpu_sets not in ("split", "shared") or self.delay_ms < 0:
            raise ValueError(f"case {self.name}: 2 or more nodes, split or shared CPU sets "
                             "and a delay >= 0")
        if not 0 <= self.slow_share < 1:
            raise ValueError(f"case {self.name}: a slowed node's share of a core is in (0, 1), "
                             f"got {self.slow_share}")

    def setup(self) -> dict[str, object]:
        """What the case runs, as the report shows it."""
        return {"model": self.model, "weights": self.weights, "nodes": self.nodes,
                "cpu_sets": self.cpu_sets, "delay_ms": self.delay_ms,
                "slowed_share": self.slow_share or None}


SMOL = "smollm2-135m"
CASES: dict[str, Case] = {c.name: c for c in (
    Case("smollm2-2n-split", SMOL, "int4", 2, "split"),
    Case("smollm2-2n-shared", SMOL, "int4", 2, "shared"),
    Case("smollm2-3n-split", SMOL, "int4", 3, "split"),
    Case("smollm2-3n-shared", SMOL, "int4", 3, "shared"),
    Case("smollm2-2n-slowed", SMOL, "int4", 2, "split", slow_share=0.5),
    Case("smollm2-2n-10ms", SMOL, "int4", 2, "split", delay_ms=10.0),
    Case("smollm2-2n-50ms", SMOL, "int4", 2, "split", delay_ms=50.0),
    Case("1b-2n-split", "random-1b", "int4", 2, "split"),
    Case("8b-4n-shared", "random-8b", "int4", 4, "shared", opt_in=True),
    # the smoke test's: a 4-layer random model, made and profiled in seconds
    Case("tiny-2n-shared", "random-tiny", "int8", 2, "shared", opt_in=True),
)}
QUICK = ("smollm2-2n-split", "smollm2-2n-slowed", "smollm2-2n-10ms")


def select_cases(text: str, cores: int) -> tuple[list[Case], dict[str, str]]:
    """The cases ``text`` names (comma-separated names, ``quick``: QUICK, ``all``: every
    case but the opt-in ones) that can run with ``cores`` cores, and the others named with
    why they cannot. ValueError on an unknown name or none at all."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "quick":
            names += QUICK
        elif part == "all":
            names += [n for n, c in CASES.items() if not c.opt_in]
        elif part in CASES:
            names.append(part)
        else:
            raise ValueError(f"unknown case {part!r}: name some of {', '.join(CASES)}, or "
                             "quick or all")
    if not names:
        raise ValueError("--cases names no case")
    runnable, skipped = [], {}
    for name in dict.fromkeys(names):
        case = CASES[name]
        if case.cpu_sets == "split" and case.nodes > cores:
            skipped[name] = (f"{case.nodes} nodes with a core each need {case.nodes} cores; "
                             f"this process may use {cores}")
        else:
            runnable.append(case)
    return runnable, skipped
