"""zctl doctor's probes (zctl.doctor.probes) on real files and sockets: cached shards and
exports checked file by file, the memory the stages placed here need, TCP connects and the
API's health, a grammar compiled against an export's tokenizer."""

from __future__ import annotations

import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from controlplane.records import ClusterStatus, StageStatus
from tests.helpers.doctor import cache_shard, closed_url, cluster, fake_export, free_port, node
from zctl.discovery.interfaces import Interface
from zctl.doctor import probes
from zctl.doctor import verdicts as dx
from zctl.doctor.verdicts import FAIL, PASS


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


def test_structured_output_compiles_against_an_exports_tokenizer(dp_export2, tmp_path) -> None:
    facts = probes.grammar_probe(dp_export2, "tiny")
    check = dx.grammar_check(facts)
    assert facts.error == "" and facts.vocab == 384 and facts.build_ms > 0
    assert check.status == dx.PASS and "384 tokens" in check.detail
    broken = dx.grammar_check(probes.grammar_probe(tmp_path, "empty"))
    assert broken.status == dx.WARN and "tokenizer.json" in broken.detail
    assert "would be refused" in broken.detail


def test_the_multicast_probe_hears_itself_on_loopback():
    facts = probes.multicast_loop(Interface("lo", "127.0.0.1", 8))
    assert facts.heard, facts.error


def test_multicast_is_probed_on_every_interface_at_once_in_their_order():
    lo, gone = Interface("lo", "127.0.0.1", 8), Interface("gone0", "192.0.2.77", 24)
    facts = probes.multicast_loops([gone, lo], timeout=1.0)
    assert [f.interface for f in facts] == [gone, lo]
    assert facts[1].heard, facts[1].error
    assert not facts[0].heard and not facts[0].tested  # no such address here: untested
    assert probes.multicast_loops([]) == []
