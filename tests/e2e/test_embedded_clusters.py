"""Nothing outlives its command: ``zctl run`` and ``zctl serve`` with an embedded cluster
(zctl.launcher.embedded), signalled mid-generation with SIGTERM, SIGHUP or SIGKILL, take
every process of their cluster with them within 5 s and free its ports; a run after a
killed one starts a cluster of its own, which a node of the earlier one cannot join; and
``zctl cluster down`` stops a cluster that no cluster.json holds any more, and nothing
else. Real processes on loopback, a tiny random-weight export."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from tests.e2e.test_serve_cluster import wait_health
from tests.helpers.repo import ROOT
from zctl.cli.app import app
from zctl.launcher.embedded import EMBEDDED
from zctl.launcher.local import _spawn, free_port, stop_processes
from zctl.launcher.orphans import LauncherProcess, running_processes, under
from zctl.launcher.processes import CoordinatorProcess, NodeProcess, parse_process
from zctl.launcher.record import alive

runner = CliRunner()
PROMPT = "what is the capital of france?"
GONE_WITHIN_S = 5.0  # the bound: no process of the cluster left, its ports free
# long enough to be mid-generation when signalled: 96 streams of 480 tokens (some 10 s)
LONG_RUN = ["--max-tokens", "480", "--ignore-eos", "--streams", "96"]


def _default_signals() -> None:
    """In the child: SIGINT, SIGTERM and SIGHUP as a terminal's command has them, even
    where the tests run with one ignored (nohup, a shell without job control)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@contextmanager
def zctl(args: list[str], home: Path, log: Path) -> Iterator[subprocess.Popen]:
    """``python -m zctl ARGS`` of this tree under ZCTL_HOME=``home``, its output in ``log``;
    killed (and its cluster stopped) if the test leaves it running."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "zctl", *args], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "ZCTL_HOME": str(home),
                                     "PYTHONUNBUFFERED": "1"},
                                preexec_fn=_default_signals)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_processes([p.pid for p in cluster_of(home)])


def cluster_of(home: Path) -> list[LauncherProcess]:
    """The coordinator and node processes of zctl home ``home``."""
    return under(running_processes(), home.resolve())


def coordinator_config(process: LauncherProcess) -> CoordinatorProcess:
    argv = Path(f"/proc/{process.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    config = parse_process("coordinator", argv[-1].decode())
    assert isinstance(config, CoordinatorProcess)
    return config


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """The TCP addresses the processes ``pids`` listen on."""
    found = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.add((conn.laddr.ip, conn.laddr.port))
    return found


def generating(home: Path, command: subprocess.Popen, log: Path, nodes: int = 2,
               timeout_s: float = 180.0) -> tuple[list[LauncherProcess], CoordinatorProcess]:
    """Wait until the embedded cluster of ``command`` generates; its processes (the
    coordinator first) and the coordinator's configuration."""
    from zctl.service.client import query_service_stats

    end = time.monotonic() + timeout_s
    while True:
        assert command.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < end, f"never generating: {log.read_text()[-3000:]}"
        processes = cluster_of(home)
        coordinator = [p for p in processes if p.role == "coordinator"]
        if coordinator and len(processes) == nodes:
            config = coordinator_config(coordinator[0])
            try:
                if config.serve and query_service_stats(config.serve, timeout=2).running:
                    return coordinator + [p for p in processes if p.role == "node"], config
            except RuntimeError:  # not serving yet
                pass
        time.sleep(0.2)


def assert_gone(processes: list[LauncherProcess], ports: set[tuple[str, int]],
                since: float) -> None:
    """Within GONE_WITHIN_S of ``since``, none of ``processes`` runs and every one of
    ``ports`` can be bound again."""
    while any(alive(p.pid) for p in processes):
        assert time.monotonic() - since < GONE_WITHIN_S, \
            f"still running: {[p.describe() for p in processes if alive(p.pid)]}"
        time.sleep(0.05)
    for host, port in sorted(ports):  # as the next cluster binds them (ZeroMQ reuses addresses)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    assert time.monotonic() - since < GONE_WITHIN_S


def expected_exit(signum: int) -> int:
    return -signal.SIGKILL if signum == signal.SIGKILL else 128 + signum


SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGHUP, id="SIGHUP"),
           pytest.param(signal.SIGKILL, id="SIGKILL")]


@pytest.mark.parametrize("signum", SIGNALS)
def test_zctl_run_takes_its_embedded_cluster_with_it(signum: int, tiny_exports,
                                                      tmp_path: Path) -> None:
    home, log = tmp_path / "home", tmp_path / "run.log"
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    with zctl(["run", PROMPT, "--model", str(export_dir), "--nodes", "2", *LONG_RUN, "--json"],
              home, log) as run:
        processes, _ = generating(home, run, log)
        ports = listening([p.pid for p in processes])
        assert len(ports) >= 4  # control, generation service, two data ports
        run.send_signal(signum)
        sent = time.monotonic()
        assert run.wait(30) == expected_exit(signum), log.read_text()[-3000:]
        assert_gone(processes, ports, sent)
    clusters = list((home / EMBEDDED).iterdir())
    if signum == signal.SIGKILL:  # left for the next embedded cluster (or cluster down) to sweep
        assert [owner.name.split("-")[0] for owner in clusters] == [str(run.pid)]
    else:
        assert clusters == []  # its directory removed with it
        assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("signum", SIGNALS)
def test_zctl_serve_takes_its_embedded_cluster_with_it(signum: int, tiny_exports,
                                                        tmp_path: Path) -> None:
    home, log = tmp_path / "home", tmp_path / "serve.log"
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    with zctl(["serve", "--model", str(export_dir), "--nodes", "2", "--port", str(port)],
              home, log) as serve:
        wait_health(url, 200, 180)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        chunks: list[str] = []

        def stream() -> None:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "n": 16, "stream": True,
                    "temperature": 0, "zctl": {"ignore_eos": True}}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body,
                                  timeout=60) as reply:
                    for line in reply.iter_lines():
                        chunks.append(line)
            except httpx.HTTPError:
                pass  # the server went away mid-stream

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        processes, _ = generating(home, serve, log)
        end = time.monotonic() + 60
        while not chunks:
            assert time.monotonic() < end, "no chunk arrived"
            time.sleep(0.05)
        ports = listening([serve.pid, *(p.pid for p in processes)])
        assert ("127.0.0.1", port) in ports
        serve.send_signal(signum)
        sent = time.monotonic()
        assert serve.wait(30) == expected_exit(signum), log.read_text()[-3000:]
        assert_gone(processes, ports, sent)
        client.join(30)
        assert not client.is_alive()
    if signum != signal.SIGKILL:
        assert list((home / EMBEDDED).iterdir()) == []
        assert "Traceback" not in log.read_text()


def test_a_run_after_a_killed_one_has_a_cluster_no_earlier_node_joins(tiny_exports,
                                                                      tmp_path: Path) -> None:
    """The first run is killed; the second starts a cluster of its own (its processes, its
    directory, its ports), sweeps the first one's directory, and refuses a node started
    for the first one's cluster that tries to enrol with it."""
    from controlplane.client import query_status

    home = tmp_path / "home"
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    args = ["run", PROMPT, "--model", str(export_dir), "--nodes", "2", *LONG_RUN, "--json"]
    with zctl(args, home, tmp_path / "first.log") as first:
        earlier, earlier_config = generating(home, first, tmp_path / "first.log")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        assert_gone(earlier, set(), time.monotonic())
    earlier_dir = home / EMBEDDED / Path(earlier[0].state_dir).parent.name
    assert earlier_dir.is_dir()
    with zctl(args, home, tmp_path / "second.log") as second:
        later, config = generating(home, second, tmp_path / "second.log")
        assert not {p.pid for p in later} & {p.pid for p in earlier}
        assert config.cluster_id and config.cluster_id != earlier_config.cluster_id
        assert config.control != earlier_config.control
        assert Path(later[0].state_dir).parent != Path(earlier[0].state_dir).parent
        assert not earlier_dir.exists()  # swept: its command and processes were gone
        # a node of the earlier cluster that had lived on would enrol with the later one
        stray = _spawn(NodeProcess(config.control, host="127.0.0.3",
                                   state_dir=str(tmp_path / "stray"), reconnect_min=0.2,
                                   cluster_id=earlier_config.cluster_id), tmp_path / "stray.log")
        code = exit_code(stray, 60)
        stray_log = (tmp_path / "stray.log").read_text()
        assert code == 2, stray_log[-3000:]  # refused: it exits
        assert f"started for local cluster {earlier_config.cluster_id}" in stray_log
        nodes = query_status(config.control, timeout=5).nodes
        assert sorted(n.host for n in nodes) == ["127.0.0.1", "127.0.0.2"]
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 143


def exit_code(child: int, timeout_s: float) -> int | None:
    """The exit code of this process's child ``child`` once it ends (None: still running
    after ``timeout_s``, then killed)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    stop_processes([child])
    return None


def _orphaned_node(state_dir: Path, log: Path) -> int:
    """A node process (of the zctl home above ``state_dir``) whose command is gone: started
    by a Python process that exits at once, as ``zctl cluster up`` does."""
    code = ("import sys; from pathlib import Path; from zctl.launcher.local import _spawn; "
            "from zctl.launcher.processes import NodeProcess; "
            f"print(_spawn(NodeProcess('tcp://127.0.0.1:{free_port('127.0.0.1')}', "
            f"state_dir={str(state_dir)!r}), Path({str(log)!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=True, timeout=60)
    return int(done.stdout.strip())


def test_cluster_down_stops_a_cluster_no_cluster_json_holds_and_nothing_else(
        tiny_exports, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, other_home = tmp_path / "home", tmp_path / "other-home"
    monkeypatch.setenv("ZCTL_HOME", str(home))
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    up = subprocess.run([sys.executable, "-m", "zctl", "cluster", "up", "--local", "2", "--model",
                         str(export_dir)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env={**os.environ, "ZCTL_HOME": str(home)})
    assert up.returncode == 0, up.stdout + up.stderr
    recorded = json.loads((home / "cluster.json").read_text())["pids"]
    keep = []
    try:
        # what cluster down must leave: another home's orphan, and a node of this home whose
        # command (this test) still runs
        keep = [_orphaned_node(other_home / "local" / "node1", tmp_path / "other.log"),
                _spawn(NodeProcess(f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                                   state_dir=str(home / "bench" / "node1")), tmp_path / "live.log")]
        (home / "cluster.json").write_text('{"control": "tcp://127.0.0.1:1", "pids": [')
        down = runner.invoke(app, ["cluster", "down"])
        assert down.exit_code == 0, down.output
        text = " ".join(down.output.split())
        assert "is damaged" in text
        assert "stopped 2 process(es) of this zctl home whose command is gone" in text
        assert f"coordinator {recorded[0]} ({home.resolve() / 'local' / 'coordinator'})" in text
        assert f"node {recorded[1]}" in text
        assert not any(alive(pid) for pid in recorded)
        assert all(alive(pid) for pid in keep)
        assert not (home / "cluster.json").exists()
        again = runner.invoke(app, ["cluster", "down"])
        assert again.exit_code == 0 and "no cluster is up" in again.output
    finally:
        stop_processes([*recorded, *keep])
