"""An announcement on loopback is found by a browse; forged and other-protocol ones beside
it are refused with their reasons, and the browse goes on (zctl.discovery.announcer and
browser; multicast DNS on 127.0.0.1 only)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from zeroconf import IPVersion, ServiceInfo, Zeroconf

from zctl.discovery.announcer import Announcer, announce_cluster
from zctl.discovery.browser import Rediscovery, browse
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
    assert Rediscovery("loop-lab", PROTO, seconds=1.5).locate() == "tcp://127.0.0.1:5599"
    assert Rediscovery("loop-lab", PROTO, fingerprint="ab" * 32, seconds=1.0).locate() is None
    assert Rediscovery("nowhere", PROTO, seconds=0.3).locate() is None


def test_loopback_is_announced_only_when_asked():
    anon = Announcement("x", "tcp://127.0.0.1:5598", PROTO, "2026.4.1", "pc-z")
    with pytest.raises(ValueError, match="no interface to announce on for bind address "
                                         "127.0.0.1 .*--announce-loopback"):
        announce_cluster(anon, "127.0.0.1", [], loopback=False)
