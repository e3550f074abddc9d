"""Where a coordinator announces: the IPv4 addresses of the interfaces that carry its bind
address, never a container bridge or loopback unless asked for by name or flag.

``announce_addresses`` is pure over a list of ``Interface``; ``local_interfaces`` reads
this machine's (ifaddr, which python-zeroconf itself uses).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from zctl.endpoints import split_address, tcp_address

# interfaces that container runtimes and hypervisors make: announcing there sends nodes to
# an address no other PC can reach (exo #858 picked docker0)
BRIDGE_PREFIXES = ("docker", "br-", "veth", "virbr", "vnet", "cni", "flannel", "cali",
                   "vxlan", "podman", "lxcbr", "lxdbr", "weave", "kube", "tun", "tap", "zt",
                   "tailscale", "wg")
EVERY = ("", "0.0.0.0", "*")


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of a network interface."""

    name: str
    address: str
    prefix: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    @property
    def bridge(self) -> bool:
        return self.name.startswith(BRIDGE_PREFIXES)


def local_interfaces() -> list[Interface]:
    """This machine's IPv4 interface addresses."""
    import ifaddr

    return [Interface(adapter.nice_name, ip.ip, ip.network_prefix)
            for adapter in ifaddr.get_adapters() for ip in adapter.ips
            if isinstance(ip.ip, str)]


def announce_addresses(interfaces: Iterable[Interface], bind_host: str, named: Iterable[str] = (),
                       loopback: bool = False, control_host: str = "") -> list[Interface]:
    """The interface addresses to announce on for a coordinator bound to ``bind_host``
    that nodes reach at ``control_host``: the interfaces ``named``
    (``--announce-interface``) if any; else the one carrying a specific bind address, or
    the control host; else (binding every interface) all but container bridges and,
    unless ``loopback``, loopback. ValueError names a named interface that is missing or
    does not carry the bind address."""
    every, names = list(interfaces), list(named)
    if names:
        return named_interfaces(every, bind_host, names)
    if bind_host in EVERY and any(i.address == control_host for i in every):
        bind_host = control_host
    if bind_host not in EVERY:
        chosen = [i for i in every if i.address == bind_host]
        if chosen and chosen[0].loopback and not loopback:
            return []
        return chosen
    return [i for i in every if not i.bridge and (loopback or not i.loopback)]


def named_interfaces(interfaces: Iterable[Interface], bind_host: str, named: Iterable[str]
                     ) -> list[Interface]:
    """The interfaces ``named`` (``--announce-interface``) that carry ``bind_host`` (any of
    theirs when it binds every interface); ValueError names one that is missing, or says
    that none carries the bind address. Whoever nodes reach the coordinator at does not
    change it: ``cluster up`` refuses a wrong name with it before anything starts."""
    every, names = list(interfaces), list(named)
    chosen = [i for i in every if i.name in names]
    missing = sorted(set(names) - {i.name for i in chosen})
    if missing:
        raise ValueError(f"no IPv4 interface named {', '.join(missing)} "
                         f"(there are: {', '.join(sorted({i.name for i in every}))})")
    if bind_host not in EVERY:
        chosen = [i for i in chosen if i.address == bind_host]
        if not chosen:
            raise ValueError(f"--announce-interface {', '.join(names)} does not carry the "
                             f"bind address {bind_host}")
    return chosen


def announced_control(control: str, chosen: list[Interface]) -> str:
    """The control endpoint to announce on ``chosen``: ``control`` if its host is one of
    them, else the same port at the first of them (a host nodes on that LAN can reach)."""
    host, port = split_address(control)
    if any(i.address == host for i in chosen) or not chosen:
        return control
    return tcp_address(chosen[0].address, port)


def default_cluster_name(hostname: str) -> str:
    """A cluster's name when none is given: this machine's host name, made a valid name."""
    import re

    name = re.sub(r"[^A-Za-z0-9._-]", "-", hostname.split(".")[0])[:63].strip("-._")
    return name or "zctl"
