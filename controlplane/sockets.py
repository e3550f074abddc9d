"""The control plane's sockets, opened one way: ROUTER (coordinator, generation service)
and DEALER (node agents, clients), with no linger, a cap on inbound message size, and
CURVE when asked. Binding or connecting stays with the caller."""

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


def dealer_socket(ctx: zmq.Context, max_message_bytes: int,
                  routing_id: bytes | None = None) -> zmq.Socket:
    """A DEALER (``routing_id``: the name the ROUTER knows it by)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    return sock
