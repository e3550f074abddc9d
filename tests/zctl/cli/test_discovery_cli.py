"""``zctl node join`` with no address, ``zctl cluster ls`` and ``cluster pair``'s checks,
with the browse replaced by what it would have seen (no process, no multicast)."""

from __future__ import annotations

import pytest
import zmq
from typer.testing import CliRunner

from controlplane.security import key_fingerprint, write_public_key
from zctl.cli.app import app
from zctl.discovery import browser
from zctl.discovery.browser import Sightings
from zctl.discovery.records import Announcement

runner = CliRunner()
PUB, _ = zmq.curve_keypair()
LAB = Announcement("lab", "tcp://10.0.0.1:5550", 9, "2026.4.1", "pc1")
SAFE = Announcement("safe", "tcp://10.0.0.2:5550", 9, "2026.4.1", "pc2", key_fingerprint(PUB))


@pytest.fixture
def seen(monkeypatch, tmp_path):
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path))
    sightings = Sightings([LAB, SAFE], {"old._zctl._tcp.local.": "cluster old speaks control "
                                                                  "protocol 8, this zctl speaks 9"})
    monkeypatch.setattr(browser, "browse", lambda *a, **k: sightings)
    return sightings


def test_cluster_ls_lists_what_is_visible_and_what_was_refused(seen):
    result = runner.invoke(app, ["cluster", "ls"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "lab" in result.output and "tcp://10.0.0.2:5550" in result.output
    assert key_fingerprint(PUB)[:4] in result.output and "off" in result.output
    assert "refused old._zctl._tcp.local.: cluster old speaks control protocol 8" in result.output


def test_node_join_with_two_clusters_refuses_to_guess(seen):
    result = runner.invoke(app, ["node", "join"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "2 clusters are announced; name one with --cluster NAME" in result.output
    assert "ignored old._zctl._tcp.local." in result.output


def test_node_join_at_a_terminal_asks_which_cluster(seen, monkeypatch):
    import sys

    from zctl.cli.discovery import find_cluster

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("typer.prompt", lambda *a, **k: "lab")
    assert find_cluster(None, 2.0) == LAB


def test_node_join_of_a_curve_cluster_without_a_key_says_pair(seen, tmp_path):
    result = runner.invoke(app, ["node", "join", "--cluster", "safe"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "cluster safe is CURVE-secured" in result.output
    assert "zctl node join --pair CODE" in result.output
    other, _ = zmq.curve_keypair()
    forged = write_public_key(tmp_path / "other.key", other)
    result = runner.invoke(app, ["node", "join", "--cluster", "safe", "--curve-server-key",
                                 str(forged)], env={"COLUMNS": "200"})
    assert result.exit_code == 1 and "not the coordinator key given" in result.output


def test_join_options_that_exclude_each_other(seen, tmp_path):
    result = runner.invoke(app, ["node", "join", "tcp://10.0.0.1:5550", "--cluster", "lab"])
    assert result.exit_code == 1 and "not both" in result.output
    key = write_public_key(tmp_path / "c.key", PUB)
    result = runner.invoke(app, ["node", "join", "--pair", "1234-5678", "--curve-server-key",
                                 str(key)])
    assert result.exit_code == 1 and "leave out --curve-server-key" in result.output
    result = runner.invoke(app, ["node", "join", "--cluster", "lab", "--pair", "12-34"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 1 and "a pairing code is 8 digits" in result.output


def test_cluster_pair_needs_a_curve_cluster_here(seen):
    result = runner.invoke(app, ["cluster", "pair"])
    assert result.exit_code == 1 and "no --curve cluster is up here" in result.output


def test_cluster_up_refuses_a_bad_cluster_name_or_interface(seen):
    result = runner.invoke(app, ["cluster", "up", "--cluster-name", "no spaces"])
    assert result.exit_code == 1 and "cluster name 'no spaces'" in result.output
    result = runner.invoke(app, ["cluster", "up", "--announce-interface", "nosuch0"])
    assert result.exit_code == 1 and "no IPv4 interface named nosuch0" in result.output


@pytest.mark.parametrize(("flags", "announce", "name", "interfaces"), [
    ([], True, "", []),
    (["--no-announce"], False, "", []),
    (["--cluster-name", "lab", "--announce-interface", "lo", "--announce-loopback"], True, "lab",
     ["lo"]),
])
def test_cluster_up_hands_its_announce_options_to_the_coordinator(
        seen, monkeypatch, tmp_path, flags, announce, name, interfaces):
    from zctl.cli import cluster as cluster_cli
    from zctl.launcher.record import ClusterRecord

    started = []

    def start(coordinator):  # noqa: ANN001, ANN202
        started.append(coordinator)
        return ClusterRecord(control="tcp://10.0.0.1:5550", serve="", export_dir="", pids=[])

    monkeypatch.setattr(cluster_cli, "ensure_export", lambda *a, **k: tmp_path)
    monkeypatch.setattr(cluster_cli, "_start_remote_coordinator", start)
    monkeypatch.setattr("socket.gethostname", lambda: "pc-lab.example.org")
    result = runner.invoke(app, ["cluster", "up", *flags], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    (coordinator,) = started
    assert coordinator.announce is announce
    assert coordinator.cluster_name == name  # "": the coordinator names it by its host
    assert coordinator.announced_name == (name or "pc-lab")
    assert coordinator.announce_interfaces == interfaces
    assert coordinator.announce_loopback is bool(interfaces)
    joined = f"zctl node join (it finds the cluster {name or 'pc-lab'} on the LAN)"
    assert (joined in " ".join(result.output.split())) is announce  # (wrapped)
