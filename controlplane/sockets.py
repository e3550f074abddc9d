"""The control plane's sockets, opened one way: ROUTER (coordinator, generation service)
and DEALER (node agents, clients), with no linger, a cap on inbound message size, and
CURVE when asked. Binding or connecting stays with the caller. A client that must know
when its peer is gone watches its DEALER with ``disconnect_monitor``."""

from __future__ import annotations

import zmq


def router_socket(ctx: zmq.Context, max_message_bytes: int, *, handover: bool = False,
                  send_hwm: int | None = None) -> zmq.Socket:
    """A ROUTER that fails on unknown peers instead of dropping silently; with ``handover``
    a restarted peer reclaims its routing id."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if handover:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if send_hwm is not None:
        sock.setsockopt(zmq.SNDHWM, send_hwm)
    return sock


PEER_HEARTBEAT_S = 1.0  # a client's ZMTP pings to its service
PEER_TIMEOUT_S = 5.0  # unanswered this long, the connection is dropped (a silent peer)


def dealer_socket(ctx: zmq.Context, max_message_bytes: int,
                  routing_id: bytes | None = None, *, ping: bool = False) -> zmq.Socket:
    """A DEALER (``routing_id``: the name the ROUTER knows it by). With ``ping`` it sends
    ZMTP heartbeats, so a peer whose machine went silent (no TCP reset) is dropped after
    PEER_TIMEOUT_S like one whose process died."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if ping:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(PEER_HEARTBEAT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PEER_TIMEOUT_S * 1000))
    return sock


def disconnect_monitor(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR that receives an event each time one of ``sock``'s established connections
    breaks (the peer's process ended, or its heartbeats stopped); read it with
    ``was_disconnected``. Connection attempts to a peer not yet up raise no event."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def was_disconnected(frames: list[bytes]) -> bool:
    """Whether a monitor message (two frames: event and value, then the endpoint) reports
    a broken connection."""
    from zmq.utils.monitor import parse_monitor_message

    return parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED
