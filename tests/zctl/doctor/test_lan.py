"""``zctl doctor``'s LAN discovery verdicts (zctl.doctor.lan), on facts made up here, and
the multicast probe on loopback."""

from __future__ import annotations

from zctl.discovery.interfaces import Interface
from zctl.discovery.records import Announcement
from zctl.doctor.lan import (
    MulticastFacts,
    clusters_check,
    endpoint_checks,
    multicast_check,
    multicast_loop,
    node_id_check,
    same_name_check,
)
from zctl.doctor.verdicts import FAIL, PASS, WARN

ETH = Interface("eth0", "10.0.0.5", 24)
LAB = Announcement("lab", "tcp://10.0.0.1:5550", 9, "2026.4.1", "pc1-aa")
TWIN = Announcement("lab", "tcp://10.0.0.2:5550", 9, "2026.4.1", "pc2-bb")


def test_multicast_that_does_not_loop_back_fails_naming_the_fallback():
    assert multicast_check([MulticastFacts(ETH, True)]).status == PASS
    bad = multicast_check([MulticastFacts(ETH, False, "its own query did not come back")])
    assert bad.status == FAIL and "eth0 10.0.0.5: its own query did not come back" in bad.detail
    assert "zctl node join tcp://HOST:PORT" in bad.detail
    busy = multicast_check([MulticastFacts(ETH, False, "Address already in use", tested=False)])
    assert busy.status == WARN and "could not test multicast DNS (eth0" in busy.detail
    none = multicast_check([])
    assert none.status == WARN and "no LAN interface" in none.detail


def test_clusters_names_endpoints():
    assert clusters_check([LAB], {}).status == PASS
    empty = clusters_check([], {"x._zctl._tcp.local.": "forged"})
    assert empty.status == WARN and "refused 1: x: forged" in empty.detail
    assert "zctl node join tcp://HOST:PORT" in empty.detail
    assert same_name_check([LAB]).status == PASS
    twins = same_name_check([LAB, TWIN])
    assert twins.status == FAIL and "lab at tcp://10.0.0.1:5550, tcp://10.0.0.2:5550" in twins.detail
    ok, down = endpoint_checks([LAB, TWIN], {LAB.control: "", TWIN.control: "connection refused"})
    assert ok.status == PASS and down.status == FAIL and "connection refused" in down.detail


def test_a_node_id_used_by_another_machine_fails():
    assert node_id_check([], ["10.0.0.5"], [LAB]).status == PASS
    assert node_id_check(["pc1-aa"], ["10.0.0.1"], [LAB]).status == PASS  # that is us
    clash = node_id_check(["pc1-aa"], ["10.0.0.5"], [LAB])
    assert clash.status == FAIL and "pc1-aa (the coordinator of lab at 10.0.0.1)" in clash.detail
    member = node_id_check(["n3"], ["10.0.0.5"], [], [("n3", "10.0.0.7"), ("n4", "10.0.0.8")])
    assert member.status == FAIL and "n3 (a node at 10.0.0.7)" in member.detail


def test_the_multicast_probe_hears_itself_on_loopback():
    facts = multicast_loop(Interface("lo", "127.0.0.1", 8))
    assert facts.heard, facts.error
