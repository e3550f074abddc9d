"""Where a coordinator announces (zctl.discovery.interfaces): the interfaces carrying its
bind address; never container bridges or loopback unless told; its control endpoint one
that the chosen interfaces carry."""

from __future__ import annotations

import pytest

from zctl.discovery.interfaces import (
    Interface,
    announce_addresses,
    announced_control,
    default_cluster_name,
    named_interfaces,
)

LO = Interface("lo", "127.0.0.1", 8)
ETH = Interface("eth0", "192.168.1.10", 24)
WIFI = Interface("wlan0", "10.1.0.5", 16)
DOCKER = Interface("docker0", "172.17.0.1", 16)
BRIDGE = Interface("br-1a2b3c", "172.18.0.1", 16)
VETH = Interface("veth12ab", "169.254.3.3", 16)
ALL = [LO, ETH, WIFI, DOCKER, BRIDGE, VETH]


def test_every_interface_but_bridges_and_loopback_when_binding_them_all():
    assert announce_addresses(ALL, "0.0.0.0") == [ETH, WIFI]
    assert announce_addresses(ALL, "*", loopback=True) == [LO, ETH, WIFI]


def test_a_specific_bind_address_announces_on_its_interface_only():
    assert announce_addresses(ALL, "10.1.0.5") == [WIFI]
    assert announce_addresses(ALL, "127.0.0.1") == []  # loopback only when told
    assert announce_addresses(ALL, "127.0.0.1", loopback=True) == [LO]
    assert announce_addresses(ALL, "172.17.0.1") == [DOCKER]  # bound there on purpose
    # binding every interface, nodes reaching it at one address: that address's interface
    assert announce_addresses(ALL, "0.0.0.0", control_host="10.1.0.5") == [WIFI]
    assert announce_addresses(ALL, "0.0.0.0", control_host="127.0.1.1") == [ETH, WIFI]


def test_named_interfaces_win_and_are_checked():
    assert announce_addresses(ALL, "0.0.0.0", ["docker0", "lo"]) == [LO, DOCKER]
    with pytest.raises(ValueError, match=r"no IPv4 interface named eth9 \(there are: br-1a2b3c, "):
        announce_addresses(ALL, "0.0.0.0", ["eth9"])
    with pytest.raises(ValueError, match="does not carry the bind address 10.1.0.5"):
        announce_addresses(ALL, "10.1.0.5", ["eth0"])
    # the check cluster up makes before it starts anything: the same, whatever the host
    assert named_interfaces(ALL, "0.0.0.0", ["docker0", "lo"]) == [LO, DOCKER]
    with pytest.raises(ValueError, match="does not carry the bind address 10.1.0.5"):
        named_interfaces(ALL, "10.1.0.5", ["eth0"])


def test_the_announced_control_endpoint_is_on_a_chosen_interface():
    assert announced_control("tcp://10.1.0.5:5550", [ETH, WIFI]) == "tcp://10.1.0.5:5550"
    assert announced_control("tcp://127.0.1.1:5550", [ETH, WIFI]) == "tcp://192.168.1.10:5550"


def test_a_cluster_is_named_after_the_host_by_default():
    assert default_cluster_name("pc-lab.example.org") == "pc-lab"
    assert default_cluster_name("my box") == "my-box"
    assert default_cluster_name("---") == "zctl"
