"""A node slowed as an older PC would be: its process group held to a share of a core.

Where this process may write the cgroup hierarchy (root), the node goes into a cgroup of
its own with a CPU quota: cgroup v2's ``cpu.max``, else cgroup v1's ``cpu.cfs_quota_us``;
the child processes it starts later (its profiler) are in it too. Elsewhere a thread stops
and continues the node's process group in turn (SIGSTOP/SIGCONT), ``share`` of every
period running. Either way the node's profile, measured after it joins, is measured slowed.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PERIOD_S = 0.02  # a short period: a step of a few ms is slowed, not paused now and then


@dataclass(frozen=True)
class Quota:
    """``share`` of one core as a cgroup quota: ``quota_us`` of every ``period_us``."""

    quota_us: int
    period_us: int

    @classmethod
    def of(cls, share: float, period_s: float = PERIOD_S) -> Quota:
        if not 0 < share < 1:
            raise ValueError(f"a slowed node's share of a core is in (0, 1), got {share}")
        period = round(period_s * 1e6)
        return cls(max(1000, round(share * period)), period)  # the kernel's least: 1 ms

    def duty(self) -> tuple[float, float]:
        """(running, stopped) seconds of each period, for the SIGSTOP/SIGCONT throttle."""
        run = self.quota_us / 1e6
        return run, self.period_us / 1e6 - run


def cgroup_kind(root: Path = CGROUP) -> str:
    """"v2", "v1" or "" (no CPU controller this process may write)."""
    if "cpu" in _read(root / "cgroup.controllers").split() and os.access(root, os.W_OK):
        return "v2"
    if (root / "cpu" / "cpu.cfs_quota_us").is_file() and os.access(root / "cpu", os.W_OK):
        return "v1"
    return ""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of process group ``pgid`` now."""
    members = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            fields = _read(entry / "stat").rpartition(")")[2].split()
            if len(fields) > 2 and fields[2] == str(pgid):
                members.append(int(entry.name))
    return sorted(members)


class SlowedNode:
    """Holds process group ``pgid`` to ``share`` of a core while entered; ``method`` says
    how (cgroup v2, cgroup v1, SIGSTOP/SIGCONT)."""

    def __init__(self, pgid: int, share: float, root: Path = CGROUP) -> None:
        self.pgid, self.quota, self.root = pgid, Quota.of(share), root
        self.method = ""
        self._cgroup: Path | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SlowedNode:
        kind = cgroup_kind(self.root)
        if kind:
            try:
                self._enter_cgroup(kind)
                self.method = f"cgroup {kind} CPU quota"
                return self
            except OSError:
                self._leave_cgroup()
        run, stopped = self.quota.duty()
        self._thread = threading.Thread(target=self._duty_cycle, args=(run, stopped),
                                        name="slowed-node", daemon=True)
        self._thread.start()
        self.method = "SIGSTOP/SIGCONT duty cycle"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            _signal(self.pgid, signal.SIGCONT)
        self._leave_cgroup()

    def _enter_cgroup(self, kind: str) -> None:
        base = self.root if kind == "v2" else self.root / "cpu"
        self._cgroup = base / f"zctl-bench-{os.getpid()}-{self.pgid}"
        self._cgroup.mkdir()
        q = self.quota
        if kind == "v2":
            (self._cgroup / "cpu.max").write_text(f"{q.quota_us} {q.period_us}")
        else:
            (self._cgroup / "cpu.cfs_period_us").write_text(str(q.period_us))
            (self._cgroup / "cpu.cfs_quota_us").write_text(str(q.quota_us))
        for pid in group_members(self.pgid):
            (self._cgroup / "cgroup.procs").write_text(str(pid))

    def _leave_cgroup(self) -> None:
        """Move whatever is left in the cgroup back to its parent and remove it."""
        if self._cgroup is None or not self._cgroup.is_dir():
            return
        for pid in _read(self._cgroup / "cgroup.procs").split():
            try:
                (self._cgroup.parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it ended meanwhile
        try:
            self._cgroup.rmdir()
        except OSError:
            pass
        self._cgroup = None

    def _duty_cycle(self, run: float, stopped: float) -> None:
        while not self._stop.wait(run):
            if not _signal(self.pgid, signal.SIGSTOP):
                return
            self._stop.wait(stopped)
            if not _signal(self.pgid, signal.SIGCONT):
                return


def _signal(pgid: int, signum: int) -> bool:
    """Signal the group; False once it is gone."""
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False
