"""What a client of the generation service is told when the service cannot serve it: it
does not answer, answered with an error, or went away (``ServiceUnavailable``, raised by
both clients)."""

from __future__ import annotations


class ServiceUnavailable(RuntimeError):
    """The generation service does not answer, answered with an error, or went away."""


def lost_service(endpoint: str, running: int) -> str:
    """What a client is told when its connection to the generation service breaks: the
    service's process ended (its coordinator stopped, crashed or restarted) or its machine
    went silent, and a service keeps no generation across a restart."""
    return (f"the generation service at {endpoint} went away (its coordinator stopped or "
            f"restarted, or its machine went silent): {running} generation(s) in flight "
            "lost; send them again once the cluster serves (zctl cluster status)")
