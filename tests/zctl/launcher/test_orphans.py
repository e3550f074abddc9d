"""Finding zctl's coordinator and node processes and the orphans among them
(zctl.launcher.orphans) from /proc-like input: what a command line says, which zctl home a
process belongs to, whether its command is gone, and what a record accounts for."""

from __future__ import annotations

import json
import os
from pathlib import Path

from zctl.launcher.orphans import (
    LauncherProcess,
    launcher_process,
    orphans,
    running_processes,
    under,
    within,
)
from zctl.launcher.processes import CoordinatorProcess, NodeProcess, process_command

HOME = Path("/home/ann/.cache/zctl")


def argv_of(config: CoordinatorProcess | NodeProcess) -> list[str]:
    return ["/usr/bin/python3", *process_command(config)]


def node(state_dir: str, parent: int = 0, ends: bool = False) -> list[str]:
    return argv_of(NodeProcess("tcp://127.0.0.1:5550", state_dir=state_dir, parent=parent,
                               ends_with_parent=ends))


def test_a_command_line_says_the_process_its_home_and_its_command() -> None:
    coordinator = argv_of(CoordinatorProcess("/x", state_dir=f"{HOME}/local/coordinator",
                                             parent=41))
    assert launcher_process(50, 41, coordinator) == LauncherProcess(
        50, 41, "coordinator", f"{HOME}/local/coordinator", 41)
    found = launcher_process(51, 1, node(f"{HOME}/embedded/41-ab/node1/", 41, ends=True))
    assert found is not None and found.state_dir == f"{HOME}/embedded/41-ab/node1"
    assert found.command_gone  # re-parented to init: its command (41) exited


def test_other_command_lines_are_none_of_zctls_processes() -> None:
    config = json.dumps({"coordinator": "tcp://h:1", "state_dir": f"{HOME}/node"})
    for argv in (["sleep", "60"], ["python", "-m", "zctl", "serve"],
                 ["python", "-m", "zctl.launcher", "node"],  # no configuration
                 ["python", "-m", "zctl.launcher", "worker", config],
                 ["python", "-m", "zctl.launcher", "node", "{not json"],
                 ["python", "-m", "zctl.launcher", "node", "[1, 2]"],
                 ["python", "-m", "zctl.launcher", "node", config, "more"],
                 node("relative/node"),  # whose home cannot be told: never stopped
                 argv_of(NodeProcess("tcp://h:1"))):  # no state dir: likewise
        assert launcher_process(7, 1, argv) is None, argv
    odd = json.dumps({"state_dir": f"{HOME}/node", "parent": "12"})
    found = launcher_process(7, 1, ["python", "-m", "zctl.launcher", "node", odd])
    assert found is not None and found.parent == 0 and found.command_gone  # unknown command


def test_a_process_belongs_to_the_home_its_state_dir_is_under() -> None:
    assert within(f"{HOME}/local/node1", HOME) and within(str(HOME), HOME)
    assert not within(f"{HOME}-other/local/node1", HOME)  # a prefix of the name is not enough
    assert not within("/home/bob/.cache/zctl/local/node1", HOME)
    processes = [LauncherProcess(1, 1, "node", f"{HOME}/embedded/9-x/node1"),
                 LauncherProcess(2, 1, "node", f"{HOME}/local/node1")]
    assert [p.pid for p in under(processes, HOME / "embedded" / "9-x")] == [1]


def test_orphans_are_the_homes_processes_whose_command_is_gone_and_no_record_holds() -> None:
    processes = [
        # cluster up's coordinator and node: their command exited, cluster.json holds them
        LauncherProcess(10, 1, "coordinator", f"{HOME}/local/coordinator", 5),
        LauncherProcess(11, 1, "node", f"{HOME}/local/node1", 5),
        # the same after cluster.json was overwritten: nothing holds them
        LauncherProcess(20, 1, "coordinator", f"{HOME}/local/coordinator", 6),
        # an embedded cluster whose zctl run (30) still runs: its own
        LauncherProcess(31, 30, "coordinator", f"{HOME}/embedded/30-a/coordinator", 30),
        # one whose zctl run (40) was killed: re-parented to a subreaper
        LauncherProcess(41, 777, "node", f"{HOME}/embedded/40-b/node1", 40),
        # a benchmark's cluster under this home while the benchmark (50) runs
        LauncherProcess(51, 50, "node", f"{HOME}/bench/node1", 50),
        # another home's cluster whose command is gone: not this home's to stop
        LauncherProcess(60, 1, "node", "/srv/zctl/local/node1", 8),
        # started by an older zctl that did not record its command: held by nothing
        LauncherProcess(70, 1, "node", f"{HOME}/cluster/node"),
        # the benchmark's node (51) forking a subprocess, caught before its exec
        LauncherProcess(52, 51, "node", f"{HOME}/bench/node1", 50),
    ]
    assert [p.pid for p in orphans(processes, HOME, accounted=[10, 11])] == [20, 41, 70]
    assert [p.pid for p in orphans(processes, HOME)] == [10, 11, 20, 41, 70]
    assert orphans(processes, Path("/srv/zctl"), accounted=[]) == [processes[6]]


def _fake_proc(root: Path, pid: int, ppid: int, argv: list[str], state: str = "S") -> None:
    entry = root / str(pid)
    entry.mkdir(parents=True)
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "stat").write_text(f"{pid} (python3 -m zctl) {state} {ppid} {pid} {pid} 0 -1\n")


def test_running_processes_are_read_from_proc(tmp_path: Path) -> None:
    proc, home = tmp_path / "proc", tmp_path / "home"
    _fake_proc(proc, 100, 1, node(f"{home}/local/node1", 99))
    _fake_proc(proc, 101, 1, node(f"{home}/local/node2", 99), state="Z")  # ended
    _fake_proc(proc, 102, 1, ["bash"])
    (proc / "self").mkdir()
    (proc / "103").mkdir()  # gone while being read: no cmdline
    (proc / "uptime").write_text("1 1\n")
    (home / "local").mkdir(parents=True)
    (tmp_path / "link").symlink_to(home)
    _fake_proc(proc, 104, 1, node(f"{tmp_path}/link/local/node3", 99))
    found = running_processes(proc)
    assert [(p.pid, p.role, p.parent) for p in found] == [(100, "node", 99), (104, "node", 99)]
    assert found[1].state_dir == str(home.resolve() / "local" / "node3")  # links resolved
    assert [p.pid for p in orphans(found, home.resolve())] == [100, 104]
    assert running_processes(proc, uid=os.getuid() + 1) == []  # another user's: never
    assert running_processes(tmp_path / "no-proc") == []
