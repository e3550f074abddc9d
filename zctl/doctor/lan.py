"""``zctl doctor``'s LAN discovery section: facts gathered here (does multicast DNS loop
back on each LAN interface, what clusters are announced, can their control endpoints be
reached) and the pure verdicts on them.

The multicast probe joins the mDNS group on an interface, sends one mDNS query for zctl's
service type there and waits to hear it back: a firewall rule that drops multicast, or an
interface without it, fails the probe. Hearing one's own query does not prove that a
switch forwards it; not seeing an announced cluster is the next check's warning.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from zctl.discovery.interfaces import Interface
from zctl.discovery.records import JOIN_BY_ADDRESS, Announcement
from zctl.doctor.verdicts import FAIL, PASS, WARN, Check

MDNS_GROUP, MDNS_PORT = "224.0.0.251", 5353


@dataclass(frozen=True)
class MulticastFacts:
    """Whether this machine heard its own mDNS query on ``interface``."""

    interface: Interface
    heard: bool
    error: str = ""
    tested: bool = True  # False: the probe's socket could not be set up (no verdict)


def multicast_loop(interface: Interface, timeout: float = 1.0) -> MulticastFacts:
    """Send one mDNS query on ``interface`` and listen for it (never raises)."""
    from zeroconf import DNSOutgoing, DNSQuestion
    from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _TYPE_PTR

    from zctl.discovery.records import SERVICE_TYPE

    query = DNSOutgoing(_FLAGS_QR_QUERY)
    query.add_question(DNSQuestion(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN))
    marker = os.urandom(4).hex()  # told apart from other queriers' identical queries
    query.add_question(DNSQuestion(f"zctl-doctor-{marker}.local.", _TYPE_PTR, _CLASS_IN))
    packet = query.packets()[0]
    here = socket.inet_aton(interface.address)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("", MDNS_PORT))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton(MDNS_GROUP) + here)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, here)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
            try:
                sock.sendto(packet, (MDNS_GROUP, MDNS_PORT))
            except OSError as exc:  # EPERM: a firewall rule refused it
                return MulticastFacts(interface, False,
                                      f"sending was refused ({exc.strerror or exc})")
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data, _ = sock.recvfrom(9000)
                except TimeoutError:
                    break
                if data == packet:
                    return MulticastFacts(interface, True)
    except OSError as exc:
        return MulticastFacts(interface, False, exc.strerror or str(exc), tested=False)
    return MulticastFacts(interface, False, f"its own query did not come back within {timeout:g} s")


def lan_interfaces() -> list[Interface]:
    """The interfaces a node here finds clusters on: as a coordinator binding every
    interface announces (no container bridges, no loopback)."""
    from zctl.discovery.interfaces import announce_addresses, local_interfaces

    return announce_addresses(local_interfaces(), "0.0.0.0")


# -- verdicts (pure) ------------------------------------------------------------------------
def multicast_check(facts: Sequence[MulticastFacts]) -> Check:
    if not facts:
        return Check("LAN multicast", WARN, "no LAN interface here (only loopback or container "
                                            f"bridges): nothing to announce on; {JOIN_BY_ADDRESS}")
    bad = [f for f in facts if not f.heard and f.tested]
    untested = [f for f in facts if not f.tested]
    where = ", ".join(f"{f.interface.name} {f.interface.address}" for f in facts if f.heard)
    if not bad and untested:
        detail = "; ".join(f"{f.interface.name} {f.interface.address}: {f.error}" for f in untested)
        return Check("LAN multicast", WARN, f"could not test multicast DNS ({detail})"
                                            + (f"; it loops back on {where}" if where else ""))
    if not bad:
        return Check("LAN multicast", PASS, f"multicast DNS loops back on {where}")
    detail = "; ".join(f"{f.interface.name} {f.interface.address}: {f.error}" for f in bad)
    return Check("LAN multicast", FAIL, f"multicast DNS does not get through ({detail}): a "
                                        "firewall dropping multicast, or an interface without "
                                        f"it; nodes cannot find clusters here: {JOIN_BY_ADDRESS}")


def clusters_check(found: Sequence[Announcement], refused: dict[str, str]) -> Check:
    names = ", ".join(sorted({f"{a.cluster} ({a.control})" for a in found}))
    skipped = (f"; refused {len(refused)}: " + "; ".join(
        f"{name.split('.')[0]}: {why}" for name, why in sorted(refused.items()))) if refused else ""
    if not found:
        return Check("LAN clusters", WARN, f"no cluster is announced on this LAN{skipped}; "
                                           f"{JOIN_BY_ADDRESS}")
    return Check("LAN clusters", WARN if refused else PASS, f"announced: {names}{skipped}")


def same_name_check(found: Sequence[Announcement]) -> Check:
    by_name: dict[str, set[str]] = {}
    for a in found:
        by_name.setdefault(a.cluster, set()).add(a.control)
    twins = {name: sorted(controls) for name, controls in by_name.items() if len(controls) > 1}
    if not twins:
        return Check("cluster names", PASS, "no two coordinators announce one name")
    detail = "; ".join(f"{name} at {', '.join(c)}" for name, c in sorted(twins.items()))
    return Check("cluster names", FAIL, f"two coordinators announce one name ({detail}): a node "
                                        "joining by name refuses to guess; give one cluster "
                                        "another --cluster-name")


def endpoint_checks(found: Sequence[Announcement], reachable: dict[str, str]) -> list[Check]:
    """``reachable``: control endpoint -> "" if a TCP connect worked, else why not."""
    out = []
    for a in sorted(found, key=lambda a: (a.cluster, a.control)):
        why = reachable.get(a.control, "not probed")
        if why:
            out.append(Check(f"announced {a.cluster}", FAIL, f"{a.cluster} at {a.control} is "
                                                         f"announced but unreachable from here "
                                                         f"({why}): a firewall, or the wrong "
                                                         "interface announced "
                                                         "(cluster up --announce-interface)"))
        else:
            out.append(Check(f"announced {a.cluster}", PASS, f"{a.cluster} at {a.control} reachable"))
    return out


def node_id_check(here: Iterable[str], addresses: Iterable[str], found: Sequence[Announcement],
                  members: Sequence[tuple[str, str]] = ()) -> Check:
    """``here``: this machine's node ids; ``addresses``: its own addresses; ``members``:
    (node id, host) of the nodes a cluster's status lists."""
    ours, local = set(here), {str(ipaddress.ip_address(a)) for a in addresses}
    clashes = [f"{a.coordinator_id} (the coordinator of {a.cluster} at {a.host})" for a in found
               if a.coordinator_id in ours and a.host not in local]
    clashes += [f"{node_id} (a node at {host})" for node_id, host in members
                if node_id in ours and host not in local]
    if not ours:
        return Check("node id", PASS, "no node id here yet (made on first join)")
    if clashes:
        return Check("node id", FAIL, f"this machine's node id is used by another machine: "
                                      f"{'; '.join(sorted(set(clashes)))}; a cloned state "
                                      "directory? delete node_id in one of them")
    return Check("node id", PASS, f"{', '.join(sorted(ours))}: not seen elsewhere")
