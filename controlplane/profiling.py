"""Profiling a node: time synthetic stages of a model's layer shape on one device.

``measure`` builds three stages of random weights in the model's weight format
(dataplane.runtime.synthetic; a mixture of experts' layers holding every expert and
computing the routed ones, as its export does): one decoder layer, ``1 + k`` layers, and
one layer with the LM head, and runs them as the cluster's stages run (the runtime's
default settings on the device: PagedAttention on CPU), each with row groups of 1, 2, 4
and 8 rows decoding over a short past, and the two decoder stages prefilling a prompt. A decode step is timed
as a pipeline's stage runs it: after an idle gap as long as the ``1 + k``-layer stage's
step at its rows (the nearest to a real stage's; a 2-stage pipeline's duty cycle: each
stage waits out the other's step between its own, its caches cooling and its vCPU going
idle: on this repository's VM a SmolLM2 layer's step took 0.28 ms back to back and 0.7 ms
after 6 ms idle, the frames around it 0.04 and 0.14 ms), and on the two decoder stages
through the worker's own step path (dataplane/worker/hop.py: the hidden states' frame
decoded, the outgoing frame prepared, the step computed, the frame sealed), so that what
the frames cost beside the compute is timed too: a profile's ``frame_s``, the node's
framework work a hop. Rounds of steps follow one another (every stage and row count in
each round, so a slower moment of the machine falls on all of them alike) until the
budget is spent or enough rounds are in; each decode figure is the median of its steps
(a pipeline's stage runs at its median, not at its best moments), a prompt's the lower
quartile of its prefills. Last, the
coordinator's own work per decode step at each row count is timed with the generation
engine (controlplane/engine_step.py), each step running the ``1 + k``-layer stage's
inference as stage 0's would (its time left out): beside an inference that has just
swept the caches the engine's work costs 2-4x what it costs in a tight loop (0.18
against 0.10 ms a step for the tiny model, 0.39 against 0.10 for SmolLM2-135M, on this
repository's VM). ``k`` is chosen so
the extra layers hold some 64 MB of weights (at most 32 layers), fewer when memory is
short: a stage of a few layers whose weights stay in the caches between its steps runs
its layers faster than a real stage does (on this repository's VM, 15 layers of SmolLM2
predicted its 30-layer stage's step ~20% short, 29 layers within the noise), and fewer
on a machine so slow that building them would leave the budget no time to time them
(``extra_layers_in_time``: what the budget has left but ``TIMING_SHARE`` of it, judged
by how long the one-layer stage took to build; the timed layers' weights may then stay
in the caches, and the profile read a little fast, rather than not be measured). The
per-layer figures follow by difference (controlplane/planner/measured.py). The CPU quota
the process runs under (controlplane/cpu_quota.py) is recorded, with the process CPU time
a timed decode step used (every thread's, OpenVINO's included; its frames' work too) per
second of its wall time, their median (CPU its threads may spend in the idle gaps is not
counted: a gap sized for another stage's step would charge it to the wrong one): a node
held to a quota is timed within it, at the profile's duty cycle, and the planner applies
the quota to the figures for the duty cycle of the pipeline (controlplane/planner/quota.py).
The host's reference workload is not timed here but by the node that holds the profile,
in its own process, as it checks it again later (controlplane/host_speed.py: timed here,
it read the host some 11% faster than the nodes' checks did).

The budget bounds the whole of it, building and compiling included: past it, no further
step or build is started (a compile under way ends first), and a device that could not
time every figure once in its budget raises ProfileError. ``python -m
controlplane.profiling`` runs one profile in a process of its own (what a node does when
it joins, so the graphs' memory goes with that process and its figures are not mixed with
its stage's allocations) in this machine's turn to profile (controlplane/profile_turn.py;
``--turn-held``: its parent holds it for it) and prints the profile's JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import psutil

from controlplane.cpu_quota import CpuQuota, read_quota
from controlplane.engine_step import time_engine
from controlplane.nodeinfo import openvino_version, ram
from controlplane.planner.measured import Measurement
from controlplane.planner.memory import embedding_bytes, layer_weight_bytes
from controlplane.planner.profile import GRAPH_VERSION, ROWS, ProfileError, ProfileKey
from controlplane.planner.shape import ModelShape, ShapeError
from controlplane.profile_store import BUDGET_S
from dataplane.runtime.base import StageError, StageRuntime
from dataplane.runtime.config import RuntimeSpec, device_kind
from dataplane.runtime.load import load_runner
from dataplane.runtime.paged import PagedStageRunner
from dataplane.runtime.synthetic import LayerShape, synthetic_manifest, synthetic_model
from dataplane.wire.frames import HiddenStateFrame, Kind, decode_frame, encode_frame, prepare_frame
from dataplane.worker.hop import compute_step, seal_or_encode
from zctl.weights import export_int8_form

EXTRA_BYTES = 64e6  # the weights the second stage's extra layers should hold
MAX_EXTRA_LAYERS = 32
MEMORY_SHARE = 0.5  # of the free memory, what the synthetic stages may take
TIMING_SHARE = 0.4  # of the budget, kept for timing once the stages are built
PAST_TOKENS = 16  # each decoding row's past when timing starts
PROMPT_TOKENS = 128  # the prompt the decoder stages prefill
STEPS = 5  # timed decode steps per stage and row count in a round (after an untimed one)
MIN_ROUNDS, MAX_ROUNDS = 2, 8
STEP_QUANTILE = 0.5  # of a decode step's times (and of its frames' work)
PROMPT_QUANTILE = 0.25  # of a prompt's prefill times
IDLE_GAP = 1.0  # the idle gap before a timed decode step, in (1 + k)-layer stage steps
# the coordinator's step, timed beside the (1 + k)-layer stage's inference: runs of steps at
# each row count, the stage's time in them kept to ~ENGINE_STAGE_S
ENGINE_RUNS, ENGINE_STEPS, ENGINE_MIN_STEPS, ENGINE_STAGE_S = 3, 10, 3, 3.0
ENGINE_STEP_S = 2e-3  # the engine's own work a step, kept for beside the stage's (generous)
PROMPT_STREAM = 1 << 20  # the prompt's stream id (row groups' streams are below it)


def runtime_for(device: str) -> RuntimeSpec:
    """The settings a cluster's stages compile with by default on ``device`` (``zctl cluster
    up``'s: f32 activations, the plugin's KV type, dynamic quantization, PagedAttention on
    CPU, where a cluster runs it)."""
    return RuntimeSpec(device=device, paged_attention=device_kind(RuntimeSpec(device)) == "CPU")


def layer_shape(shape: ModelShape) -> LayerShape:
    """The synthetic layers' geometry: a mixture of experts' layers hold all its experts,
    in the form its export runs them (the routed ones computed: dataplane.runtime.synthetic)."""
    return LayerShape(shape.hidden, shape.intermediate, shape.heads, shape.kv_heads,
                      shape.head_dim, shape.vocab, shape.experts, shape.active_experts,
                      shape.expert_intermediate)


def extra_layers(shape: ModelShape, weights: str, free_memory: int,
                 exact_experts: bool = False) -> int:
    """``k``: the second stage's layers beyond the first's one (module docstring)."""
    layer = layer_weight_bytes(shape, weights, exact_experts=exact_experts) * 1.2
    head = embedding_bytes(shape, weights) * 1.2
    k = max(1, min(MAX_EXTRA_LAYERS, math.ceil(EXTRA_BYTES / layer)))
    room = MEMORY_SHARE * free_memory - head - 2 * layer
    while k > 1 and k * layer > room:
        k -= 1
    if k * layer > room:
        need = (2 + k) * layer + head
        raise ProfileError(f"profiling {shape.name} in {weights} needs ~{need / 1e9:.1f} GB "
                           f"(three layers and the LM head), {MEMORY_SHARE:.0%} of the "
                           f"{free_memory / 1e9:.1f} GB free")
    return k


class Deadline:
    """The budget's end; ``check`` raises ProfileError once it has passed."""

    def __init__(self, budget_s: float, clock: Callable[[], float]) -> None:
        if not budget_s > 0:
            raise ProfileError(f"a profile's budget must be positive seconds, not {budget_s!r}")
        self.clock, self.budget = clock, budget_s
        self.start = clock()
        self.end = self.start + budget_s

    @property
    def passed(self) -> bool:
        return self.clock() >= self.end

    def left(self) -> float:
        return self.end - self.clock()

    def check(self, doing: str) -> None:
        if self.passed:
            raise ProfileError(f"profiling took its whole budget of {self.budget:g} s {doing}: "
                               "give it more (--budget), or profile a smaller shape")


@dataclass
class _Stage:
    """A synthetic stage, its row groups (one per row count, decoding over a short past)
    and the memory the process grew by for it."""

    runner: StageRuntime
    grown: int
    positions: dict[int, int] = field(default_factory=dict)

    def prepare(self, hidden: int) -> None:
        """Each row count's group, its rows' past prefilled one stream at a time (as a
        stateful stage forms a group only of streams that hold their KV)."""
        past = np.zeros((1, PAST_TOKENS, hidden), np.float32)
        for rows in ROWS:
            members = [rows * 100 + i for i in range(rows)]
            for sid in members:
                self.runner.open_stream(sid)
                self.runner.step(sid, past, np.arange(PAST_TOKENS))
            self.runner.regroup(rows, members)
            self.positions[rows] = PAST_TOKENS

    def decode(self, rows: int, hidden: int) -> None:
        at = self.positions[rows]
        self.runner.step_rows(rows, np.zeros((rows, 1, hidden), np.float32),
                              np.full((rows, 1), at, np.int64))
        self.positions[rows] = at + 1

    def sent(self, rows: int, hidden: int) -> list[Any]:
        """The frame of the ``rows``-row group's next decode step, as the stage before it
        sends it."""
        at = self.positions[rows]
        header = HiddenStateFrame(Kind.STEP, rows, 1, 0, step=at,
                                  positions=np.full(rows, at, np.int64), rows=rows)
        return encode_frame(header, np.zeros((rows, 1, hidden), np.float32))

    def hop(self, parts: list[Any], rows: int,
            clock: Callable[[], float]) -> tuple[float, float]:
        """The ``rows``-row group's decode step of the frame ``parts`` as a stage worker
        takes it (its step path: the frame decoded, the outgoing one prepared, the step
        computed, the frame sealed): the compute's seconds and the frames' seconds."""
        start = clock()
        header, payload = decode_frame(parts)
        assert payload is not None
        prepared = prepare_frame(header, payload.shape, payload.dtype, 1, 0, 0)
        computing = clock()
        out = compute_step(self.runner, rows, payload, header.positions, header.mask_tail,
                           header.row_rewinds)
        computed = clock()
        seal_or_encode(prepared, header, out, 1, 0, 0, 0, 0, 0, time.perf_counter_ns())
        end = clock()
        self.positions[rows] += 1
        return computed - computing, (end - start) - (computed - computing)

    def prompt(self, hidden: int) -> None:
        self.runner.reset_stream(PROMPT_STREAM)
        self.runner.step(PROMPT_STREAM, np.zeros((1, PROMPT_TOKENS, hidden), np.float32),
                         np.arange(PROMPT_TOKENS))


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _kv_bytes(runner: StageRuntime) -> int:
    """The KV cache a runner allocated up front (a paged stage's blocks; a stateful
    stage's KV grows with its tokens, a few here)."""
    if isinstance(runner, PagedStageRunner):
        return runner.cache_bytes
    return 0


def _build(dims: LayerShape, layers: int, last: bool, key: ProfileKey, group: int | None,
           runtime: RuntimeSpec, deadline: Deadline) -> _Stage:
    """A synthetic stage of ``layers`` layers in the weights ``key`` names, compiled."""
    deadline.check(f"before building a synthetic stage of {layers} layer(s)")
    before = _rss()
    graph = synthetic_model(dims, layers, last, key.weights, group, seed=layers + last,
                            int8_form=key.int8_form, exact_experts=key.exact_experts)
    manifest = synthetic_manifest(dims, layers, last, key.weights, group, key.int8_form,
                                  key.exact_experts)
    deadline.check(f"building a synthetic stage of {layers} layer(s)")
    try:
        runner = load_runner("", 0, runtime, manifest=manifest, verify=False, graph=graph)
    except StageError as exc:
        raise ProfileError(f"cannot compile a synthetic stage on {runtime.device}: {exc}") from None
    del graph
    gc.collect()
    stage = _Stage(runner, 0)
    stage.prepare(dims.hidden)
    stage.grown = max(0, _rss() - before - _kv_bytes(runner))
    deadline.check(f"compiling a synthetic stage of {layers} layer(s)")
    return stage


def extra_layers_in_time(layer_build_s: float, left_s: float, budget_s: float) -> int:
    """The most extra layers (at least 1) whose stage builds in the ``left_s`` seconds the
    budget has left but ``TIMING_SHARE`` of it (kept for timing the stages), each layer
    taking about as long to build as the one-layer stage did (``layer_build_s``: its graph,
    compile and warm-up): on a slow machine (an old PC, a small CPU quota) a stage of 64 MB
    of layers would leave its profile no time to time anything (SmolLM2-135M's 29 layers
    took 23 s to build at a quarter of a core, one layer 1.1 s)."""
    room = left_s - TIMING_SHARE * budget_s
    return max(1, int(room / max(layer_build_s, 1e-6)) - 1)


def _quantile(values: list[float], q: float = STEP_QUANTILE) -> float:
    return float(np.quantile(values, q))


def engine_steps(stage_s: float) -> int:
    """Steps a run of the coordinator's step takes beside a stage whose step at the most
    rows is ``stage_s``: as many as keep the stage's share to some ``ENGINE_STAGE_S``."""
    runs = len(ROWS) * (ENGINE_RUNS + 1)  # a warm-up run at each row count
    return max(ENGINE_MIN_STEPS, min(ENGINE_STEPS, int(ENGINE_STAGE_S / (runs * stage_s))))


def engine_reserve(steps: dict[tuple[str, int], list[float]], cores: float = 1.0) -> float:
    """Seconds to keep for timing the coordinator's step (``time_engine``) after the rounds
    of ``steps``: its runs beside the ``1 + k``-layer stage at each row count, each step
    the stage's at the most rows (where every count has one) and the engine's own work,
    slower on a process held to ``cores`` of CPU time (a quota under one core)."""
    if any(not steps[("more", rows)] for rows in ROWS):
        return 0.0
    stage_s = _quantile(steps[("more", ROWS[-1])])
    runs = len(ROWS) * (ENGINE_RUNS + 1)  # a warm-up run at each row count
    return runs * engine_steps(stage_s) * (stage_s + ENGINE_STEP_S / min(1.0, cores))


def measure(shape: ModelShape, weights: str, device: str = "CPU", budget_s: float = BUDGET_S,
            memory_limit: int = 0, clock: Callable[[], float] = time.perf_counter,
            sleep: Callable[[float], None] = time.sleep,
            cpu_clock: Callable[[], float] = time.process_time,
            quota: CpuQuota | None = None, int8_form: str | None = None,
            exact_experts: bool = False) -> Measurement:
    """Time ``shape``'s synthetic stages in ``weights`` (their INT8 in ``int8_form``, the
    served export's; None: the form an export in ``weights`` is written in now; a mixture
    of experts' weights in their exact i8 form with ``exact_experts``) on
    ``device`` within ``budget_s`` seconds (the module docstring; ``sleep`` waits out the
    idle gaps, ``cpu_clock`` is the process's CPU time, ``quota`` the CPU quota it runs
    under); ProfileError when it cannot."""
    deadline = Deadline(budget_s, clock)
    dims = layer_shape(shape)
    try:
        group = shape.group_size() if weights == "int4" else None
        form = export_int8_form(weights, int8_form)
    except ValueError as exc:
        raise ProfileError(f"{shape.name}: {exc}") from None
    if exact_experts and not shape.moe:
        raise ProfileError(f"{shape.name}: exact experts, but it has no mixture of experts")
    free = ram(memory_limit)[1]
    k = extra_layers(shape, weights, free, exact_experts)
    runtime = runtime_for(device)
    key = ProfileKey(shape.fingerprint(), weights, device, openvino_version(), GRAPH_VERSION,
                     form, exact_experts)
    # the head's stage first: the plugin's one-time costs (its libraries, its thread pool)
    # fall on it, not on the memory the decoder stages are told apart by
    head = _build(dims, 1, True, key, group, runtime, deadline)
    built = clock()
    base = _build(dims, 1, False, key, group, runtime, deadline)
    k = min(k, extra_layers_in_time(clock() - built, deadline.left(), budget_s))  # (a slow PC)
    stages = {"base": base,
              "more": _build(dims, 1 + k, False, key, group, runtime, deadline),
              "head": head}
    steps: dict[tuple[str, int], list[float]] = {(n, r): [] for n in stages for r in ROWS}
    frames: dict[int, list[float]] = {r: [] for r in ROWS}  # the decoder stages' frames' work
    gaps: dict[int, float] = {}  # the (1 + k)-layer stage's last step at each row count
    cpu_shares: list[float] = []  # each timed decode step's process CPU time over its wall time
    prompts: dict[str, list[float]] = {"base": [], "more": []}
    rounds = 0
    while rounds < MAX_ROUNDS and not deadline.passed:
        started = clock()
        for rows, (name, stage) in ((r, s) for r in ROWS for s in stages.items()):
            if deadline.passed:
                break  # past the budget no step starts, the untimed one either
            t0 = clock()
            stage.decode(rows, dims.hidden)  # untimed: the step after a change of shape
            took = clock() - t0
            for _ in range(STEPS):
                if deadline.passed:
                    break
                parts = stage.sent(rows, dims.hidden)
                # waiting for the step of the stage before it
                sleep(IDLE_GAP * gaps.get(rows, took))
                cpu_before, framing = cpu_clock(), 0.0
                if name == "head":  # the last stage: its answer is not hidden states
                    t0 = clock()
                    stage.decode(rows, dims.hidden)
                    took = clock() - t0
                else:
                    took, framing = stage.hop(parts, rows, clock)
                    frames[rows].append(framing)
                steps[(name, rows)].append(took)
                cpu_shares.append(cpu_per_wall(cpu_clock() - cpu_before, took + framing))
                if name == "more":
                    gaps[rows] = took
        for name in prompts:
            if not deadline.passed:
                t0 = clock()
                stages[name].prompt(dims.hidden)
                prompts[name].append(clock() - t0)
        rounds += 1
        reserve = engine_reserve(steps, quota.share if quota else 1.0)
        if rounds >= MIN_ROUNDS and deadline.left() < clock() - started + reserve:
            break  # another round and the coordinator's step after it would not fit
    missing = [f"{n} at {r} rows" for (n, r), v in steps.items() if not v]
    missing += [f"the {n} stage's prompt" for n, v in prompts.items() if not v]
    if missing:
        raise ProfileError(f"profiling {device} ran out of its {budget_s:g} s budget before "
                           f"it timed {', '.join(missing[:3])}: give it more (--budget)")

    def figures(name: str) -> tuple[float, ...]:
        return tuple(_quantile(steps[(name, r)]) for r in ROWS)

    deadline.check("before timing the coordinator's step")
    more = stages["more"]
    engine = time_engine(shape.hidden, shape.vocab, ENGINE_RUNS,
                         engine_steps(_quantile(steps[("more", ROWS[-1])])),
                         lambda rows: more.decode(rows, dims.hidden))
    grown = {name: stage.grown for name, stage in stages.items()}
    stages.clear()
    gc.collect()
    measurement = Measurement(
        key=key, extra_layers=k, base_s=figures("base"), more_s=figures("more"),
        head_s=figures("head"), prompt_tokens=PROMPT_TOKENS,
        base_prompt_s=_quantile(prompts["base"], PROMPT_QUANTILE),
        more_prompt_s=_quantile(prompts["more"], PROMPT_QUANTILE),
        base_bytes=grown["base"], more_bytes=grown["more"], free_memory=free, engine_s=engine,
        frame_s=tuple(_quantile(frames[r]) for r in ROWS), rounds=rounds,
        cpu_share=quota.share if quota else 0.0, quota_period_s=quota.period_s if quota else 0.0,
        cpu_per_wall=_quantile(cpu_shares) if any(cpu_shares) else 0.0)
    return replace(measurement, seconds=clock() - deadline.start)


def cpu_per_wall(cpu_s: float, wall_s: float) -> float:
    """Process CPU seconds per wall second of a timed step (0: no time, or a CPU clock
    that did not move, as a coarse one may not over a short step)."""
    return cpu_s / wall_s if wall_s > 0 and cpu_s > 0 else 0.0


# -- a profile in a process of its own ----------------------------------------------------
def arguments() -> argparse.ArgumentParser:
    """``python -m controlplane.profiling``'s arguments (controlplane/profile_job.py
    passes them)."""
    parser = argparse.ArgumentParser(prog="python -m controlplane.profiling")
    parser.add_argument("--shape", required=True, help="the ModelShape's fields as JSON")
    parser.add_argument("--weights", required=True)
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--int8-form", default=None,
                        help="the served export's INT8 form (default: the format's)")
    parser.add_argument("--exact-experts", action="store_true",
                        help="the served export's experts are exact (zctl export "
                             "--exact-experts)")
    parser.add_argument("--budget", type=float, default=BUDGET_S)
    parser.add_argument("--memory-limit", type=int, default=0)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--turn-held", action="store_true",
                        help="the parent holds this machine's turn to profile for it")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Profile one shape, format and device into a state directory; print the profile's
    JSON on stdout (an error's text on stderr, and exit status 1)."""
    from contextlib import nullcontext
    from pathlib import Path

    from controlplane.profile_store import ProfileStore
    from controlplane.profile_turn import ProfilingTurn

    args = arguments().parse_args(argv)
    try:
        shape = ModelShape(**json.loads(args.shape))
        store = ProfileStore(Path(args.state_dir))
        with nullcontext() if args.turn_held else ProfilingTurn().wait():
            measurement = measure(shape, args.weights, args.device, args.budget,
                                  args.memory_limit, quota=read_quota(),
                                  int8_form=args.int8_form,
                                  exact_experts=args.exact_experts)
        _, path = store.save(shape, measurement)
        text = path.read_text()
    except (ProfileError, ShapeError, TypeError, ValueError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
