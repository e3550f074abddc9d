"""An announcement on loopback is found by a browse; forged and other-protocol ones beside
it are refused with their reasons, and the browse goes on (zctl.discovery.announcer and
browser; multicast DNS on 127.0.0.1 only)."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from zeroconf import IPVersion, ServiceInfo, Zeroconf

from tests.helpers.control import wait_for
from zctl.discovery.announcer import Announcer, announce_cluster
from zctl.discovery.browser import BROWSE_S, ClusterWatch, browse
from zctl.discovery.interfaces import Interface
from zctl.discovery.records import SERVICE_TYPE, Announcement, announcement_txt

PROTO = 9
LO = Interface("lo", "127.0.0.1", 8)


def hostile(name: str, txt: dict[str, str]) -> ServiceInfo:
    return ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=5550, properties=txt,
                       addresses=[socket.inet_aton("127.0.0.1")], server=f"{name}.local.")


@pytest.fixture(scope="module")
def announced():
    good = Announcement("loop-lab", "tcp://127.0.0.1:5599", PROTO, "2026.4.1", "pc-loop", "")
    announcer = Announcer(good, [LO])
    forger = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    infos = [
        hostile("forged", announcement_txt(Announcement(
            "forged", "tcp://10.9.9.9:5550", PROTO, "2026.4.1", "pc-x"))),
        hostile("old", announcement_txt(Announcement(
            "old", "tcp://127.0.0.1:5550", PROTO - 1, "2026.4.1", "pc-y"))),
        hostile("junk", {"fmt": "1", "cluster": "junk", "control": "tcp://127.0.0.1:x"}),
    ]
    try:
        with ThreadPoolExecutor(len(infos) + 1) as pool:  # each registration probes ~1.5 s
            list(pool.map(lambda register: register(), [announcer.start, *(
                lambda info=info: forger.register_service(info) for info in infos)]))
        yield good
    finally:
        forger.close()
        announcer.close()


def test_a_browse_finds_the_announcement_and_refuses_the_rest(announced):
    sightings = browse(PROTO, 2.0, ["127.0.0.1"])
    assert sightings.announcements == [announced]
    refused = {name.split(".")[0]: reason for name, reason in sightings.refused.items()}
    assert "not an address of the announcing host (127.0.0.1): forged" in refused["forged"]
    assert "speaks control protocol 8, this zctl speaks 9" in refused["old"]
    assert refused["junk"] == "no 'proto' in the record"


def test_a_watch_keeps_the_newest_announcement_of_its_cluster(announced):
    watches = [ClusterWatch("loop-lab", PROTO, interfaces=["127.0.0.1"]),
               ClusterWatch("loop-lab", PROTO, fingerprint="ab" * 32, interfaces=["127.0.0.1"]),
               ClusterWatch("nowhere", PROTO, interfaces=["127.0.0.1"])]
    watch, keyed, nowhere = watches
    for each in watches:
        each.start()
    try:
        wait_for(lambda: watch.locate() is not None, what="the announcement seen")
        assert watch.locate() == announced.control == "tcp://127.0.0.1:5599"
        assert keyed.locate() is None  # announced under another key: not followed
        assert nowhere.locate() is None
        # another coordinator announces the cluster: the newer announcement is followed,
        # and once it is withdrawn, the one left
        moved = Announcer(Announcement("loop-lab", "tcp://127.0.0.1:5601", PROTO, "2026.4.1",
                                       "pc-moved", ""), [LO])
        moved.start()
        try:
            wait_for(lambda: watch.locate() == "tcp://127.0.0.1:5601", what="the newer one")
        finally:
            moved.close()
        wait_for(lambda: watch.locate() == "tcp://127.0.0.1:5599", what="the one left")
    finally:
        for each in watches:
            each.close()
    assert not watch.watching
    watch.close()  # again: nothing


def test_a_node_that_watches_for_its_cluster_stops_promptly_while_it_is_away(cp_cluster):
    # the agent asks its watch where the coordinator is before each reconnection: an
    # answer from what the watch has seen, never a browse on the agent's thread
    coord = cp_cluster.coordinator()
    watch = ClusterWatch("away", PROTO, interfaces=["127.0.0.1"])
    watch.start()
    agent = cp_cluster.agent(coord.endpoint, locator=watch, heartbeat_interval=0.05,
                             liveness=3)
    coord.wait_serving(20)
    wait_for(lambda: (links := coord.status().links) and all(
        link.measured_at or link.error not in ("", "probing") for link in links),
        what="the links probed")
    coord.stop()  # (no probe of its links in flight: a probe would hold the agent's stop)
    wait_for(lambda: agent.counters["reconnects"] >= 3, what="reconnections")
    start = time.monotonic()
    agent.stop()
    took = time.monotonic() - start
    assert agent.state == "stopped" and not watch.watching  # the agent closed its watch
    assert took < BROWSE_S, took  # a single browse would have held it this long


def test_loopback_is_announced_only_when_asked():
    anon = Announcement("x", "tcp://127.0.0.1:5598", PROTO, "2026.4.1", "pc-z")
    with pytest.raises(ValueError, match="no interface to announce on for bind address "
                                         "127.0.0.1 .*--announce-loopback"):
        announce_cluster(anon, "127.0.0.1", [], loopback=False)
