"""The cases of the comparison and how one is run.

A case is a model, a weight format, a node count with its CPU sets, and a per-hop delay.
Both systems are up for the whole case; every measurement alternates between them
(zctl first in even rounds, llama.cpp first in odd ones), several rounds, each round's
pair measured moments apart. A system that fails (a process dies, a request errors) is
that system's failure for the rest of the case, with its log's tail; the other goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.harness.load import request_set
from tools.harness.report import err
from tools.peers.measure import one_stream, prompt_ids, serving_level
from tools.peers.processes import SERVER_SLOT_CONTEXT, PeerFailure
from tools.peers.systems import ONE_STREAM_CONTEXT, Served

TOPOLOGIES = ("1", "2-split", "2-shared", "3-split", "3-shared")
WARMUP_TOKENS = 8
ERROR_SETTLE_S = 1.0


@dataclass(frozen=True)
class Case:
    """One comparison: ``nodes`` nodes, their CPU sets (split: a core each; shared: every
    core for every node) and the delay of each hop."""

    model: str
    weights: str
    nodes: int
    cpu_sets: str
    delay_ms: float

    @property
    def topology(self) -> str:
        return "1n" if self.nodes == 1 else f"{self.nodes}n-{self.cpu_sets}"

    @property
    def key(self) -> str:
        return f"{self.model}/{self.weights}/{self.topology}/{self.delay_ms:g}ms"


def case_matrix(models: Sequence[str], weights: Sequence[str], topologies: Sequence[str],
                delays: Sequence[float], cores: int) -> tuple[list[Case], dict[str, str]]:
    """The cases to run, and the ones that cannot be measured here with the reason (a
    core each for more nodes than this machine has cores). One node has no hop: it runs
    at 0 ms only."""
    cases, skipped = [], {}
    for model in models:
        for weight in weights:
            for topology in topologies:
                if topology not in TOPOLOGIES:
                    raise ValueError(f"unknown topology {topology!r}: use {', '.join(TOPOLOGIES)}")
                nodes, _, cpu_sets = topology.partition("-")
                for delay in ([0.0] if nodes == "1" else delays):
                    case = Case(model, weight, int(nodes), cpu_sets or "shared", float(delay))
                    if case.cpu_sets == "split" and case.nodes > cores:
                        skipped[case.key] = (
                            f"{case.nodes} nodes with a core each need {case.nodes} cores; "
                            f"this machine gives this process {cores}: not measurable here "
                            f"(the {case.nodes}n-shared case runs them on shared cores)")
                    else:
                        cases.append(case)
    return cases, skipped


@dataclass(frozen=True)
class CasePlan:
    """What a case measures: one stream at each prompt length (``tokens`` new tokens),
    the serving levels (``requests`` each; 0: twice the clients, at least 8), rounds."""

    prompts: Sequence[int] = (128, 1024)
    tokens: int = 128
    clients: Sequence[int] = (1, 4, 8, 16)
    requests: int = 0
    rounds: int = 3
    serve_rounds: int = 1
    seed: int = 0

    def level_requests(self, clients: int) -> int:
        return self.requests or max(8, 2 * clients)


@dataclass
class CaseResult:
    """A case's raw figures, per system and measurement, one entry per round; and each
    system's failure, if it had one."""

    case: Case
    figures: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    failures: dict[str, dict[str, str]] = field(default_factory=dict)
    placement: dict[str, list[str]] = field(default_factory=dict)

    def add(self, system: str, measurement: str, figures: dict[str, Any]) -> None:
        self.figures.setdefault(system, {}).setdefault(measurement, []).append(figures)

    def record(self) -> dict[str, Any]:
        return {"case": self.case.key, "nodes": self.case.nodes, "cpu_sets": self.case.cpu_sets,
                "delay_ms": self.case.delay_ms, "figures": self.figures,
                "failures": self.failures, "placement": self.placement}


Measure = Callable[[Served], dict[str, Any]]


class CaseRunner:
    """Runs a case's measurements on two systems, alternating them, keeping failures."""

    def __init__(self, result: CaseResult, systems: Sequence[Served]) -> None:
        self.result = result
        self.systems = list(systems)

    def live(self) -> list[Served]:
        return [s for s in self.systems if s.name not in self.result.failures]

    def fail(self, system: Served, failure: PeerFailure) -> None:
        err.print(f"[red]{system.name} failed in {self.result.case.key}:[/] {failure}",
                  highlight=False)
        self.result.failures[system.name] = failure.record()

    def prepare(self, slots: int, context: int | None, warmup: Measure) -> None:
        """Every live system ready for ``slots`` streams, and warmed up."""
        for system in self.live():
            try:
                system.prepare(slots, context)
                self.take(system, warmup)
            except PeerFailure as exc:
                self.fail(system, exc)

    def take(self, system: Served, measure: Measure) -> dict[str, Any]:
        """One measurement of ``system``; a lost process or a one-stream request's error
        is a failure (a serving level's errors are among its figures)."""
        figures = measure(system)
        if figures.get("error") or figures.get("errors"):
            time.sleep(ERROR_SETTLE_S)  # a process that just died: let its exit show
        system.check()
        if figures.get("error"):
            raise PeerFailure(f"{system.name}: {figures['error']}")
        return figures

    def alternate(self, name: str, rounds: Sequence[Measure]) -> None:
        """Each round's measurement on each live system, the order swapping each round."""
        for round_, measure in enumerate(rounds):
            order = self.live() if round_ % 2 == 0 else self.live()[::-1]
            for system in order:
                try:
                    self.result.add(system.name, name, self.take(system, measure))
                except PeerFailure as exc:
                    self.fail(system, exc)
            err.print(f"{self.result.case.key} {name} round {round_ + 1}/{len(rounds)}: " + "  ".join(
                f"{s}: {_headline(f[name][-1])}" for s, f in self.result.figures.items()
                if name in f), highlight=False)


def _headline(figures: dict[str, Any]) -> str:
    if "decode_tok_s" in figures:
        return f"{figures['decode_tok_s']:.1f} tok/s, TTFT {figures['ttft_ms']:.0f} ms"
    return f"{figures.get('tok_s', 0):.1f} tok/s, {figures.get('errors', 0)} errors"


def run_case(result: CaseResult, systems: Sequence[Served], plan: CasePlan,
             encode: Callable[[str], list[int]]) -> CaseResult:
    """Measure a case on ``systems`` (both up): one stream at each prompt length, then
    each serving level (llama-server started with as many slots as clients)."""
    runner = CaseRunner(result, systems)
    warm_ids = prompt_ids(encode, 16, 0)

    def warmup(system: Served) -> dict[str, Any]:
        return asyncio.run(one_stream(system.base_url, system.model, warm_ids, WARMUP_TOKENS))

    runner.prepare(1, ONE_STREAM_CONTEXT, warmup)
    for index, length in enumerate(plan.prompts):
        prompts = [prompt_ids(encode, length, 1 + index * plan.rounds + round_)  # each round its own start
                   for round_ in range(plan.rounds)]
        runner.alternate(f"one_stream.p{length}", [
            lambda s, ids=ids: asyncio.run(one_stream(s.base_url, s.model, ids, plan.tokens))
            for ids in prompts])
    for clients in plan.clients:
        runner.prepare(clients, clients * SERVER_SLOT_CONTEXT, warmup)
        requests = request_set(plan.level_requests(clients), plan.seed)
        runner.alternate(f"serve.c{clients}", [
            lambda s, c=clients, r=requests: asyncio.run(serving_level(s.base_url, s.model, r, c))
        ] * plan.serve_rounds)
    return result
