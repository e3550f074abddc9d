"""Finding announced clusters: browse ``_zctl._tcp`` for a few seconds, read each
service's records and keep the announcements that pass ``parse_announcement``; the
others come back as refusals with their reasons, never as an exception."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from zeroconf import (
    InterfaceChoice,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from zctl.discovery.records import (
    SERVICE_TYPE,
    Announcement,
    AnnouncementRefused,
    choose_cluster,
    parse_announcement,
)

log = logging.getLogger("zctl.discovery")
BROWSE_S = 2.0  # how long a browse listens: announcers answer a query within ~0.5 s


@dataclass
class Sightings:
    """What one browse saw: usable announcements, and the refused ones by service name."""

    announcements: list[Announcement] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def browse(protocol: int, seconds: float = BROWSE_S, interfaces: list[str] | None = None
           ) -> Sightings:
    """The clusters announced on the LAN within ``seconds`` (twice that when none answered
    in time) on ``interfaces``' addresses (default every interface); OSError if no
    multicast socket can be opened."""
    names: list[str] = []

    def on_change(zeroconf: Zeroconf, service_type: str, name: str,
                  state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Removed and name not in names:
            names.append(name)

    zeroconf = Zeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)
    sightings = Sightings()
    try:
        browser = ServiceBrowser(zeroconf, SERVICE_TYPE, handlers=[on_change])
        time.sleep(seconds)  # the browser's queries and their answers run on its own thread
        if not names:  # nothing yet: a loaded machine or a slow responder gets as long again
            time.sleep(seconds)
        browser.cancel()
        for name in list(names):
            _read(zeroconf, name, protocol, sightings)
    finally:
        zeroconf.close()
    return sightings


def _read(zeroconf: Zeroconf, name: str, protocol: int, sightings: Sightings) -> None:
    try:
        info = zeroconf.get_service_info(SERVICE_TYPE, name, timeout=1500)
    except Exception as exc:  # noqa: BLE001 - a record the library cannot read is refused
        sightings.refused[name] = f"unreadable records: {exc}"
        return
    if not isinstance(info, ServiceInfo):
        sightings.refused[name] = "no answer to a query for its records"
        return
    try:
        announcement = parse_announcement(info.properties, info.parsed_addresses(), protocol)
    except AnnouncementRefused as exc:
        log.warning("ignoring the announcement %s: %s", name, exc)
        sightings.refused[name] = str(exc)
        return
    sightings.announcements.append(announcement)


class Rediscovery:
    """Finds a cluster's coordinator again by name (and key fingerprint, when the node
    joined a CURVE cluster): a node agent asks before reconnecting to a lost coordinator."""

    def __init__(self, cluster: str, protocol: int, fingerprint: str = "",
                 seconds: float = BROWSE_S) -> None:
        self.cluster = cluster
        self.protocol = protocol
        self.fingerprint = fingerprint
        self.seconds = seconds

    def locate(self) -> str | None:
        """The control endpoint the cluster announces now; None if it is not visible (or
        not uniquely, or under another key)."""
        try:
            sightings = browse(self.protocol, self.seconds)
            found = choose_cluster(sightings.announcements, self.cluster)
        except (OSError, ValueError) as exc:
            log.info("cluster %s not found again: %s", self.cluster, exc)
            return None
        if self.fingerprint and found.fingerprint != self.fingerprint:
            log.warning("cluster %s is announced under another key (%s): not following it",
                        self.cluster, found.fingerprint[:16])
            return None
        return found.control
