"""A node's profile for its cluster's model: kept in its state directory, or measured in a
process of its own (``python -m controlplane.profiling``) while the node goes on serving.

A node answers the coordinator's ``ProfileRequest`` at once: with the profile it keeps
(``kept``), or with ``measuring`` when it starts measuring one (the first time it joins
with a model, or when the one it keeps is stale or damaged, logged with the reason), or
``not-profiled`` when it was told not to measure. The measurement runs in a child process
watched by a thread, so the control loop never waits on it, the synthetic stages' memory
goes with the child, and a child that crashes or overruns its budget (killed at twice the
budget and a minute for its start) fails the profile, not the node; ``finished`` hands the
result over once, as the report to send.

The thread first waits for this machine's turn to profile (controlplane/profile_turn.py:
the processes of one PC measure one at a time, whatever their state directories), and
hands the held turn to the child; the budget and the child's time limit count from the
child's start, not the wait. A node stopped while it waits gives up the wait within a poll.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from controlplane.cpu_quota import current_share
from controlplane.messages import ProfileReport
from controlplane.planner.measured import mismatches, profile_of, record_from_dict
from controlplane.planner.profile import ProfileError
from controlplane.planner.shape import ModelShape
from controlplane.profile_store import NOT_PROFILED, ProfileStore
from controlplane.profile_turn import ProfilingTurn
from controlplane.records import ProfileRecord
from zctl.weights import export_int8_form

log = logging.getLogger("zctl.controlplane")
START_GRACE_S = 60.0  # a child's imports and start, beyond its budget
PROFILER = (sys.executable, "-m", "controlplane.profiling")  # the child's program


@dataclass(frozen=True)
class ProfileTask:
    shape: ModelShape
    weights: str
    device: str
    int8_form: str | None = None  # the served export's (None: the format's default)
    exact_experts: bool = False  # the served export's experts are exact (zctl export)

    def describe(self) -> str:
        form = f", INT8 {self.int8_form}" if self.int8_form else ""
        experts = ", exact experts" if self.exact_experts else ""
        return f"{self.shape.name} ({self.weights}{form}{experts}) on {self.device}"


class ProfileJob:
    """The profile of one node (``name`` in its log lines) and its measurement, if any:
    measured by ``profiler`` (the child's program, taking ``python -m
    controlplane.profiling``'s arguments) in this machine's ``turn``."""

    def __init__(self, name: str, state_dir: Path, auto: bool = True, memory_limit: int = 0,
                 openvino: str | None = None, turn: ProfilingTurn | None = None,
                 profiler: Sequence[str] = PROFILER) -> None:
        self.name = name
        self.store = ProfileStore(state_dir, openvino)
        self.auto = auto
        self.memory_limit = memory_limit
        self.turn = turn or ProfilingTurn()
        self.profiler = list(profiler)
        self._lock = threading.Lock()
        self._task: ProfileTask | None = None  # being measured (or waiting for its turn)
        self._child: subprocess.Popen[str] | None = None
        self._done: ProfileReport | None = None
        self._stop = threading.Event()

    def request(self, task: ProfileTask, budget_s: float) -> ProfileReport:
        """The report to answer a request with now (module docstring)."""
        record, why = self.store.load(task.shape, task.weights, task.device, current_share(),
                                      task.int8_form, task.exact_experts)
        if record is not None:
            return ProfileReport("kept", record)
        with self._lock:
            if self._task == task:
                return ProfileReport("measuring", detail=why)
            if not self.auto or self._task is not None or self._stop.is_set():
                return ProfileReport("not-profiled", detail=why)
            self._task = task
        log.info("%s: profiling %s, at most %g s: %s", self.name, task.describe(), budget_s,
                 why if why.startswith("its profile") else "not profiled yet")
        threading.Thread(target=self._measure, args=(task, budget_s), daemon=True,
                         name="zctl-profile").start()
        return ProfileReport("measuring", detail=why)

    def _measure(self, task: ProfileTask, budget_s: float) -> None:
        report: ProfileReport | None
        try:
            turn = self.turn.take(self._stop, lambda: log.info(
                "%s: waiting for this machine's turn to profile (another zctl process here "
                "is profiling)", self.name))
        except OSError as exc:
            turn, report = None, ProfileReport("failed", detail=f"profiling {task.describe()}: "
                                               f"no turn to profile on this machine: {exc}")
        else:
            report = None  # stopped while waiting: no report
        if turn is not None:
            with turn:
                report = self._run_child(task, budget_s, turn.fd)
        if report is not None and report.state == "failed":
            log.warning("%s: %s", self.name, report.detail)
        with self._lock:
            self._done, self._task, self._child = report, None, None

    def command(self, task: ProfileTask, budget_s: float) -> list[str]:
        """The child that measures ``task``: ``profiler`` with controlplane.profiling's
        arguments."""
        return [*self.profiler,
                "--shape", json.dumps(asdict(task.shape)), "--weights", task.weights,
                "--device", task.device, "--budget", str(budget_s),
                "--memory-limit", str(self.memory_limit), "--state-dir",
                str(self.store.dir.parent), "--turn-held",
                *(("--int8-form", task.int8_form) if task.int8_form else ()),
                *(("--exact-experts",) if task.exact_experts else ())]

    def _run_child(self, task: ProfileTask, budget_s: float, turn_fd: int
                   ) -> ProfileReport | None:
        """The child's measurement in the turn held as ``turn_fd`` (handed to it); None
        when the job was stopped before it started."""
        command = self.command(task, budget_s)
        limit = 2 * budget_s + START_GRACE_S
        try:
            with self._lock:
                if self._stop.is_set():
                    return None
                self._child = child = subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    pass_fds=(turn_fd,))
            out, errors = child.communicate(timeout=limit)
            if child.returncode != 0:
                lines = [line for line in errors.splitlines() if line.strip()]
                raise ProfileError(lines[-1] if lines else
                                   f"the profiling process ended with {child.returncode}")
            record = record_from_dict(json.loads(out), "the profiling process's output")
            log.info("%s: profiled %s in %.1f s", self.name, task.describe(), record.seconds)
            return ProfileReport("measured", record)
        except subprocess.TimeoutExpired:
            self._kill()
            return ProfileReport("failed", detail=f"profiling {task.describe()} did not end "
                                                  f"within {limit:g} s")
        except (ProfileError, OSError, ValueError) as exc:
            return ProfileReport("failed", detail=f"profiling {task.describe()}: {exc}")

    def finished(self) -> ProfileReport | None:
        """A measurement's report, once, when it has ended."""
        with self._lock:
            done, self._done = self._done, None
        return done

    @property
    def measuring(self) -> bool:
        with self._lock:
            return self._task is not None

    def _kill(self) -> None:
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()

    def stop(self) -> None:
        """Stop a measurement under way (its child is killed) or waiting for its turn."""
        with self._lock:
            self._stop.set()
        self._kill()


def report_outcome(report: ProfileReport, task: ProfileTask, openvino: str
                   ) -> tuple[ProfileRecord | None, str]:
    """What the coordinator keeps of a node's report: the profile, if it is one for
    ``task`` measured with ``openvino`` (the node's), and the node's profile state."""
    if report.state == "measuring":
        return None, "measuring"
    if report.state == "not-profiled":
        detail = report.detail if report.detail not in ("", NOT_PROFILED) else ""
        return None, NOT_PROFILED + (f" ({detail})" if detail else "")
    if report.state == "failed" or report.profile is None:
        return None, f"failed: {report.detail or 'no reason given'}"
    record = report.profile
    stale = mismatches(record, task.exact_experts, shape=task.shape.fingerprint(),
                       weights=task.weights,
                       device=task.device, openvino=openvino,
                       int8_form=export_int8_form(task.weights, task.int8_form))
    if stale:
        return None, (f"failed: it reported a profile measured for {'; '.join(stale)}: "
                      "profile it again (zctl node profile)")
    try:
        profile_of(record)
    except ProfileError as exc:
        return None, f"failed: its profile cannot be used: {exc}"
    return record, report.state
