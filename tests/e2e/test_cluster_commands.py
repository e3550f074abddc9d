"""zctl cluster up/status/down and zctl run --json, end to end with node processes on loopback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tests.helpers.repo import ROOT
from zctl.cli.app import app
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer

runner = CliRunner()
PROMPT = "what is the capital of france?"


def _expected_tokens(export_dir: Path, n: int, exact: bool = False) -> list[int]:
    tokenizer = ChatTokenizer(export_dir)
    # the runtime a local cluster's stages get: paged KV, the plugin's u8 cache (or --exact)
    numerics = dict(kv_cache_precision="f32", dynamic_quantization=False) if exact else {}
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32", paged_attention=True,
                                                            **numerics))
    return list(generate_greedy(chain, tokenizer.encode(PROMPT), n))


def test_run_json_with_embedded_cluster(tiny_exports, zctl_home: Path) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    result = runner.invoke(app, ["run", PROMPT, "--model", str(export_dir), "--nodes", "2",
                                 "--max-tokens", "12", "--ignore-eos", "--temperature", "0",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 12
    assert report["ttft_ms"] > 0 and report["tok_s"] > 0 and report["notes"] == []
    assert [s["layers"] for s in report["stages"]] == ["0-1", "2-3"]
    assert all(s["compute_ms"]["p50"] > 0 for s in report["stages"])
    assert report["suggested_layers"] in (None, "0-0,1-3", "0-2,3-3")  # a re-export hint
    assert "127.0.0.2" in report["stages"][1]["node"]
    tokenizer = ChatTokenizer(export_dir)
    assert report["text"] == tokenizer.decode(_expected_tokens(export_dir, 12))
    assert not (zctl_home / "cluster.json").exists()  # the embedded cluster was torn down
    # a speculative run's embedded cluster keeps the default numerics (paged stages: its
    # greedy output equals the plain run's, so there is nothing to warn about)
    spec = runner.invoke(app, ["run", PROMPT, "--model", str(export_dir), "--nodes", "2",
                               "--max-tokens", "12", "--ignore-eos", "--temperature", "0",
                               "--speculative", "lookup", "--json"])
    assert spec.exit_code == 0, spec.output
    assert "fast numerics" not in spec.output
    assert json.loads(spec.stdout.strip().splitlines()[-1])["text"] == report["text"]


def test_cluster_up_status_run_down(tiny_exports, zctl_home: Path) -> None:
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    up = runner.invoke(app, ["cluster", "up", "--local", "3", "--model", str(export_dir),
                              "--exact"])  # speculative runs below must equal greedy
    try:
        assert up.exit_code == 0, up.output
        again = runner.invoke(app, ["cluster", "up", "--local", "3", "--model", str(export_dir)])
        assert again.exit_code == 1 and "already up" in again.output
        status = runner.invoke(app, ["cluster", "status", "--json"])
        assert status.exit_code == 0, status.output
        info = json.loads(status.stdout)
        assert info["pipeline"] == "serving" and len(info["nodes"]) == 3
        hosts = sorted(n["host"] for n in info["nodes"])
        assert hosts == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        assert {n["openvino"] for n in info["nodes"]} == {info["openvino"]}
        assert info["runtime"]["kv_cache_precision"] == "f32"  # --exact
        assert info["runtime"]["dynamic_quantization"] is False
        assert "exact numerics, paged KV" in " ".join(
            runner.invoke(app, ["cluster", "status"]).output.split())
        run = runner.invoke(app, ["run", PROMPT, "--max-tokens", "8", "--ignore-eos", "--json"])
        assert run.exit_code == 0, run.output
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert len(report["stages"]) == 3 and report["tokens"] == 8
        # several concurrent streams, speculative: each equals greedy, figures per stream
        multi = runner.invoke(app, ["run", PROMPT, "--streams", "3", "--max-tokens", "8",
                                    "--ignore-eos", "--speculative", "lookup", "--k", "3",
                                    "--temperature", "0", "--json"])
        assert multi.exit_code == 0, multi.output
        report = json.loads(multi.stdout.strip().splitlines()[-1])
        tokenizer = ChatTokenizer(export_dir)
        want = tokenizer.decode(_expected_tokens(export_dir, 8, exact=True))
        assert [s["text"] for s in report["streams"]] == [want] * 3
        assert report["tokens"] == 24 and report["aggregate_tok_s"] > 0
        assert all(s["spec"]["steps"] >= 1 for s in report["streams"])
        # the output held to a grammar (the coordinator compiles it: zctl.engine.constraints)
        held = runner.invoke(app, ["run", PROMPT, "--regex", "[0-9]{4}-ok", "--json"])
        assert held.exit_code == 0, held.output
        report = json.loads(held.stdout.strip().splitlines()[-1])
        assert re.fullmatch("[0-9]{4}-ok", report["text"]) and report["grammar"] == "regex"
        obj = runner.invoke(app, ["run", PROMPT, "--json-schema", "object", "--max-tokens",
                                  "400", "--json"])
        assert obj.exit_code == 0, obj.output
        assert json.loads(obj.stdout.strip().splitlines()[-1])["text"].startswith("{")
        (zctl_home / "bad.json").write_text("{nope")
        for bad, why in ((["--k", "many"], "--k must be"), (["--speculative", "guess"], "lookup"),
                         (["--regex", "a", "--json-schema", "object"],
                          "give one of --json-schema, --regex"),
                         (["--json-schema", str(zctl_home / "bad.json")], "is not JSON"),
                         (["--grammar", str(zctl_home / "missing.lark")], "missing.lark"),
                         (["--regex", "[a-z+"], "unclosed character class"),
                         (["--speculative", "draft:/nonexistent"], "not a directory"),
                         (["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p"),
                         (["--frequency-penalty", "2.5"], "frequency_penalty must be in -2..2")):
            refused = runner.invoke(app, ["run", PROMPT, "--json", *bad])
            assert refused.exit_code == 1 and why in refused.output, refused.output
    finally:
        down = runner.invoke(app, ["cluster", "down"])
    assert down.exit_code == 0 and "stopped 3" in down.output
    assert runner.invoke(app, ["cluster", "status"]).exit_code == 1


def test_curve_cluster_up_admits_its_own_nodes_and_refuses_strangers(tiny_exports,
                                                                     zctl_home: Path) -> None:
    import subprocess
    import sys
    import time

    from zctl.launcher.record import read_record

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    assert "no --curve cluster" in runner.invoke(app, ["cluster", "authorize", "x.key"]).output
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                             "--curve"])
    stranger = None
    try:
        assert up.exit_code == 0, up.output
        status = json.loads(runner.invoke(app, ["cluster", "status", "--json"]).stdout)
        assert status["curve"] is True and status["pipeline"] == "serving"
        assert "CURVE" in runner.invoke(app, ["cluster", "status"]).output
        run = runner.invoke(app, ["run", PROMPT, "--max-tokens", "6", "--ignore-eos",
                                  "--temperature", "0", "--json"])
        assert run.exit_code == 0, run.output
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["text"] == ChatTokenizer(export_dir).decode(_expected_tokens(export_dir, 6))
        # a node with the coordinator's key but not admitted stays out until authorized
        record = read_record()
        server_key = Path(record.curve_dir) / "curve" / "coordinator.key"
        state = zctl_home / "stranger"
        log = zctl_home / "stranger.log"
        with open(log, "w") as stderr:
            stranger = subprocess.Popen(
                [sys.executable, "-m", "zctl", "node", "join", record.control,
                 "--host", "127.0.0.4", "--state-dir", str(state), "--curve-server-key",
                 str(server_key)],
                stdout=subprocess.DEVNULL, stderr=stderr)
        node_key = state / "curve" / "node.key"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not node_key.is_file():
            time.sleep(0.1)
        # it tried: a whole liveness period went by without an answer and it reconnects
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "silent; reconnecting" not in log.read_text():
            time.sleep(0.1)
        assert "silent; reconnecting" in log.read_text(), log.read_text()[-2000:]
        hosts = lambda: {n["host"] for n in json.loads(  # noqa: E731
            runner.invoke(app, ["cluster", "status", "--json"]).stdout)["nodes"]}
        assert "127.0.0.4" not in hosts()
        admitted = runner.invoke(app, ["cluster", "authorize", str(node_key), "--name", "n4"])
        assert admitted.exit_code == 0 and "admitted" in admitted.output
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "127.0.0.4" not in hosts():
            time.sleep(0.3)
        assert "127.0.0.4" in hosts()
        # a client outside the record: by the coordinator's key and an admitted key pair
        keys = ["--endpoint", record.control, "--curve-server-key", str(server_key)]
        status = runner.invoke(app, ["cluster", "status", *keys, "--curve-keys",
                                     str(server_key.with_suffix(".key_secret")), "--json"])
        assert status.exit_code == 0, status.output
        assert "127.0.0.4" in {n["host"] for n in json.loads(status.stdout)["nodes"]}
        half = runner.invoke(app, ["cluster", "status", *keys])
        assert half.exit_code == 1 and "go together" in half.output
        public_only = runner.invoke(app, ["cluster", "status", *keys, "--curve-keys",
                                          str(server_key)])
        assert public_only.exit_code == 1 and "no secret key" in public_only.output
    finally:
        if stranger is not None:
            stranger.terminate()
            stranger.wait(10)
        runner.invoke(app, ["cluster", "down"])


def _run_on_a_terminal(args: list[str], env: dict[str, str], timeout_s: float = 300.0
                       ) -> tuple[int, bytes]:
    """Run ``python -m zctl ARGS`` (the zctl command line of this tree) with a pseudo-
    terminal of 150 x 50 as stdin, stdout and stderr; its exit code and all it wrote."""
    import fcntl
    import os
    import pty
    import select
    import signal
    import struct
    import subprocess
    import sys
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 150, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "zctl", *args], stdin=slave, stdout=slave,
                            stderr=slave, cwd=ROOT, env=env,
                            close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.send_signal(signal.SIGINT)  # zctl run stops its embedded cluster on ^C
            raise AssertionError(f"zctl {args[0]} did not finish: {b''.join(chunks)[-3000:]!r}")
        return proc.wait(60), b"".join(chunks)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def _screen_lines(raw: bytes) -> list[str]:
    """What a terminal shows, line by line: escape sequences removed, and a line that a
    carriage return started again (a live display's next frame) shown from there."""
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07", "",
                  raw.decode("utf-8", errors="replace"))
    lines = text.replace("\r\n", "\n").split("\n")
    return [next((part for part in reversed(line.split("\r")) if part), "").rstrip()
            for line in lines]


def test_run_on_a_terminal_shows_the_live_dashboard(tiny_exports, zctl_home: Path) -> None:
    """``zctl run`` on a terminal, with its embedded local cluster: Rich's live display runs,
    and its last frame holds the generated text, a row per stage with every column, and the
    summary line."""
    import os

    from zctl.cli.dashboard import terminal_text

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM_PROGRAM")}
    env["TERM"] = "xterm-256color"
    # --exact: the text is compared token for token with a reference run, and the plugin's
    # u8 KV cache can flip a near-tied token of the random model between kernel paths (it did
    # on one CI machine); test_run_json_with_embedded_cluster covers the default numerics
    code, raw = _run_on_a_terminal(["run", PROMPT, "--model", str(export_dir), "--nodes", "2",
                                    "--max-tokens", "12", "--ignore-eos", "--exact",
                                    "--temperature", "0"], env)
    lines = _screen_lines(raw)
    screen = "\n".join(lines[-60:])  # shown with any failure below
    assert code == 0, screen
    assert b"\x1b[?25l" in raw and b"\x1b[?25h" in raw, screen  # the live display hid the
    # cursor, and gave it back when it stopped: a terminal's dashboard, not the fallback
    assert ("no cluster is up: starting an embedded local cluster of 2 processes (it stops "
            "with this command)") in lines, screen
    # the last frame: the text panel (top ╭, bottom ╰), then the stage table
    top = max(i for i, line in enumerate(lines) if line.startswith("╭"))
    bottom = next(i for i in range(top, len(lines)) if lines[i].startswith("╰"))
    assert PROMPT in lines[top], screen
    shown = "".join(line.strip().removeprefix("│").removesuffix("│") for line in
                    lines[top + 1:bottom])
    want = ChatTokenizer(export_dir).decode(_expected_tokens(export_dir, 12, exact=True))
    assert "".join(shown.split()) == "".join(terminal_text(want).split()), (shown, want, screen)
    cells = [[c.strip() for c in line.strip("┃│").split(line[0])] for line in lines[bottom:]
             if line[:1] in ("┃", "│")]
    assert ["#", "node", "layers", "dev", "p50", "p95", "queue", "ser", "net"] in cells, screen
    stages = [row for row in cells if row[:1] in (["0"], ["1"])]
    assert [row[:4] for row in stages] == [["0", "127.0.0.1", "0-1", "CPU"],
                                           ["1", "127.0.0.2", "2-3", "CPU"]], screen
    for row in stages:  # compute p50/p95 and the hop's queue, serialise and network time
        assert len(row) == 9 and all(float(v) >= 0 for v in row[4:]), screen
        assert float(row[4]) > 0, screen  # the stage computed
    summary = [line for line in lines[bottom:] if line.startswith("tokens ")]
    assert len(summary) == 1 and summary[0].startswith("tokens 12  ·  TTFT "), screen
    assert summary[0].endswith("done (max_tokens)"), screen
    assert not (zctl_home / "cluster.json").exists()  # the embedded cluster was torn down


@pytest.mark.parametrize("alone", [["--local", "1"], ["--bind"]], ids=["local-1", "bind"])
def test_a_cluster_of_one_serves_then_a_node_joins_and_leaves(tiny_exports, zctl_home: Path,
                                                              alone: list[str]) -> None:
    """``zctl cluster up --local 1`` (or a coordinator for other machines, none joined
    yet) serves at once, this machine running both stages; ``zctl node join`` in its own
    process on 127.0.0.2 then takes stage 1 over without a restart, a generation runs
    through it, and when the node process is stopped it leaves the cluster cleanly (and the
    coordinator takes its stage back)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from zctl.launcher.local import free_port

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    if alone == ["--bind"]:
        alone = ["--bind", f"127.0.0.1:{free_port('127.0.0.1')}"]
    up = runner.invoke(app, ["cluster", "up", "--model", str(export_dir), *alone, "--exact"])
    node = None
    log = zctl_home / "node.log"
    want = ChatTokenizer(export_dir).decode(_expected_tokens(export_dir, 8, exact=True))

    def status() -> dict:
        result = runner.invoke(app, ["cluster", "status", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def run_nodes() -> list[str]:
        run = runner.invoke(app, ["run", PROMPT, "--max-tokens", "8", "--ignore-eos",
                                  "--temperature", "0", "--json"])
        assert run.exit_code == 0, run.output
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["text"] == want  # (cluster up --exact: one process's tokens)
        return [s["node"] for s in report["stages"]]

    try:
        assert up.exit_code == 0, up.output
        control = json.loads((zctl_home / "cluster.json").read_text())["control"]
        if alone[0] == "--bind":
            assert f"zctl node join {control}" in " ".join(up.output.split())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and status()["pipeline"] != "serving":
            time.sleep(0.2)
        info = status()
        assert info["pipeline"] == "serving", info  # no node needed
        assert {s["node_id"] for s in info["stages"]} == {info["coordinator_id"]}
        assert run_nodes() == ["127.0.0.1", "127.0.0.1"]
        with open(log, "w") as stderr:
            node = subprocess.Popen(
                [sys.executable, "-m", "zctl", "node", "join", control,
                 "--host", "127.0.0.2", "--state-dir", str(zctl_home / "node")],
                stdout=stderr, stderr=stderr, cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        node_id = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert node.poll() is None, log.read_text()[-3000:]
            info = status()
            node_id = next((n["node_id"] for n in info["nodes"] if n["host"] == "127.0.0.2"), "")
            if info["pipeline"] == "serving" and info["stages"][1]["node_id"] == node_id:
                break
            time.sleep(0.2)
        assert info["stages"][1]["node_id"] == node_id != "", (info, log.read_text()[-3000:])
        assert info["pipeline"] == "serving" and info["stages"][0]["node_id"] == \
            info["coordinator_id"]
        assert node_id == (zctl_home / "node" / "node_id").read_text().strip()
        assert "joining tcp://127.0.0.1:" in log.read_text()
        assert run_nodes() == ["127.0.0.1", "127.0.0.2"]
        node.send_signal(signal.SIGTERM)  # as a service manager stops it
        assert node.wait(30) == 0, log.read_text()[-3000:]
        info = status()
        gone = next(n for n in info["nodes"] if n["node_id"] == node_id)
        assert gone["state"] == "left", info
        # no spare: the coordinator heals the pipeline by running stage 1 itself
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and status()["pipeline"] != "serving":
            time.sleep(0.2)
        info = status()
        assert info["pipeline"] == "serving", info
        assert {s["node_id"] for s in info["stages"]} == {info["coordinator_id"]}
    finally:
        if node is not None and node.poll() is None:
            node.kill()
        down = runner.invoke(app, ["cluster", "down"])
    assert down.exit_code == 0 and "stopped 1" in down.output


def test_run_on_a_one_stage_export_streams_with_no_cluster_up(tiny_exports,
                                                              zctl_home: Path) -> None:
    export_dir = tiny_exports.get([(0, 4)])
    run = runner.invoke(app, ["run", PROMPT, "--model", str(export_dir), "--max-tokens", "8",
                              "--ignore-eos", "--temperature", "0", "--exact"])
    assert run.exit_code == 0, run.output
    want = ChatTokenizer(export_dir).decode(_expected_tokens(export_dir, 8, exact=True))
    assert want.strip() and want.strip() in run.stdout
    assert not (zctl_home / "cluster.json").exists()


def test_stages_that_fit_no_machine_fail_cluster_up_at_once(tiny_exports, zctl_home: Path
                                                           ) -> None:
    """A one-process cluster lent 1 MB cannot hold the stages: ``cluster up`` says so on
    stderr within seconds (not after its timeout), exits non-zero and leaves nothing."""
    import os
    import subprocess
    import sys
    import time

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    started = time.monotonic()
    up = subprocess.run([sys.executable, "-m", "zctl", "cluster", "up", "--local", "1",
                         "--memory-mb", "1", "--model", str(export_dir)],
                        capture_output=True, text=True, cwd=ROOT, timeout=120,
                        env={**os.environ, "ZCTL_HOME": str(zctl_home)})
    took = time.monotonic() - started
    assert up.returncode == 1, up
    assert "the stages cannot be placed" in up.stderr and "needs about" in up.stderr, up.stderr
    assert took < 10, f"{took:.1f} s"
    assert not (zctl_home / "cluster.json").exists()


def test_run_samples_as_the_model_says_and_reports_it(tiny_exports, zctl_home: Path) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir)])
    try:
        assert up.exit_code == 0, up.output

        def report(*options: str) -> dict:
            run = runner.invoke(app, ["run", PROMPT, "--max-tokens", "12", "--ignore-eos",
                                      "--json", *options])
            assert run.exit_code == 0, run.output
            return json.loads(run.stdout.strip().splitlines()[-1])

        # the random model's generation config names no sampling: llama-server's defaults
        seeded = [report("--seed", "11") for _ in range(2)]
        assert seeded[0]["sampling"] == {
            "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 11,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "defaults": "llama-server", "given": []}
        assert seeded[0]["text"] == seeded[1]["text"]  # repeatable with a seed
        one = report("--top-k", "0")["sampling"]  # one option: the defaults for the rest
        assert (one["top_k"], one["temperature"], one["given"]) == (0, 0.8, ["top_k"])
        greedy = report("--temperature", "0")["sampling"]
        assert greedy["temperature"] == 0.0 and "top_k" not in greedy
    finally:
        assert runner.invoke(app, ["cluster", "down"]).exit_code == 0
