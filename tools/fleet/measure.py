"""Starting the arms side by side, a joining node's re-plan, and the rounds of runs.

A first cluster, stopped before the arms start, measures the two nodes' profiles; every
planned arm starts with a copy of them (the same cores of the same machine: the same
PCs), so that each is placed by the planner from its first placement on (the 2-node arm
as the joiners' clusters are before they join), and only a node new to the fleet (the
joiner, a node under a quota the copy was not measured under) measures its own. A
joining node is started once its cluster serves with a prediction, slowed from its first
instant when it is the slow one, and the cluster counts as settled once the joiner's
profile is in, the coordinator's re-plan is decided (applied, or not
worth it: ``cluster status``'s placement) and the pipeline serves with a prediction.

Each stream count is measured as tools/plan measures it (``measure_streams``: decode
tok/s through the generation service); every arm is warmed first, then the arms take
turns, in an order rotated each round (``tools.harness.order.rotated``).
"""

from __future__ import annotations

import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.fleet.cases import MODEL, STREAMS, WEIGHTS, Arm
from tools.harness.cluster import PROFILE_BUDGET_S
from tools.harness.order import rotated
from tools.harness.report import err

if TYPE_CHECKING:
    from controlplane.records import ClusterStatus
    from zctl.launcher.record import ClusterRecord

WARMUP_TOKENS = 8
SETTLE_S = 3.0  # a settled placement must hold this long


@dataclass
class RunningArm:
    """An arm's cluster: its record and state root, how its slow node is slowed, the
    joiner's node id, and its runs' tok/s at each stream count."""

    arm: Arm
    record: ClusterRecord
    root: Path
    slowed_by: str = ""
    joiner: str = ""
    measured: dict[int, list[float]] = field(default_factory=lambda: {n: [] for n in STREAMS})
    failed: str = ""  # why its runs stopped (its service went away): it has no figures


def arm_cpu_lists(arm: Arm, available: list[int]) -> list[str]:
    """Each of the arm's processes' CPU list on this machine's ``available`` cores;
    ValueError when it names a core there is not."""
    cores = sorted(available)
    if max(arm.cores) >= len(cores):
        raise ValueError(f"arm {arm.name} needs {max(arm.cores) + 1} cores; this process may "
                         f"use {len(cores)}")
    return [str(cores[i]) for i in arm.cores]


def seed_profiles(source: Path, root: Path, processes: int) -> None:
    """Copy the profiles ``source``'s cluster measured (its coordinator's and node 1's)
    into ``root``'s first ``processes`` state directories."""
    for name in ["coordinator", *(f"node{i}" for i in range(1, processes))]:
        profiles = source / name / "profiles"
        if profiles.is_dir():
            shutil.copytree(profiles, root / name / "profiles", dirs_exist_ok=True)


def start_arm(arm: Arm, root: Path, stack: ExitStack, cpus: list[str], timeout_s: float,
              seed: Path | None = None) -> RunningArm:
    """Start the arm's cluster under ``root`` (its processes stopped when ``stack``
    closes) and return it serving: planned arms with a prediction, a joining node
    joined and its re-plan decided. ClusterError or RuntimeError when it does not."""
    from controlplane.nodeinfo import load_or_create_node_id
    from tools.harness.models import BenchModel
    from tools.plan.measure import wait_prediction
    from tools.plan.throttle import SlowedNode
    from zctl.launcher.local import start_local_cluster, start_local_node, stop_processes, wait_serving
    from zctl.launcher.processes import LinkShape, runtime_spec

    export_dir = BenchModel.resolve(MODEL).export(arm.stages, WEIGHTS)
    shutil.rmtree(root, ignore_errors=True)
    first = arm.nodes - 1 if arm.joins else arm.nodes
    if seed is not None:
        seed_profiles(seed, root, first)
    last = LinkShape(delay_ms=arm.delay_ms)
    links = None if arm.joins or not arm.delay_ms else [LinkShape()] * (first - 1) + [last]
    err.print(f"[bold]{arm.name}[/]: {arm.setup()}")
    record = start_local_cluster(export_dir, first, runtime_spec("f32", None, "CPU"), root,
                                 cpu_sets="split", cpus=cpus[:first], links=links,
                                 profile=arm.planned, pin_stages=not arm.planned,
                                 profile_budget_s=PROFILE_BUDGET_S)
    stack.callback(stop_processes, record.pids)  # (the joiner's pid is added to this list)
    running = RunningArm(arm, record, root)
    if arm.slow_share and not arm.joins:
        running.slowed_by = stack.enter_context(SlowedNode(record.pids[-1], arm.slow_share)).method
    wait_serving(record, timeout_s)
    if arm.planned:
        wait_prediction(record, timeout_s)
    if arm.joins:
        index = arm.nodes - 1
        running.joiner = load_or_create_node_id(root / f"node{index}")
        pid, log = start_local_node(record, index, root, link=last, cpus=cpus[index],
                                    profile=True)
        record.pids.append(pid)
        record.logs.append(log)
        if arm.slow_share:
            running.slowed_by = stack.enter_context(SlowedNode(pid, arm.slow_share)).method
        err.print(f"  {running.joiner} joins; waiting for its profile and the re-plan ...")
        wait_settled(record, running.joiner, timeout_s)
    return running


def settled(status: ClusterStatus, joiner: str) -> bool:
    """Whether the joiner's profile is in (the planner has placed or left it out) or
    failed (it stays a spare), no re-plan is under way, and the pipeline serves with a
    prediction."""
    node = next((n for n in status.nodes if n.node_id == joiner), None)
    placed = {s.node_id for s in status.stages}
    decided = node is not None and (
        (node.profile is not None and (joiner in placed or joiner in status.left_out))
        or node.profile_state.startswith("failed"))
    return (decided and status.pipeline == "serving" and status.prediction is not None
            and not status.prediction.error and "re-planning" not in status.placement)


def wait_settled(record: ClusterRecord, joiner: str, timeout_s: float) -> ClusterStatus:
    """The status once ``settled`` has held for SETTLE_S; RuntimeError after
    ``timeout_s`` with the last status's placement."""
    from controlplane.client import ClusterUnreachable, query_status

    deadline = time.monotonic() + timeout_s
    since, last = None, "no status yet"
    while time.monotonic() < deadline:
        try:
            status = query_status(record.control, timeout=2.0)
        except ClusterUnreachable as exc:
            last, since = str(exc), None
        else:
            last = f"{status.pipeline}; {status.placement or 'no placement note'}"
            if settled(status, joiner):
                since = since or time.monotonic()
                if time.monotonic() - since >= SETTLE_S:
                    return status
            else:
                since = None
        time.sleep(1.0)
    raise RuntimeError(f"the joiner {joiner} did not settle in {timeout_s:.0f} s: {last}")


def run_rounds(arms: dict[str, RunningArm], rounds: int, tokens: int) -> None:
    """Warm every arm at every stream count, then ``rounds`` rounds of the arms in turn,
    each arm's runs appended to its ``measured``; an arm whose runs fail (its service went
    away) is marked ``failed`` and left out of the later rounds, the others go on."""
    from tools.harness.models import PROMPT
    from tools.plan.measure import measure_streams

    def run(running: RunningArm, streams: int, count: int) -> float | None:
        try:
            return measure_streams(running.record.serve, PROMPT, streams, count)
        except RuntimeError as exc:  # ServiceUnavailable, a generation's error
            running.failed = f"its runs stopped: {exc}"
            err.print(f"[red]{running.arm.name}: {running.failed}[/]", highlight=False)
            return None

    for running in arms.values():
        for streams in STREAMS:
            if not running.failed:
                run(running, streams, WARMUP_TOKENS)
    for r in range(rounds):
        err.print(f"  round {r + 1} of {rounds}")
        for name in rotated([n for n, a in arms.items() if not a.failed], r):
            for streams in STREAMS:
                got = run(arms[name], streams, tokens)
                if got is None:
                    break
                arms[name].measured[streams].append(got)


def final_status(running: RunningArm) -> dict[str, Any]:
    """The arm's placement after its runs, as ``cluster status`` shows it."""
    from controlplane.client import query_status
    from tools.plan.measure import placement

    status = query_status(running.record.control, timeout=5.0)
    roles = {status.coordinator_id: "coordinator"}
    for i in range(1, running.arm.nodes):
        node_id = running.root / f"node{i}" / "node_id"
        if node_id.is_file():
            roles[node_id.read_text().strip()] = f"node{i}"
    stages = [{**s, "node": roles.get(s["node"], s["node"])} for s in placement(status)]
    return {"stages": stages, "placement_note": status.placement,
            "left_out": {roles.get(k, k): v for k, v in status.left_out.items()},
            "slowed_by": running.slowed_by or None,
            "predicted_tok_s": round(status.prediction.tok_s, 1)
            if status.prediction and not status.prediction.error else None}
