"""A node's profile job: it measures in this machine's turn (two nodes of one PC, in
different ZCTL_HOMEs, never measure at once), the wait for the turn counts against
neither its budget nor its child's time limit, and a node stopped while it waits stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from controlplane import profile_job
from controlplane.messages import ProfileReport
from controlplane.planner.measured import Measurement
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import GRAPH_VERSION, ProfileKey
from controlplane.planner.shape import ModelShape
from controlplane.profile_job import ProfileJob, ProfileTask
from controlplane.profile_store import ProfileStore
from controlplane.profile_turn import LOCK, ProfilingTurn

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "tests" / "helpers" / "fake_profiler.py"
TINY = ModelShape("tiny", num_layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2,
                  head_dim=16, vocab=384, tied_embeddings=True)
VERSION = "2026.4.1-test"
TASK = ProfileTask(TINY, "int8", "CPU")


def _profile_json(root: Path) -> Path:
    """A profile's JSON as the profiling process prints it."""
    rows = (1e-4, 2e-4, 3e-4, 4e-4)
    key = ProfileKey(TINY.fingerprint(), "int8", "CPU", VERSION, GRAPH_VERSION)
    measurement = Measurement(key, 2, rows, tuple(3 * r for r in rows),
                              tuple(10 * r for r in rows), 128, 1e-3, 5e-3, 1 << 20, 5 << 20,
                              8 << 30, engine_s=rows, frame_s=rows, rounds=3, seconds=0.3)
    _, path = ProfileStore(root / "made", VERSION).save(TINY, measurement)
    return path


def _fake_env(tmp_path: Path, seconds: float) -> dict[str, str]:
    return {"FAKE_PROFILE_LOG": str(tmp_path / "measured.log"),
            "FAKE_PROFILE_JSON": str(_profile_json(tmp_path)),
            "FAKE_PROFILE_SECONDS": str(seconds)}


def _spans(log: Path) -> list[tuple[float, float, str, bool]]:
    """Each fake measurement's (start, end, ZCTL_HOME, whether it was told its turn is
    held), in start order."""
    starts: dict[str, float] = {}
    spans = []
    for line in log.read_text().splitlines():
        event, at, home, held = line.split()
        if event == "start":
            starts[home] = float(at)
        else:
            spans.append((starts.pop(home), float(at), home, held == "True"))
    return sorted(spans)


DRIVER = """
import json, sys, time
from controlplane.planner.shape import ModelShape
from controlplane.profile_job import ProfileJob, ProfileTask
from zctl.paths import zctl_home
task = ProfileTask(ModelShape(**json.loads(sys.argv[1])), "int8", "CPU")
job = ProfileJob("node", zctl_home() / "node", openvino=sys.argv[3],
                 profiler=[sys.executable, sys.argv[2]])
first = job.request(task, 5.0)
while (report := job.finished()) is None:
    time.sleep(0.02)
print(first.state, report.state, report.detail)
"""


@pytest.mark.slow
def test_nodes_of_one_machine_in_different_homes_never_measure_at_once(tmp_path: Path) -> None:
    """Two node processes, each with a ZCTL_HOME of its own and one runtime directory (one
    user on one PC), profile at once: their measurements follow one another."""
    env = {**os.environ, **_fake_env(tmp_path, 0.4), "XDG_RUNTIME_DIR": str(tmp_path / "run"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    nodes = [subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(asdict(TINY)), str(FAKE),
                               VERSION], env={**env, "ZCTL_HOME": str(tmp_path / home)},
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for home in ("home-a", "home-b")]
    outputs = [node.communicate(timeout=60) for node in nodes]
    for node, (out, errors) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, errors
        assert out.split()[:2] == ["measuring", "measured"], out
    (a_start, a_end, a_home, a_held), (b_start, b_end, b_home, b_held) = _spans(
        tmp_path / "measured.log")
    assert {a_home, b_home} == {str(tmp_path / "home-a"), str(tmp_path / "home-b")}
    assert a_held and b_held  # each child told its parent holds the turn for it
    assert a_end <= b_start  # one after the other, never side by side


@pytest.mark.slow
def test_the_wait_for_the_turn_counts_against_neither_budget_nor_time_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child's time limit is 2 x budget + START_GRACE_S (0.4 + 0.5 s here): a node that
    waited 1.5 s for its turn still has all of it, and measures once the turn is free."""
    for name, value in _fake_env(tmp_path, 0.2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(profile_job, "START_GRACE_S", 0.5)
    turn = ProfilingTurn(tmp_path / "run" / LOCK)
    job = ProfileJob("node", tmp_path / "node", openvino=VERSION, turn=turn,
                     profiler=[sys.executable, str(FAKE)])
    held = turn.wait()  # another process of this machine is profiling
    assert job.request(TASK, 0.2) == ProfileReport("measuring", detail="not profiled yet")
    time.sleep(1.5)
    assert job.measuring and not (tmp_path / "measured.log").exists()
    released = time.time()
    held.release()
    report = _finished(job, 10.0)
    assert report is not None and report.state == "measured", report
    ((start, _, _, _),) = _spans(tmp_path / "measured.log")
    assert start >= released


def _finished(job: ProfileJob, timeout_s: float) -> ProfileReport | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = job.finished()
        if report is not None:
            return report
        time.sleep(0.02)
    return None


def test_a_node_stopped_while_it_waits_for_its_turn_stops_and_starts_nothing(
        tmp_path: Path) -> None:
    turn = ProfilingTurn(tmp_path / "run" / LOCK)
    job = ProfileJob("node", tmp_path / "node", openvino=VERSION, turn=turn,
                     profiler=["false"])
    with turn.wait():
        assert job.request(TASK, 30.0).state == "measuring"
        time.sleep(0.3)
        assert job.measuring
        stopped = time.monotonic()
        job.stop()
        while job.measuring and time.monotonic() - stopped < 2.0:
            time.sleep(0.01)
        assert not job.measuring  # within a poll or so, not at the turn's end
        assert job.finished() is None  # no report: nothing measured ("false" would fail)
        assert [t for t in threading.enumerate() if t.name == "zctl-profile"] == []
        assert job.request(TASK, 30.0).state == "not-profiled"  # stopped: no new one


@pytest.mark.parametrize("exact", [False, True])
def test_the_child_is_told_the_served_export_s_forms(tmp_path: Path, exact: bool) -> None:
    """The INT8 form and exact experts reach the profiler's own arguments."""
    from controlplane.profiling import arguments

    task = ProfileTask(PRESETS["gpt-oss-20b"], "int8", "CPU", "u8-channel", exact)
    job = ProfileJob("node", tmp_path / "node", profiler=["profiler"])
    command = job.command(task, 7.0)
    assert command[0] == "profiler" and ("exact experts" in task.describe()) is exact
    args = arguments().parse_args(command[1:])
    assert (args.weights, args.int8_form, args.exact_experts, args.budget) == (
        "int8", "u8-channel", exact, 7.0)
