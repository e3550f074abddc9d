"""Announcement records (zctl.discovery.records): what is written reads back; malformed,
forged and other-protocol records are refused with a reason and never raise anything
else (fuzzed); the cluster a node joins is the one named, or the only one."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zctl.discovery.records import (
    Announcement,
    AnnouncementRefused,
    ClusterChoiceError,
    announcement_txt,
    check_cluster_name,
    choose_cluster,
    control_endpoint,
    key_problem,
    parse_announcement,
    short_fingerprint,
)

PROTO = 9
KEY = "ab" * 32
LAB = Announcement("lab", "tcp://10.0.0.1:5550", PROTO, "2026.4.1", "pc1-1a2b3c4d", KEY)


def txt(a: Announcement = LAB, **changes: str | None) -> dict[bytes, bytes | None]:
    values: dict[str, str | None] = {**announcement_txt(a), **changes}
    return {k.encode(): None if v is None else v.encode() for k, v in values.items()}


def test_an_announcement_reads_back_as_written():
    assert parse_announcement(txt(), ["10.0.0.1", "fe80::1"], PROTO) == LAB
    plain = Announcement("lab", "tcp://10.0.0.1:5550", PROTO, "2026.4.1", "pc1", "")
    assert parse_announcement(txt(plain), ["10.0.0.1"], PROTO) == plain and not plain.curve
    assert LAB.describe() == ("lab at tcp://10.0.0.1:5550 (protocol 9, OpenVINO 2026.4.1, "
                              "CURVE key abab:abab:abab:abab)")
    assert (LAB.host, LAB.port) == ("10.0.0.1", 5550)


@pytest.mark.parametrize(("changes", "sources", "reason"), [
    ({"proto": "8"}, ["10.0.0.1"], "speaks control protocol 8, this zctl speaks 9"),
    ({"proto": "nine"}, ["10.0.0.1"], "is not a number"),
    ({"fmt": "2"}, ["10.0.0.1"], "record format '2'"),
    ({"fmt": None}, ["10.0.0.1"], "no 'fmt' in the record"),
    ({"cluster": None}, ["10.0.0.1"], "no 'cluster'"),
    ({"cluster": "-lab"}, ["10.0.0.1"], "is not a name"),
    ({"control": "tcp://10.0.0.9:5550"}, ["10.0.0.1"], "forged or stale"),
    ({}, [], "announcing host (none)"),
    ({"control": "tcp://evil.example:5550"}, ["10.0.0.1"], "is not an IP address"),
    ({"control": "ipc:///tmp/x"}, ["10.0.0.1"], "is not tcp://"),
    ({"control": "tcp://10.0.0.1:0"}, ["10.0.0.1"], "no port in 1..65535"),
    ({"control": "tcp://10.0.0.1:99999"}, ["10.0.0.1"], "no port in 1..65535"),
    ({"control": "tcp://0.0.0.0:5550"}, ["0.0.0.0"], "cannot be connected to"),
    ({"control": "tcp://224.0.0.251:5550"}, ["224.0.0.251"], "cannot be connected to"),
    ({"openvino": "2026 4"}, ["10.0.0.1"], "OpenVINO version"),
    ({"node": ""}, ["10.0.0.1"], "coordinator id"),
    ({"key": "AB" * 32}, ["10.0.0.1"], "64 lower-case hex digits"),
    ({"key": "ab" * 31}, ["10.0.0.1"], "64 lower-case hex digits"),
    ({"openvino": "x" * 201}, ["10.0.0.1"], "at most 200"),
])
def test_a_bad_announcement_is_refused_with_its_reason(changes, sources, reason):
    with pytest.raises(AnnouncementRefused, match=re.escape(reason)):
        parse_announcement(txt(**changes), sources, PROTO)


def test_non_ascii_values_are_refused():
    record = txt()
    record[b"cluster"] = b"l\xc3\xa4b"
    with pytest.raises(AnnouncementRefused, match="not ASCII"):
        parse_announcement(record, ["10.0.0.1"], PROTO)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([b"fmt", b"cluster", b"control", b"proto", b"openvino",
                                        b"node", b"key", b"x"]) | st.binary(max_size=8),
                       st.none() | st.binary(max_size=260), max_size=9),
       st.lists(st.text(max_size=20) | st.sampled_from(["10.0.0.1", "::1"]), max_size=3))
def test_fuzzed_records_are_read_or_refused_never_crash(properties, sources):
    try:
        found = parse_announcement(properties, sources, PROTO)
    except AnnouncementRefused as exc:
        assert str(exc)
    else:  # whatever passes is fit to act on
        assert control_endpoint(found.control)[0] in sources
        check_cluster_name(found.cluster)


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({k: st.text(max_size=70) for k in
                              ("fmt", "cluster", "control", "proto", "openvino", "node", "key")}))
def test_fuzzed_text_fields_are_read_or_refused(fields):
    base = announcement_txt(LAB)
    for key, value in fields.items():
        record = {k.encode(): v.encode() for k, v in {**base, key: value}.items()}
        try:
            parse_announcement(record, ["10.0.0.1"], PROTO)
        except AnnouncementRefused:
            pass


def test_cluster_names():
    assert check_cluster_name("pc-lab_2.home") == "pc-lab_2.home"
    for bad in ("", "-x", "a b", "x" * 64, "lab/1"):
        with pytest.raises(ValueError, match="1-63 letters"):
            check_cluster_name(bad)


def ann(name: str, host: str, key: str = "") -> Announcement:
    return Announcement(name, f"tcp://{host}:5550", PROTO, "2026.4.1", f"c-{host}", key)


def test_a_node_joins_the_only_cluster_or_the_one_named():
    a, b = ann("a", "10.0.0.1"), ann("b", "10.0.0.2")
    assert choose_cluster([a], None) == a
    assert choose_cluster([a, a], None) == a  # seen twice (two interfaces): one cluster
    assert choose_cluster([a, b], "b") == b
    with pytest.raises(ClusterChoiceError, match="2 clusters are announced; name one with "
                                                 "--cluster NAME:\n  a at .*\n  b at "):
        choose_cluster([b, a], None)
    with pytest.raises(ClusterChoiceError, match="no cluster is announced.*zctl node join tcp://"):
        choose_cluster([], None)
    with pytest.raises(ClusterChoiceError, match="no cluster named 'c'.*visible:\n  a at"):
        choose_cluster([a, b], "c")
    twin = ann("a", "10.0.0.3")
    with pytest.raises(ClusterChoiceError, match="2 coordinators announce a cluster named 'a'; "
                                                 "refusing to guess"):
        choose_cluster([a, twin, b], "a")


def test_a_node_holding_a_key_joins_only_the_cluster_announcing_it():
    secured = ann("s", "10.0.0.1", KEY)
    assert key_problem(secured, KEY) == "" and key_problem(ann("p", "10.0.0.1"), "") == ""
    assert "CURVE-secured (key abab:abab:abab:abab)" in key_problem(secured, "")
    assert "announces no CURVE key" in key_problem(ann("p", "10.0.0.1"), KEY)
    assert "not the coordinator key given (cdcd:" in key_problem(secured, "cd" * 32)
    assert short_fingerprint("0123456789abcdef" * 4) == "0123:4567:89ab:cdef"
