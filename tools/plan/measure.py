"""One case: its cluster started with every node profiling itself (the slowed node under
its quota from the start, so its profile is measured slowed), the prediction read from
the coordinator's status once every profile and link is measured, then each stream count
run ``rounds`` times through the generation service (tools.harness.service, as ``zctl
run`` sends requests), every process stopped after.

The prediction is read once every stage's node has also checked its speed since it joined
and ``SPEED_SETTLE_S`` more (controlplane/host_speed.py: a profile measured in the case
takes its reference time from its node's first checks, so its factor is 1 until later
checks move it), or ``SPEED_GRACE_S`` after it first appears.

Measured decode tok/s: one stream's is its tokens after the first over their time (as
``zctl run`` reports it); N streams sent together, the sum of theirs (they decode side by
side from their first token to their last). The median of the rounds is compared. Each
one-stream round also keeps the pipeline's own timing of its steps (the engine's per-step
figures of that busy period: each stage's compute, each hop, the step from submit to
reply), so that each term of the prediction can be set against the running stages'.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.harness.report import err
from tools.plan.cases import STREAMS, Case

if TYPE_CHECKING:
    from controlplane.records import ClusterStatus
    from zctl.launcher.record import ClusterRecord

PREDICTION_TIMEOUT_S = 600.0  # profiles (30 s a device, one machine's in turn) and link probes
SPEED_GRACE_S = 30.0  # the longest wait for the nodes' speed checks once there is a prediction
SPEED_SETTLE_S = 5.0  # then for their next checks (a node's figure is its last 3's median)
WARMUP_TOKENS = 8


def speed_unchecked(status: ClusterStatus) -> list[str]:
    """The nodes running a stage whose speed has not been checked again since they joined
    (their reference workload not timed: controlplane/host_speed.py)."""
    running = {s.node_id for s in status.stages}
    return [n.node_id for n in status.nodes if n.node_id in running and not n.reference_s]


def wait_prediction(record: ClusterRecord, timeout_s: float,
                    speed_grace_s: float = SPEED_GRACE_S,
                    speed_settle_s: float = SPEED_SETTLE_S) -> ClusterStatus:
    """The status once it holds a prediction and every stage's node has checked its speed
    since it joined (a profile measured minutes before, its node's in turn, may be at
    another host speed: the prediction scales it by the speed factor), ``speed_settle_s``
    after that (their next checks), or after ``speed_grace_s`` with a prediction without
    those checks; RuntimeError with what it still lacks after ``timeout_s``."""
    from controlplane.client import ClusterUnreachable, query_status

    deadline = time.monotonic() + timeout_s
    lacking = "no status yet"
    predicted_at = checked_at = None
    while time.monotonic() < deadline:
        try:
            status = query_status(record.control, timeout=2.0)
        except ClusterUnreachable as exc:
            lacking = str(exc)
        else:
            if status.prediction is not None and not status.prediction.error:
                predicted_at = time.monotonic() if predicted_at is None else predicted_at
                unchecked = speed_unchecked(status)
                if not unchecked:
                    checked_at = time.monotonic() if checked_at is None else checked_at
                    if time.monotonic() - checked_at >= speed_settle_s:
                        return status
                if time.monotonic() - predicted_at >= speed_grace_s:
                    err.print(f"  no speed check from {', '.join(unchecked)} in "
                              f"{speed_grace_s:g} s: predicted at the profiles' speed")
                    return status
            else:
                lacking = (status.prediction.error if status.prediction
                           else "no prediction made")
        time.sleep(1.0)
    raise RuntimeError(f"no prediction after {timeout_s:.0f} s: {lacking}")


def measure_streams(serve: str, prompt: str, streams: int, tokens: int) -> float:
    """Decode tok/s of ``streams`` streams of ``tokens`` tokens sent together (module
    docstring)."""
    return timed_streams(serve, prompt, streams, tokens)[0]


def timed_streams(serve: str, prompt: str, streams: int, tokens: int
                  ) -> tuple[float, dict[str, dict[str, float]]]:
    """``measure_streams``'s tok/s and the pipeline's timing of the run's steps (the last
    closing message's: the engine clears its figures when a busy period starts)."""
    from tools.harness.service import bench_request, generate_together

    dones, _ = generate_together(serve, [bench_request(prompt, tokens) for _ in range(streams)])
    return sum(d.tok_s for d in dones), dones[-1].timing


def placement(status: ClusterStatus) -> list[dict[str, Any]]:
    return [{"stage": s.index, "node": s.node_id, "layers": [s.layer_start, s.layer_end]}
            for s in sorted(status.stages, key=lambda s: s.index)]


def run_case(case: Case, root: Path, tokens: int, rounds: int,
             timeout_s: float = PREDICTION_TIMEOUT_S) -> dict[str, Any]:
    """The case's prediction and measurements: ``{"setup", "placement", "speed_factors":
    {node: its speed factor when predicted}, "prediction", "slowed_by", "measured":
    {streams: [tok/s of each round]}, "timing": [each one-stream round's step timing]}``."""
    from contextlib import ExitStack

    from tools.harness.cluster import PROFILE_BUDGET_S
    from tools.harness.models import PROMPT, BenchModel
    from tools.plan.throttle import SlowedNode
    from zctl.launcher.local import start_local_cluster, stop_processes, wait_serving
    from zctl.launcher.processes import runtime_spec

    export_dir = BenchModel.resolve(case.model).export(case.nodes, case.weights)
    shutil.rmtree(root, ignore_errors=True)  # fresh state: every node measures its profile
    err.print(f"[bold]{case.name}[/]: {case.nodes} nodes ({case.cpu_sets} cores), "
              f"{case.delay_ms:g} ms a hop" + (f", the last slowed to {case.slow_share:.0%} "
                                               "of a core" if case.slow_share else ""))
    record = start_local_cluster(export_dir, case.nodes, runtime_spec("f32", None, "CPU"), root,
                                 cpu_sets=case.cpu_sets, link_delay_ms=case.delay_ms,
                                 profile=True, pin_stages=True,  # the case's topology
                                 profile_budget_s=PROFILE_BUDGET_S)
    with ExitStack() as stack:
        stack.callback(stop_processes, record.pids)
        slowed = None
        if case.slow_share:
            slowed = stack.enter_context(SlowedNode(record.pids[-1], case.slow_share))
        wait_serving(record, timeout_s)
        err.print("  serving; waiting for every profile and link to be measured ...")
        status = wait_prediction(record, timeout_s)
        for streams in STREAMS:  # every row count's first steps, before any is timed
            measure_streams(record.serve, PROMPT, streams, WARMUP_TOKENS)
        measured: dict[int, list[float]] = {n: [] for n in STREAMS}
        timing: list[dict[str, dict[str, float]]] = []  # the one-stream rounds'
        for _ in range(rounds):
            for streams in STREAMS:
                tok_s, steps = timed_streams(record.serve, PROMPT, streams, tokens)
                measured[streams].append(tok_s)
                if streams == 1:
                    timing.append(steps)
        return {"setup": case.setup(), "placement": placement(status),
                "speed_factors": {n.node_id: n.speed_factor for n in status.nodes
                                  if n.node_id in {s.node_id for s in status.stages}},
                "prediction": status.prediction, "slowed_by": slowed.method if slowed else None,
                "measured": measured, "timing": timing}
