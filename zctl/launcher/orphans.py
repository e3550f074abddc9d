"""zctl's coordinator and node processes, found by their command lines, and the orphans
among them: the processes of a zctl home whose command is gone and that no record
(cluster.json) accounts for, e.g. after cluster.json was removed or overwritten, or after
a command was killed before it could stop them. ``zctl cluster down`` stops them.

A process of a local cluster runs ``python -m zctl.launcher ROLE CONFIG_JSON``; its
configuration says its state dir (which zctl home it belongs to) and the pid of the
command that started it (``parent``). That command is gone when the process has another
parent now: a process is re-parented when its parent exits. ``running_processes`` reads
them from /proc (this user's only); the rest are pure functions of what it read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from pathlib import Path, PurePath

from zctl.launcher.processes import ROLES

PROC = Path("/proc")


@dataclass(frozen=True)
class LauncherProcess:
    """A coordinator or node process as its command line and /proc show it."""

    pid: int
    ppid: int  # its parent now
    role: str  # coordinator | node
    state_dir: str  # absolute: the zctl home it belongs to is above it
    parent: int = 0  # the pid of the command that started it (0: not recorded)

    @property
    def command_gone(self) -> bool:
        """Whether the command that started it is gone: the process has another parent now
        (it was re-parented when that command exited), or none was recorded."""
        return self.parent == 0 or self.ppid != self.parent

    def describe(self) -> str:
        return f"{self.role} {self.pid} ({self.state_dir})"


def launcher_process(pid: int, ppid: int, argv: list[str]) -> LauncherProcess | None:
    """The coordinator or node process ``argv`` runs, or None: another program, or a
    configuration without an absolute state dir (whose zctl home cannot be told)."""
    rest = next((argv[i + 2:] for i in range(len(argv) - 1)
                 if argv[i] == "-m" and argv[i + 1] == "zctl.launcher"), None)
    if rest is None or len(rest) != 2 or rest[0] not in ROLES:
        return None
    try:
        config = json.loads(rest[1])
    except ValueError:
        return None
    if not isinstance(config, dict):
        return None
    state_dir, parent = config.get("state_dir"), config.get("parent", 0)
    if not isinstance(state_dir, str) or not PurePath(state_dir).is_absolute():
        return None
    if not isinstance(parent, int) or isinstance(parent, bool) or parent < 0:
        parent = 0
    return LauncherProcess(pid, ppid, rest[0], os.path.normpath(state_dir), parent)


def within(path: str, root: Path) -> bool:
    """Whether ``path`` is ``root`` or below it (both absolute)."""
    return PurePath(path).is_relative_to(root)


def under(processes: Iterable[LauncherProcess], root: Path) -> list[LauncherProcess]:
    """The processes whose state dir is below ``root`` (a cluster's, or a zctl home)."""
    return [p for p in processes if within(p.state_dir, root)]


def orphans(processes: Iterable[LauncherProcess], home: Path,
            accounted: Collection[int] = ()) -> list[LauncherProcess]:
    """The processes of zctl home ``home`` (their state dirs below it) whose command is
    gone and that ``accounted`` (the pids of the home's record) does not hold. A process
    whose parent is one of them is a fork of it caught before its exec (a subprocess it
    starts shows its command line for a moment), never an orphan."""
    processes = list(processes)
    launchers = {p.pid for p in processes}
    return [p for p in under(processes, home)
            if p.command_gone and p.pid not in accounted and p.ppid not in launchers]


def running_processes(proc: Path = PROC, uid: int | None = None) -> list[LauncherProcess]:
    """The coordinator and node processes that run now as user ``uid`` (default: this
    one), read from ``proc``, by pid; their state dirs with symbolic links resolved."""
    uid = os.getuid() if uid is None else uid
    found = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            state, ppid = (entry / "stat").read_text().rpartition(")")[2].split()[:2]
        except (OSError, ValueError):
            continue  # it ended meanwhile, or is no process directory
        if state == "Z":
            continue
        process = launcher_process(int(entry.name), int(ppid),
                                   [os.fsdecode(a) for a in argv])
        if process is not None:
            found.append(replace(process, state_dir=os.path.realpath(process.state_dir)))
    return sorted(found, key=lambda p: p.pid)
