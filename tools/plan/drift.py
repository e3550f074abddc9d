"""How far this host's own speed moves: the error a perfect model would still make.

``zctl bench plan`` predicts each case from profiles measured a minute or two before its
runs, and measures a few seconds of decoding. If the host itself runs the same work at a
different speed from one minute to the next (a VM whose neighbours come and go), that
difference is in every case's error whatever the model of time. This measures it, on the
profile's own synthetic stage (controlplane/profiling.py's kind: random weights of the
model's layer shape in its weight format, the runtime's default settings): ``seconds`` of
samples, each the median of ``STEPS`` one-row decode steps after an idle gap as long as
the step (a 2-stage pipeline's duty cycle; a fresh stream each sample, so the past stays
short), and the host's reference workload timed once (controlplane/host_speed.py).

Then, for every moment ``t`` of the run, a "profile" is the median of the samples in
``[t, t + PROFILE_S)`` and a "run" the median of those in ``[t + lead, t + lead +
RUN_S)``: the error is the run's time over the profile's, less 1 (as ``bench plan``
counts it: positive when the prediction is too fast). With the speed factor, the profile
is scaled by the reference's median in the ``CHECK_S`` before the run over its median in
the profile's window: a reference timed with the profile, as the planner's factor
(controlplane/planner/speed.py) took it until a profile's reference time became its
node's first checks after it (controlplane/host_speed.py). A fresh profile's factor now
starts at 1, so for a run this soon after its profile the error without the factor is
the planner's. ``python -m tools.plan.drift [--json]``.
"""

from __future__ import annotations

import json
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import typer

from tools.harness.options import Json, fail
from tools.plan.report import TARGETS

STEPS = 10  # decode steps a sample
PAST_TOKENS = 16
PROFILE_S = 18.0  # a profile's steps are spread over about its budget
RUN_S = 3.0  # a case's one-stream rounds take a few seconds
CHECK_S = 30.0  # a node's speed factor is the median of its last 3 checks, 10 s apart
BOUND = TARGETS[1]  # bench plan's one-stream target


@dataclass(frozen=True)
class Sample:
    at_s: float  # since the run started
    stage_s: float  # the median decode step
    reference_s: float  # the host's reference workload


def _stage_s(sample: Sample) -> float:
    return sample.stage_s


def _reference_s(sample: Sample) -> float:
    return sample.reference_s


def _at(sample: Sample) -> float:
    return sample.at_s


def _median(samples: Sequence[Sample], start: float, end: float,
            figure: Callable[[Sample], float]) -> float | None:
    """The median of ``figure`` over the samples in ``[start, end)`` (``samples`` in the
    order they were taken: found by bisection, not by a pass over all of them)."""
    window = samples[bisect_left(samples, start, key=_at):bisect_left(samples, end, key=_at)]
    return statistics.median(map(figure, window)) if window else None


def prediction_errors(samples: Sequence[Sample], lead_s: float, speed_factor: bool,
                      profile_s: float = PROFILE_S, run_s: float = RUN_S,
                      check_s: float = CHECK_S) -> list[float]:
    """The error of a profile taken at each sample's moment, for a run ``lead_s`` later
    (the module docstring), over every moment whose run ends within the samples."""
    if lead_s < profile_s:
        raise ValueError(f"the run starts after the profile ends: lead {lead_s:g} s < "
                         f"{profile_s:g} s")
    end = samples[-1].at_s if samples else 0.0
    errors = []
    for sample in samples:
        t = sample.at_s
        if t + lead_s + run_s > end:
            break
        profile = _median(samples, t, t + profile_s, _stage_s)
        run = _median(samples, t + lead_s, t + lead_s + run_s, _stage_s)
        if profile is None or run is None:
            continue
        if speed_factor:
            then = _median(samples, t, t + profile_s, _reference_s)
            now = _median(samples, t + lead_s - check_s, t + lead_s, _reference_s)
            if then is None or now is None:
                continue
            profile *= now / then
        errors.append(run / profile - 1.0)
    return errors


def summary(errors: Sequence[float], bound: float = BOUND) -> dict[str, float]:
    """Mean and 90th percentile of the errors' sizes, and the share beyond ``bound``."""
    if not errors:
        raise ValueError("no errors to sum up: the run is shorter than a profile, the lead "
                         "and a run")
    sizes = np.abs(np.asarray(errors))
    return {"mean_abs": round(float(sizes.mean()), 4),
            "p90_abs": round(float(np.quantile(sizes, 0.9)), 4),
            "beyond_bound": round(float((sizes > bound).mean()), 4),
            "moments": len(errors)}


def window_medians(samples: Sequence[Sample], window_s: float) -> list[dict[str, float]]:
    """The stage's and the reference's medians over consecutive ``window_s`` windows."""
    out = []
    start = 0.0
    end = samples[-1].at_s if samples else 0.0
    while start <= end:
        stage = _median(samples, start, start + window_s, _stage_s)
        reference = _median(samples, start, start + window_s, _reference_s)
        if stage is not None and reference is not None:
            out.append({"at_s": round(start, 1), "stage_ms": round(stage * 1e3, 3),
                        "reference_ms": round(reference * 1e3, 3)})
        start += window_s
    return out


def sample_host(model: str, weights: str, layers: int, seconds: float) -> list[Sample]:
    """``seconds`` of samples of the synthetic stage and the reference (module docstring)."""
    from controlplane.host_speed import reference_s
    from controlplane.planner.presets import PRESETS
    from controlplane.profiling import layer_shape, runtime_for
    from dataplane.runtime.load import load_runner
    from dataplane.runtime.synthetic import synthetic_manifest, synthetic_model

    shape = PRESETS[model]
    dims = layer_shape(shape)
    group = shape.group_size() if weights == "int4" else None
    graph = synthetic_model(dims, layers, False, weights, group)
    runner = load_runner("", 0, runtime_for("CPU"), verify=False, graph=graph,
                         manifest=synthetic_manifest(dims, layers, False, weights, group))
    step = np.zeros((1, 1, dims.hidden), np.float32)
    samples: list[Sample] = []
    start = time.perf_counter()
    stream = 0
    while time.perf_counter() - start < seconds:
        stream += 1
        runner.open_stream(stream)
        runner.step(stream, np.zeros((1, PAST_TOKENS, dims.hidden), np.float32),
                    np.arange(PAST_TOKENS))
        took, times = 0.0, []
        for at in range(PAST_TOKENS, PAST_TOKENS + STEPS + 1):
            time.sleep(took)  # the other stage's step
            t0 = time.perf_counter()
            runner.step(stream, step, np.array([at]))
            took = time.perf_counter() - t0
            times.append(took)
        runner.close_stream(stream)
        samples.append(Sample(time.perf_counter() - start, statistics.median(times[1:]),
                              reference_s()))
    return samples


def main(
    seconds: Annotated[float, typer.Option(help="how long to sample")] = 240.0,
    lead: Annotated[float, typer.Option(
        help="seconds from a profile's start to a case's runs (profiles in turn, link "
             "probes, speed checks)")] = 60.0,
    model: Annotated[str, typer.Option(help="a named shape (zctl plan's presets)")]
        = "smollm2-135m",
    weights: Annotated[str, typer.Option(help="int4, int8 or fp16")] = "int4",
    layers: Annotated[int, typer.Option(help="decoder layers in the stage")] = 15,
    as_json: Json = False,
) -> None:
    from controlplane.planner.presets import PRESETS
    from tools.harness.report import err, run_record

    if model not in PRESETS:
        fail(f"unknown model {model!r}: one of {', '.join(PRESETS)}")
    if weights not in ("int4", "int8", "fp16") or layers < 1:
        fail("--weights int4, int8 or fp16, and --layers >= 1")
    if not seconds >= lead + PROFILE_S + RUN_S or lead < PROFILE_S:
        fail(f"--lead >= {PROFILE_S:g} s and --seconds >= the lead + {PROFILE_S + RUN_S:g} s")
    err.print(f"sampling {layers} layers of {model} in {weights} for {seconds:g} s ...")
    samples = sample_host(model, weights, layers, seconds)
    stage = [s.stage_s for s in samples]
    report: dict[str, Any] = {
        **run_record(),
        "options": {"seconds": seconds, "lead_s": lead, "model": model, "weights": weights,
                    "layers": layers},
        "samples": len(samples),
        "stage_ms": {"min": round(min(stage) * 1e3, 3), "median":
                     round(statistics.median(stage) * 1e3, 3), "max": round(max(stage) * 1e3, 3)},
        "windows": window_medians(samples, 10.0),
        "error": summary(prediction_errors(samples, lead, False)),
        "error_with_speed_factor": summary(prediction_errors(samples, lead, True)),
    }
    if as_json:
        print(json.dumps(report))
        return
    for name in ("error", "error_with_speed_factor"):
        e = report[name]
        print(f"{name}: mean {e['mean_abs']:.1%}, p90 {e['p90_abs']:.1%}, beyond "
              f"{BOUND:.0%} at {e['beyond_bound']:.0%} of {e['moments']} moments")
    print("10 s windows (stage ms / reference ms): " + ", ".join(
        f"{w['stage_ms']:.2f}/{w['reference_ms']:.2f}" for w in report["windows"]))


if __name__ == "__main__":
    typer.run(main)
