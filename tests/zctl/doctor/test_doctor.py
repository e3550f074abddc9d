"""zctl doctor: the verdicts on gathered facts (pure), the probes on real files and sockets,
the command without a cluster and against a live in-process coordinator and node."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.client import ClusterUnreachable, query_status, query_status_timed
from controlplane.records import ClusterStatus, NodeStatus, RefusalInfo, StageStatus
from zctl.cli.app import app
from zctl.doctor import checks as doctor
from zctl.doctor import probes
from zctl.doctor import verdicts as dx
from zctl.doctor.verdicts import FAIL, PASS, WARN, Check, MemoryNeed, TcpFacts
from zctl.manifest import ExportManifest, ModelSpec, StageSpec, sha256_file, write_manifest

OV = "2026.4.1-22982-e213a147257-releases/2026/4"
GiB = 1 << 30
runner = CliRunner()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# -- facts to verdicts -------------------------------------------------------------------------
def node(node_id: str, stage: int | None, **kw: object) -> NodeStatus:
    fields: dict = dict(node_id=node_id, host="10.0.0.2", state="serving", stage=stage,
                        data_addr=f"tcp://10.0.0.2:{5000 + (stage or 0)}", last_seen_s=0.3,
                        devices=[], ram_free=4 * GiB, ram_total=8 * GiB, openvino=OV,
                        zctl="0.1.0", cached_shards=1, local=node_id == "coord",
                        last_sent_s=0.2)
    fields.update(kw)
    return NodeStatus(**fields)


def cluster(nodes: list[NodeStatus], pipeline: str = "serving", **kw: object) -> ClusterStatus:
    stages = [StageStatus(0, 0, 17, "a" * 64, 100 << 20, "coord", "serving"),
              StageStatus(1, 17, 30, "b" * 64, 80 << 20, "n1", nodes[-1].state)]
    fields: dict = dict(coordinator_id="coord", session="s", endpoint="tcp://10.0.0.1:5550",
                        protocol=1, openvino=OV, zctl="0.1.0", export_dir="/x", model="m",
                        pipeline=pipeline, epoch=1, uptime_s=1.0, plan_error="", nodes=nodes,
                        stages=stages, refused=[], counters={}, time_s=1000.0,
                        heartbeat_interval=1.0, liveness=3)
    fields.update(kw)
    return ClusterStatus(**fields)


def test_clock_offset_thresholds_and_the_estimate() -> None:
    ok = dx.clock_check(100.0, 100.101, 100.2)  # midpoint 100.1: coordinator 1 ms ahead
    assert ok.status == PASS and "ahead by 1.0 ms +- 100.0 ms (round trip 200.0 ms)" in ok.detail
    assert dx.clock_check(100.0, 99.0, 100.0).status == WARN  # 1 s behind
    assert "behind by 1000.0 ms" in dx.clock_check(100.0, 99.0, 100.0).detail
    assert dx.clock_check(100.0, 100.4, 100.0).status == PASS
    assert dx.clock_check(100.0, 140.0, 100.0).status == FAIL
    assert dx.clock_check(100.0, 60.0, 100.0).status == FAIL
    assert dx.clock_check(100.0, 101.0, 100.0, warn_s=2.0).status == PASS
    assert dx.clock_check(100.0, 0.0, 100.0).status == WARN  # an older coordinator: no clock


def test_a_node_with_other_versions_fails_and_this_machine_differing_warns() -> None:
    status = cluster([node("coord", 0), node("n1", 1, zctl="0.2.0"), node("n2", None)])
    checks = {c.name: c for c in dx.version_checks(status, OV, "0.1.0", 1)}
    assert checks["versions coordinator"].status == PASS
    assert checks["versions n1"].status == FAIL
    assert "zctl 0.2.0" in checks["versions n1"].detail
    assert "coordinator OpenVINO" in checks["versions n1"].detail
    assert checks["versions nodes"].status == PASS and "1 of 2" in checks["versions nodes"].detail
    here = {c.name: c for c in dx.version_checks(status, "2025.0.0", "0.1.0", 1)}
    assert here["versions coordinator"].status == WARN
    assert "could not join" in here["versions coordinator"].detail


def test_refusals_fail_for_versions_warn_otherwise_and_drop_once_enrolled() -> None:
    refused = [RefusalInfo("old", "10.0.0.9", "runs OpenVINO 2025.0", 4.0, "openvino-version"),
               RefusalInfo("dup", "10.0.0.8", "duplicate id", 3.0, "duplicate-id"),
               RefusalInfo("n1", "10.0.0.2", "runs OpenVINO 2025.0", 9.0, "openvino-version")]
    status = cluster([node("coord", 0), node("n1", 1)], refused=refused)
    checks = {c.name: c for c in dx.refusal_checks(status)}
    assert set(checks) == {"refused old", "refused dup"}  # n1 enrolled since
    assert checks["refused old"].status == FAIL and "openvino-version" in checks["refused old"].detail
    assert checks["refused dup"].status == WARN


def test_memory_fits_is_tight_or_does_not_fit() -> None:
    need = [MemoryNeed("stage 1", 2 * GiB)]
    assert dx.memory_check(8 * GiB, 16 * GiB, need).status == PASS
    assert dx.memory_check(int(2.2 * GiB), 16 * GiB, need).status == WARN
    failed = dx.memory_check(1 * GiB, 16 * GiB, need)
    assert failed.status == FAIL and "does not fit" in failed.detail
    # a stage served here already holds its weights: only the rest must still fit
    held = dx.memory_check(1 * GiB, 16 * GiB, [MemoryNeed("stage 1", 2 * GiB, int(1.8 * GiB))])
    assert held.status == PASS and "still to load" in held.detail
    assert dx.memory_check(1 * GiB, 2 * GiB, []).status == PASS


def test_cpu_features_name_the_int8_kernels() -> None:
    amx = dx.cpu_features_check({"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert amx.status == PASS and "AMX kernels" in amx.detail and "not guaranteed" in amx.detail
    assert "AVX-512-VNNI" in dx.cpu_features_check({"avx2", "avx512f", "avx512_vnni"}).detail
    plain = dx.cpu_features_check({"avx2", "fma"})
    assert plain.status == PASS and "no VNNI" in plain.detail
    assert dx.cpu_features_check({"sse4_2"}).status == WARN
    assert dx.cpu_features_check(None).status == WARN
    assert "bf16" in dx.cpu_features_check({"avx2"}, ("FP32", "BF16")).detail


def test_api_verdicts() -> None:
    url = "http://127.0.0.1:8000"
    assert dx.api_check(url, dx.HttpFacts(200, '{"ok": true}'), False).status == PASS
    assert dx.api_check(url, dx.HttpFacts(503, "stage 1 down"), False).status == WARN
    assert dx.api_check(url, dx.HttpFacts(500, "boom"), False).status == FAIL
    nothing = dx.HttpFacts(error="Connection refused", refused=True)
    assert dx.api_check(url, nothing, False) == Check(
        "api", WARN, "no API server at http://127.0.0.1:8000 (zctl serve starts one)")
    assert dx.api_check(url, nothing, True).status == FAIL


def test_pipeline_heartbeats_and_data_pipes_from_the_coordinators_record() -> None:
    status = cluster([node("coord", 0, host="10.0.0.1", data_addr="tcp://10.0.0.1:5000"),
                      node("n1", 1, state="dead", last_seen_s=4.0)], pipeline="degraded")
    assert dx.pipeline_check(status).status == FAIL
    assert "stage 1 (layers 17-29) on n1 is dead" in dx.pipeline_check(status).detail
    (beat,) = dx.heartbeat_checks(status)
    assert beat.status == FAIL and "last heard 4.0 s ago" in beat.detail
    assert "last sent 0.2 s ago" in beat.detail
    connects = {"tcp://10.0.0.1:5000": TcpFacts(True, 0.3),
                "tcp://10.0.0.2:5001": TcpFacts(False, error="Connection refused")}
    pipes = dx.data_pipe_checks(status, connects, on_coordinator=True)
    assert [c.status for c in pipes] == [PASS, FAIL]
    assert "stage 1 -> 0 at tcp://10.0.0.1:5000" in pipes[0].detail
    alive = cluster([node("coord", 0, data_addr="tcp://10.0.0.1:5000"), node("n1", 1)])
    assert dx.pipeline_check(alive).status == PASS
    assert [c.status for c in dx.heartbeat_checks(alive)] == [PASS]
    late = cluster([node("coord", 0), node("n1", 1, last_seen_s=2.5)])
    assert [c.status for c in dx.heartbeat_checks(late)] == [WARN]
    # serving, but nothing accepts a connection: fails on the coordinator, warns elsewhere
    assert [c.status for c in dx.data_pipe_checks(alive, connects, True)] == [PASS, FAIL]
    assert [c.status for c in dx.data_pipe_checks(alive, connects, False)] == [PASS, WARN]
    waiting = cluster([node("coord", 0), node("n1", 1, state="transferring")], "transferring")
    assert dx.pipeline_check(waiting).status == WARN
    assert dx.pipeline_check(cluster([node("coord", 0), node("n1", None, state="idle")], "waiting",
                                     plan_error="stage 1 needs 9 GiB")).status == FAIL


# -- probes on real files and sockets ---------------------------------------------------------
def fake_export(root: Path, stages: int = 2, size: int = 4096) -> ExportManifest:
    """An export directory with the files a manifest lists (no real model in them)."""
    root.mkdir(parents=True)
    files, specs = {}, []
    for i in range(stages):
        for ext in ("xml", "bin"):
            (root / f"stage{i}.{ext}").write_bytes(bytes([i]) * size)
            files[f"stage{i}.{ext}"] = sha256_file(root / f"stage{i}.{ext}")
        specs.append(StageSpec(i, 2 * i, 2 * i + 2, f"stage{i}.xml", f"stage{i}.bin", ("x",),
                               ("y",), (), i == 0, i == stages - 1))
    model = ModelSpec("tiny", "llama", 2 * stages, 64, 4, 2, 16, 100, (1.0,), 1.0, 128, 1, (2,))
    manifest = ExportManifest(model, tuple(specs), "fp32", None, "f32", True, {}, files)
    write_manifest(root, manifest)
    return manifest


def cache_shard(state: Path, export: Path, manifest: ExportManifest, index: int) -> Path:
    """The shard of stage ``index`` as a node caches it (<state>/shards/<hash>/)."""
    target = state / "shards" / manifest.stage_hash(index)
    target.mkdir(parents=True)
    spec = manifest.stages[index]
    for name in ("manifest.json", spec.xml, spec.bin):
        shutil.copyfile(export / name, target / name)
    return target


def test_a_corrupted_cached_shard_fails_naming_the_file(tmp_path: Path) -> None:
    manifest = fake_export(tmp_path / "export")
    shard = cache_shard(tmp_path / "node", tmp_path / "export", manifest, 1)
    clean = dx.integrity_check(probes.check_shard_cache(tmp_path / "node" / "shards"))
    assert clean.status == PASS and "1 shard(s), 2 files" in clean.detail
    data = bytearray((shard / "stage1.bin").read_bytes())
    data[10] ^= 0xFF
    (shard / "stage1.bin").write_bytes(bytes(data))
    (shard / "stage1.xml").unlink()
    bad = dx.integrity_check(probes.check_shard_cache(tmp_path / "node" / "shards", "node"))
    assert bad.name == "shard cache node" and bad.status == FAIL
    assert f"{shard.name[:12]}/stage1.bin: sha256" in bad.detail
    assert f"{shard.name[:12]}/stage1.xml: missing" in bad.detail
    misfiled = tmp_path / "node" / "shards" / ("0" * 64)  # filed under a hash it is not
    shutil.copytree(shard, misfiled)
    problems = probes.check_shard_cache(tmp_path / "node" / "shards").problems
    assert f"{'0' * 12}: its manifest.json describes no stage with this hash" in problems


def test_export_integrity_names_every_damaged_file(tmp_path: Path) -> None:
    fake_export(tmp_path / "exports" / "group" / "two")
    fake_export(tmp_path / "exports" / "one", stages=1)
    (tmp_path / "exports" / ".half.partial").mkdir()  # an export being written: not listed
    found = probes.export_dirs(tmp_path / "exports")
    assert sorted(p.name for p in found) == ["one", "two"]
    assert all(dx.integrity_check(probes.check_export(p)).status == PASS for p in found)
    two = tmp_path / "exports" / "group" / "two"
    (two / "stage0.bin").write_bytes(b"x")
    (two / "stage1.xml").write_bytes(b"y")
    check = dx.integrity_check(probes.check_export(two, "group/two"))
    assert check.status == FAIL and "2 problem(s)" in check.detail
    assert "stage0.bin: sha256" in check.detail and "stage1.xml: sha256" in check.detail
    (two / "manifest.json").write_text("{")
    assert dx.integrity_check(probes.check_export(two)).status == FAIL


def test_memory_needs_of_the_stages_placed_here(tmp_path: Path) -> None:
    manifest = fake_export(tmp_path / "export", size=1 << 20)
    cache_shard(tmp_path / "n1", tmp_path / "export", manifest, 1)
    (tmp_path / "n1" / "node_id").write_text("n1\n")
    here = probes.node_ids(probes.state_dirs(tmp_path))
    assert here == {"n1": tmp_path / "n1"}
    elsewhere = tmp_path / "elsewhere" / "deep" / "down" / "state"  # --state-dir
    elsewhere.mkdir(parents=True)
    (elsewhere / "node_id").write_text("far-1\n")
    assert probes.state_dirs(tmp_path / "missing", [elsewhere]) == [elsewhere]
    assert "far-1" in probes.node_ids(probes.state_dirs(tmp_path, [elsewhere]))
    status = cluster([node("coord", 0), node("n1", 1)], export_dir=str(tmp_path / "export"))
    status = ClusterStatus(**{**status.__dict__, "stages": [
        StageStatus(0, 0, 2, manifest.stage_hash(0), 3 << 20, "coord", "serving"),
        StageStatus(1, 2, 4, manifest.stage_hash(1), 3 << 20, "n1", "serving")]})
    (need,) = probes.stage_needs_here(status, here)
    assert need.label == "stage 1 (layers 2-3) of n1" and need.bytes == 3 << 20
    assert need.held == int((2 << 20) * 1.2)  # its xml and bin, with the runtime overhead
    whole = probes.largest_export_need([tmp_path / "export"])
    assert whole is not None and whole.bytes > 4 << 20 and "export" in whole.label


def test_tcp_probes_and_the_health_get(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        open_addr = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        closed = f"tcp://127.0.0.1:{free_port()}"
        found = probes.tcp_connect_all([open_addr, closed, open_addr])
    assert found[open_addr].ok and not found[closed].ok and len(found) == 2
    assert "refused" in found[closed].error.lower()
    assert not probes.tcp_connect("nonsense").ok

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook
            code = 200 if self.path == "/health" else 503
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}' if code == 200 else b"stage 1 is down")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert probes.http_health(base) == dx.HttpFacts(200, '{"status": "ok"}')
        sick = probes.http_health(base + "/sub")  # /sub/health: 503 with its reason
        assert sick.status == 503 and sick.body == "stage 1 is down"
    finally:
        server.shutdown()
        server.server_close()
    gone = probes.http_health(closed_url())
    assert gone.status is None and gone.refused


def test_status_over_a_bad_address_or_to_nobody_is_a_bounded_error() -> None:
    with pytest.raises(ClusterUnreachable, match="not a coordinator address"):
        query_status("tcp://127.0.0.1")
    start = time.monotonic()
    with pytest.raises(ClusterUnreachable, match="no answer"):
        query_status_timed(f"tcp://127.0.0.1:{free_port()}", timeout=0.3)
    assert time.monotonic() - start < 2.0


# -- the command ---------------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ZCTL_HOME, and nothing listening where the API is looked for by default."""
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(doctor, "DEFAULT_API", closed_url())
    return tmp_path / "home"


def test_without_a_cluster_the_local_checks_run_and_the_rest_warn(home: Path) -> None:
    manifest = fake_export(home / "exports" / "tiny-2stages")
    cache_shard(home / "node", home / "exports" / "tiny-2stages", manifest, 1)
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] is True
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["cluster"]["status"] == "warn" and "not checked" in checks["cluster"]["detail"]
    assert checks["api"]["status"] == "warn" and "no API server" in checks["api"]["detail"]
    assert checks["versions here"]["status"] == "pass"
    assert checks["export tiny-2stages"]["status"] == "pass"
    assert checks["shard cache node"]["status"] == "pass"
    assert checks["memory"]["status"] == "pass" and "tiny-2stages" in checks["memory"]["detail"]
    assert {"device CPU", "cpu features"} <= set(checks)
    grammar = checks["structured output"]  # the fake export carries no tokenizer
    assert grammar["status"] == "warn" and "tokenizer.json" in grammar["detail"]
    assert all(c["status"] in ("pass", "warn") for c in report["checks"])
    human = runner.invoke(app, ["doctor"])  # one line per check and the tally
    assert human.exit_code == 0
    lines = human.output.strip().splitlines()
    assert len(lines) == len(report["checks"]) + 1 and lines[-1].endswith("0 fail")
    assert lines[0].startswith("PASS  versions here")


def test_an_unreachable_coordinator_or_api_is_a_fail_line_and_exit_1(home: Path) -> None:
    start = time.monotonic()
    result = runner.invoke(app, ["doctor", "--json", "--endpoint", f"tcp://127.0.0.1:{free_port()}",
                                 "--timeout", "0.5", "--api", closed_url()])
    assert time.monotonic() - start < 10
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert checks["control port"]["status"] == "fail"
    assert "nothing accepts a TCP connection" in checks["control port"]["detail"]
    assert checks["api"]["status"] == "fail"  # named explicitly: nothing there is a failure
    bad = runner.invoke(app, ["doctor", "--endpoint", "nonsense"])
    assert bad.exit_code == 1 and "FAIL  control port" in bad.output
    assert "Traceback" not in bad.output


def test_doctor_against_a_live_coordinator_and_node(cp_cluster, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane import messages as m
    from tests.helpers.control import RawNode, enrol_msg, wait_for

    monkeypatch.setenv("ZCTL_HOME", str(tmp_path))  # where cp_cluster keeps both state dirs
    coord = cp_cluster.coordinator(heartbeat_interval=0.5)
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    stranger = RawNode(coord.endpoint, b"old-1")
    try:
        stranger.send(*m.to_frames(enrol_msg("old-1", openvino="2025.0.0")))
        assert isinstance(stranger.recv_until(m.Refuse), m.Refuse)
    finally:
        stranger.close()
    status = query_status(coord.endpoint)  # what the status reply now carries
    assert abs(status.time_s - time.time()) < 5 and status.heartbeat_interval == 0.5
    assert status.liveness == 10 and status.refused[-1].code == "openvino-version"
    assert next(n for n in status.nodes if not n.local).last_sent_s is not None

    opts = doctor.DoctorOptions(endpoint=coord.endpoint, api=closed_url())
    checks = {c.name: c for c in doctor.run_checks(opts)}
    for name in ("control port", "clock offset", "pipeline", "versions coordinator",
                 "versions nodes", f"heartbeats {agent.node_id}", "data pipe stage 0",
                 "shard cache n1", "memory"):
        assert name in checks, sorted(checks)
    assert all(checks[n].status == PASS for n in ("control port", "pipeline", "versions nodes",
                                                   f"heartbeats {agent.node_id}", "shard cache n1"))
    assert "one clock" in checks["clock offset"].detail
    assert checks["refused old-1"].status == FAIL
    assert "stage 0 (layers 0-1)" in checks["memory"].detail
    assert "stage 1 (layers 2-3)" in checks["memory"].detail
    # the fake stages bind no data pipes: the coordinator records them serving, yet
    # nothing accepts a connection there
    assert checks["data pipe stage 1"].status == FAIL
    assert "coordinator records serving" in checks["data pipe stage 1"].detail
    listeners = []
    for addr in (coord.data_addr, agent.data_addr):
        sock = socket.socket()
        sock.bind(probes.split_address(addr))
        sock.listen()
        listeners.append(sock)
    try:
        checks = {c.name: c for c in doctor.run_checks(opts)}
    finally:
        for sock in listeners:
            sock.close()
    assert checks["data pipe stage 0"].status == checks["data pipe stage 1"].status == PASS
    # a damaged cached shard fails, naming its file
    cached = tmp_path / "n1" / "shards" / coord.hashes[1] / "stage1.bin"
    data = cached.read_bytes()
    cached.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    agent.stop()
    wait_for(lambda: any(n.state == "left" for n in coord.status().nodes), what="left")
    checks = {c.name: c for c in doctor.run_checks(opts)}
    assert checks["shard cache n1"].status == FAIL and "stage1.bin" in checks["shard cache n1"].detail
    assert checks["pipeline"].status == FAIL and "is left" in checks["pipeline"].detail
    assert checks[f"heartbeats {agent.node_id}"].status == WARN


def test_structured_output_compiles_against_an_exports_tokenizer(dp_export2, tmp_path) -> None:
    facts = probes.grammar_probe(dp_export2, "tiny")
    check = dx.grammar_check(facts)
    assert facts.error == "" and facts.vocab == 384 and facts.build_ms > 0
    assert check.status == dx.PASS and "384 tokens" in check.detail
    broken = dx.grammar_check(probes.grammar_probe(tmp_path, "empty"))
    assert broken.status == dx.WARN and "tokenizer.json" in broken.detail
    assert "would be refused" in broken.detail
