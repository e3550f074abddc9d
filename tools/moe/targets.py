"""The MoE benchmark's ratios and its targets, from tok/s samples (pure: no model).

Samples are tok/s per run of each system, interleaved run by run: ``baseline``
(openvino_genai, measured first and last in every run, so two figures a run), ``stage1``
(zctl's 1-stage chain of the 128-expert model), ``cluster`` (its 2-node local cluster),
``experts-256`` and ``dense-equal`` (zctl's 1-stage chains of the model with twice the
experts and of the dense model with as many weights). Each ratio is the median over runs of
that run's ratio (the machine's drift hits both sides of a run alike); against the baseline,
a run's figure is set against the mean of the two baseline figures bracketing it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tools.harness.stats import paired_ratio, rounded


@dataclass(frozen=True)
class Target:
    """A figure's bound: ``value >= bound`` (at_least) or ``value < bound`` (below)."""

    ratio: str
    bound: float
    kind: Literal["at_least", "below"]

    def met(self, value: float) -> bool:
        return value >= self.bound if self.kind == "at_least" else value < self.bound


# target name -> its bound on one of ``ratios``' figures
TARGETS: dict[str, Target] = {
    "1 stage vs openvino_genai": Target("stage1 / openvino_genai", 0.95, "at_least"),
    "2-node cluster vs openvino_genai": Target("cluster / openvino_genai", 0.90, "at_least"),
    "tok/s change, twice the experts": Target("|experts-256 / experts-128 - 1|", 0.15, "below"),
    "MoE vs dense of equal parameters": Target("experts-128 / dense-equal", 5.0, "at_least"),
}


def _baseline_brackets(baseline: Sequence[float]) -> list[float]:
    """Each run's baseline figure: the mean of the two measured first and last in it."""
    if len(baseline) % 2:
        raise ValueError(f"the baseline opens and closes every run: an even count of samples, "
                         f"got {len(baseline)}")
    return [(a + b) / 2 for a, b in zip(baseline[::2], baseline[1::2], strict=True)]


def moe_ratios(samples: Mapping[str, Sequence[float]]) -> dict[str, float | None]:
    """The benchmark's ratios of tok/s (see the module's docstring), not rounded (``judge``
    compares them with their bounds); a ratio whose systems were not measured (no
    baseline, no cluster) is None."""
    runs = len(samples["stage1"])
    if runs == 0:
        raise ValueError("no runs")
    for name, values in samples.items():
        want = 2 * runs if name == "baseline" else runs
        if values and len(values) != want:
            raise ValueError(f"{name}: {len(values)} samples for {runs} runs (want {want})")
    stage1 = samples["stage1"]

    def against(name: str, bases: Sequence[float]) -> float | None:
        return paired_ratio(samples.get(name, ()), bases)

    bases = _baseline_brackets(samples.get("baseline", ()))
    doubled = against("experts-256", stage1)
    return {
        "stage1 / openvino_genai": against("stage1", bases),
        "cluster / openvino_genai": against("cluster", bases),
        "experts-256 / experts-128": doubled,
        "|experts-256 / experts-128 - 1|": None if doubled is None else abs(doubled - 1),
        "experts-128 / dense-equal": paired_ratio(stage1, samples.get("dense-equal", ())),
    }


def judge(ratios: Mapping[str, float | None]) -> dict[str, dict[str, Any]]:
    """Each target: its figure (``value``), its bound (``target``, with ``kind``: at_least
    or below) and whether it is ``met`` (None where the figure could not be measured).
    Met is judged on the figure itself; the value is reported to 3 places."""
    verdicts = {}
    for name, target in TARGETS.items():
        value = ratios.get(target.ratio)
        verdicts[name] = {"value": rounded(value), "target": target.bound, "kind": target.kind,
                          "met": None if value is None else target.met(value)}
    return verdicts


def median_tok_s(samples: Mapping[str, Sequence[float]]) -> dict[str, float | None]:
    """Each system's median tok/s over its runs (None: not measured)."""
    return {name: round(statistics.median(values), 2) if values else None
            for name, values in samples.items()}
