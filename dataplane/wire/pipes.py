"""A hop's pipes: the outbound PUSH (or a ``DelayedSender`` when the link is shaped) and
the inbound PULL, opened together. Sockets come from ``dataplane.wire.transport``, the emulated
link from ``dataplane.wire.link``."""

from __future__ import annotations

from typing import Any

import zmq

from dataplane.wire.link import DelayedSender
from dataplane.wire.transport import DEFAULT_OPTIONS, PipeOptions, pull_socket, push_socket


def open_push(ctx: zmq.Context, connect_addr: str, options: PipeOptions = DEFAULT_OPTIONS
              ) -> Any:
    """The outbound pipe: a PUSH socket, or a DelayedSender when ``options`` shape the link.

    Both take ``send_parts(pipe, parts)`` and ``pipe.close(linger)``.
    """
    if not options.shaped:
        return push_socket(ctx, connect_addr, options)
    return DelayedSender(ctx, connect_addr, options)


def open_pipes(ctx: zmq.Context, bind_addr: str, send_to: str,
               options: PipeOptions = DEFAULT_OPTIONS) -> tuple[zmq.Socket, Any]:
    """A hop's two ends on one process: the inbound PULL bound at ``bind_addr`` and the
    outbound pipe to ``send_to`` (``open_push``); the PULL is closed again when the
    outbound pipe cannot be opened."""
    pull = pull_socket(ctx, bind_addr, options)
    try:
        return pull, open_push(ctx, send_to, options)
    except BaseException:
        pull.close(0)
        raise
