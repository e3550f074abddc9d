"""``zctl cluster up --local 2`` and ``zctl serve`` as subprocesses for tools.serving.serve,
under a ZCTL_HOME of their own, and torn down on every exit (an exception, Ctrl-C, SIGTERM).

The commands run as ``python -m zctl ...`` from the checkout ``repo``, so the processes
run this checkout's code. One run at a time holds the home (a lock file); a cluster an
interrupted run left behind is stopped before a new one starts.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tools.harness.report import err
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.local import free_port


@dataclass(frozen=True)
class Served:
    """A running cluster and its HTTP server: where each listens."""

    base_url: str  # the HTTP API
    serve: str  # the coordinator's ZeroMQ generation service
    home: Path


def zctl(repo: Path, env: dict[str, str], *args: str, timeout: float = 600.0,
         check: bool = True) -> str:
    """Run ``zctl ARGS`` (this checkout's) to completion; its stdout. RuntimeError with its
    output's tail when it fails and ``check``."""
    proc = subprocess.run([sys.executable, "-m", "console", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"zctl {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def wait_health(proc: subprocess.Popen, base_url: str, timeout: float, log: Path) -> None:
    """Poll GET /health until it answers 200; RuntimeError (with the log's tail) if the
    server exits first or ``timeout`` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"zctl serve exited ({proc.returncode}) before serving:\n"
                               f"{_tail(log)}")
        try:
            answer = httpx.get(f"{base_url}/health", timeout=2.0)
            if answer.status_code == 200:
                return
            last = f"HTTP {answer.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    raise RuntimeError(f"zctl serve not healthy after {timeout:.0f}s ({last}):\n{_tail(log)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def stop_server(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the server we started, SIGKILL it after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def exit_on_failure() -> Iterator[None]:
    """Around a benchmark's served run: a RuntimeError is printed and exits 1, an interrupt
    (after served_cluster's teardown) exits 130."""
    import typer

    try:
        yield
    except RuntimeError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted: the cluster and the server are stopped")
        raise typer.Exit(130) from None


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, so the teardown runs for it too."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def served_cluster(export_dir: Path, home: Path, cpu_sets: str, port: int, max_queue: int,
                   api_key: str | None, timeout: float, repo: Path,
                   server: Sequence[str] = ("-m", "console", "serve"),
                   max_streams: int = DEFAULT_MAX_STREAMS) -> Iterator[Served]:
    """A 2-node local cluster of ``export_dir`` and ``zctl serve`` on 127.0.0.1:``port``
    (0: a free port), both under ZCTL_HOME=``home``; everything stopped on exit.
    ``max_queue`` 0 keeps the server's default. ``server``: the Python arguments that
    start the HTTP server (its --host, --port, --max-queue and --api-key options follow).
    ``max_streams``: the cluster's generations at once (cluster up --max-streams)."""
    home.mkdir(parents=True, exist_ok=True)
    # the key is the one given here or none (not a ZCTL_API_KEY this shell happens to set)
    env = {**{k: v for k, v in os.environ.items() if k != "ZCTL_API_KEY"},
           "ZCTL_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    port = port or free_port("127.0.0.1")
    base_url = f"http://127.0.0.1:{port}"
    log = home / "logs" / "serve.log"
    with open(home / "bench-serve.lock", "w") as lock, _sigterm_as_interrupt():
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another bench_serve run holds {home}") from None
        zctl(repo, env, "cluster", "down", check=False)  # one an interrupted run left
        proc = None
        try:
            err.print(f"starting a 2-node local cluster (--cpu-sets {cpu_sets}) ...")
            zctl(repo, env, "cluster", "up", "--local", "2", "--cpu-sets", cpu_sets,
                 "--max-streams", str(max_streams),
                 "--model", str(export_dir), "--timeout", str(timeout), timeout=timeout + 60)
            record = json.loads((home / "cluster.json").read_text())
            command = [sys.executable, *server, "--host", "127.0.0.1", "--port", str(port)]
            if max_queue:
                command += ["--max-queue", str(max_queue)]
            if api_key:
                command += ["--api-key", api_key]
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as out:
                proc = subprocess.Popen(command, cwd=repo, env=env, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            wait_health(proc, base_url, timeout, log)
            err.print(f"zctl serve is up at {base_url}")
            yield Served(base_url, str(record["serve"]), home)
        finally:
            if proc is not None:
                stop_server(proc)
            zctl(repo, env, "cluster", "down", check=False)
