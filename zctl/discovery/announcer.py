"""A coordinator's announcement on the LAN: one DNS-SD service (``_zctl._tcp``) over
multicast DNS on the chosen interfaces, withdrawn (goodbye records) when it closes."""

from __future__ import annotations

import ipaddress
import socket

from zeroconf import IPVersion, ServiceInfo, Zeroconf

from zctl.discovery.interfaces import Interface
from zctl.discovery.records import SERVICE_TYPE, Announcement, announcement_txt


class Announcer:
    """Announces ``announcement`` on ``interfaces`` until ``close()``."""

    def __init__(self, announcement: Announcement, interfaces: list[Interface]) -> None:
        if not interfaces:
            raise ValueError("no interface to announce on")
        self.announcement = announcement
        self.interfaces = interfaces
        self._zeroconf: Zeroconf | None = None
        self._info: ServiceInfo | None = None

    @property
    def instance(self) -> str:
        return f"{self.announcement.cluster}@{self.announcement.coordinator_id}.{SERVICE_TYPE}"

    def start(self) -> None:
        """Open the multicast sockets and announce; OSError if they cannot be opened."""
        addresses = [i.address for i in self.interfaces]
        info = ServiceInfo(
            SERVICE_TYPE, self.instance, port=self.announcement.port,
            properties=announcement_txt(self.announcement),
            addresses=[socket.inet_aton(a) for a in addresses
                       if ipaddress.ip_address(a).version == 4],
            server=f"zctl-{self.announcement.coordinator_id}.local.")
        zeroconf = Zeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
        try:
            zeroconf.register_service(info, allow_name_change=True)
        except BaseException:
            zeroconf.close()
            raise
        self._zeroconf, self._info = zeroconf, info

    def close(self) -> None:
        """Withdraw the announcement and close the sockets (again: nothing)."""
        zeroconf, info = self._zeroconf, self._info
        self._zeroconf = self._info = None
        if zeroconf is None:
            return
        try:
            if info is not None:
                zeroconf.unregister_service(info)
        finally:
            zeroconf.close()


def announce_cluster(announcement: Announcement, bind_host: str, named: list[str],
                     loopback: bool) -> Announcer:
    """Announce a coordinator's cluster on the interfaces that carry ``bind_host`` (or the
    ``named`` ones), its control endpoint made one of theirs; ValueError if there is no
    such interface, OSError if multicast sockets cannot be opened there."""
    from dataclasses import replace

    from zctl.discovery.interfaces import announce_addresses, announced_control, local_interfaces

    chosen = announce_addresses(local_interfaces(), bind_host, named, loopback,
                                control_host=announcement.host)
    if not chosen:
        raise ValueError(f"no interface to announce on for bind address {bind_host} (loopback "
                         "and container bridges are left out: --announce-interface NAME or "
                         "--announce-loopback)")
    announcer = Announcer(replace(announcement, control=announced_control(announcement.control,
                                                                          chosen)), chosen)
    announcer.start()
    return announcer
