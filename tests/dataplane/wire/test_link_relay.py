"""Relayed emulated links (dataplane.wire.link.path_free): a store-and-forward relay costs one more
serialisation of each frame plus its own delay, frames still pipeline through it, bad relay
counts are refused, and a local cluster takes one link shape per hop."""

from __future__ import annotations

import struct
import time

import pytest
import zmq

from dataplane.wire.link import DelayedSender, link_options, path_free
from dataplane.wire.transport import MAX_RELAYS, PipeOptions, bound_endpoint, pull_socket, recv_parts
from zctl.launcher.local import stage_links
from zctl.launcher.processes import LinkShape, link_shape
from zctl.launcher.record import ClusterError

STAMP = struct.Struct("<I")


def test_a_direct_link_serialises_one_frame_at_a_time():
    legs = path_free((0.0,), 10.0, 0.5, 0.0)
    assert legs == (10.5,)
    assert path_free(legs, 10.1, 0.5, 0.0) == (11.0,)  # waits for the link
    assert path_free(legs, 12.0, 0.5, 0.0) == (12.5,)  # the link was idle again


def test_a_relay_takes_the_whole_frame_in_then_sends_it_on_after_its_delay():
    legs = path_free((0.0, 0.0), 10.0, 0.5, 0.25)
    assert legs == (10.5, 11.25)  # in by 10.5, then 0.25 s of its own, then 0.5 s out
    two = path_free((0.0, 0.0, 0.0), 10.0, 0.5, 0.0)
    assert two == (10.5, 11.0, 11.5)


def test_frames_pipeline_through_a_relay():
    """Back to back, frame n+1 crosses the first leg while frame n crosses the second:
    the relay adds latency, not a halving of the throughput."""
    legs = (0.0, 0.0)
    ends = []
    for _ in range(4):
        legs = path_free(legs, 0.0, 1.0, 0.0)
        ends.append(legs[-1])
    assert ends == [2.0, 3.0, 4.0, 5.0]


def test_no_serialisation_without_a_rate_cap_only_the_relays_delay():
    assert path_free((0.0, 0.0), 3.0, 0.0, 0.125) == (3.0, 3.125)


@pytest.mark.parametrize("relays", [-1, MAX_RELAYS + 1, True, 1.5, "1"])
def test_bad_relay_counts_are_refused(relays):
    with pytest.raises(ValueError, match="relays"):
        PipeOptions(relays=relays)


def test_a_relay_alone_shapes_the_link_and_is_described():
    assert PipeOptions(relays=1).shaped and not PipeOptions().shaped
    shape = LinkShape(20.0, rate_mbit=20.0, relays=1, relay_delay_ms=2.0)
    assert shape.shaped and shape.pipe_options().relays == 1
    assert shape.pipe_options().relay_delay_ms == 2.0
    assert "1 store-and-forward relay (+2 ms each)" in shape.describe()
    assert "relay" not in LinkShape(20.0).describe()
    with pytest.raises(ClusterError, match="relay_delay_ms"):
        link_shape(relays=1, relay_delay_ms=-1)


def test_a_cluster_takes_one_link_shape_for_all_or_one_per_hop():
    one = link_shape(25)
    assert stage_links(3, one, None) == [one] * 3
    hops = [LinkShape(5.0), LinkShape(5.0, relays=1), LinkShape(7.0)]
    assert stage_links(3, LinkShape(), hops) == hops
    with pytest.raises(ClusterError, match="3 hops: links has 2"):
        stage_links(3, LinkShape(), hops[:2])
    with pytest.raises(ClusterError, match="not both"):
        stage_links(3, one, hops)
    with pytest.raises(ClusterError, match="hop 1"):
        stage_links(2, LinkShape(), [LinkShape(), LinkShape(rate_mbit=-3.0)])


def _arrival_s(relays: int, frames: int, body: bytes) -> float:
    """Seconds from the first send to the last frame's arrival over a capped link."""
    ctx = zmq.Context.instance()
    sock = pull_socket(ctx, "tcp://127.0.0.1:*")
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    link = DelayedSender(ctx, bound_endpoint(sock), link_options(rate_mbit=8.0, relays=relays))
    try:
        start = time.monotonic()
        for seq in range(frames):
            link.send_parts([STAMP.pack(seq), body])
        seqs = [STAMP.unpack(recv_parts(sock)[0])[0] for _ in range(frames)]
        took = time.monotonic() - start
    finally:
        link.close()
        sock.close(0)
    assert seqs == list(range(frames))
    return took


def test_a_relayed_link_delivers_one_frame_later_than_the_direct_one():
    """Three 40 ms frames at 8 Mbit/s: direct, the last is in after 3 serialisations;
    through one relay after 4 (the relay's second leg of the last frame)."""
    body = b"\0" * 40_000
    direct = _arrival_s(0, 3, body)
    relayed = _arrival_s(1, 3, body)
    assert 1.15 < relayed / direct < 1.6, (direct, relayed)
