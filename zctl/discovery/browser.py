"""Finding announced clusters: browse ``_zctl._tcp`` for a few seconds, read each
service's records and keep the announcements that pass ``parse_announcement``; the
others come back as refusals with their reasons, never as an exception. ``ClusterWatch``
keeps browsing for one cluster while a node runs, so that it knows where its
coordinator is announced now without a browse to wait for."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
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
    parse_announcement,
)

log = logging.getLogger("zctl.discovery")
BROWSE_S = 2.0  # how long a browse listens: announcers answer a query within ~0.5 s
WATCH_READ_MS = 500  # how long a watch asks for a service's records the answer lacked


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


class ClusterWatch:
    """Watches the LAN for one cluster's announcements (by name, and key fingerprint when
    the node joined a CURVE cluster) from ``start()`` to ``close()``, keeping the latest of
    each: a node agent asks ``locate()`` where the coordinator is now before it reconnects
    to a lost one, and is answered at once (the browsing runs on zeroconf's threads)."""

    def __init__(self, cluster: str, protocol: int, fingerprint: str = "",
                 interfaces: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.protocol = protocol
        self.fingerprint = fingerprint
        self.interfaces = interfaces
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, Announcement]] = {}  # by service: (when, what)
        self._zeroconf: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None

    @property
    def watching(self) -> bool:
        return self._browser is not None

    def start(self) -> None:
        """Open the multicast sockets and browse until ``close()``; OSError if the sockets
        cannot be opened."""
        zeroconf = Zeroconf(interfaces=self.interfaces or InterfaceChoice.All,
                            ip_version=IPVersion.V4Only)
        try:
            self._browser = ServiceBrowser(zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        except BaseException:
            zeroconf.close()
            raise
        self._zeroconf = zeroconf

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        """A service added, changed or withdrawn (on the browser's thread)."""
        if state_change is ServiceStateChange.Removed:
            with self._lock:
                self._seen.pop(name, None)
            return
        info = ServiceInfo(SERVICE_TYPE, name)
        try:  # the records usually come with the answer; else asked for, briefly
            if not info.load_from_cache(zeroconf) and not info.request(zeroconf, WATCH_READ_MS):
                return
            announcement = parse_announcement(info.properties, info.parsed_addresses(),
                                              self.protocol)
        except AnnouncementRefused as exc:
            log.info("ignoring the announcement %s: %s", name, exc)
            return
        except Exception as exc:  # noqa: BLE001 - records the library cannot read: ignored
            log.info("ignoring the announcement %s: unreadable records: %s", name, exc)
            return
        with self._lock:
            self._seen[name] = (self._clock(), announcement)

    def locate(self) -> str | None:
        """The control endpoint of the cluster's newest announcement seen (under the key
        it was joined with); None when none is seen. Never waits."""
        with self._lock:
            seen = [(when, a) for when, a in self._seen.values() if a.cluster == self.cluster]
        keyed = [(when, a) for when, a in seen
                 if not self.fingerprint or a.fingerprint == self.fingerprint]
        if not keyed:
            if seen:
                log.warning("cluster %s is announced under another key (%s): not following it",
                            self.cluster, seen[0][1].fingerprint[:16])
            else:
                log.info("cluster %s is not announced now", self.cluster)
            return None
        return max(keyed, key=lambda entry: entry[0])[1].control

    def close(self) -> None:
        """Stop browsing and close the sockets (again: nothing)."""
        browser, zeroconf = self._browser, self._zeroconf
        self._browser = self._zeroconf = None
        try:
            if browser is not None:
                browser.cancel()
        finally:
            if zeroconf is not None:
                zeroconf.close()
