"""``zctl cluster ls`` and the cluster ``zctl node join`` finds when given no address."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zctl.discovery.records import Announcement

err = Console(stderr=True)
out = Console()

BrowseSeconds = Annotated[float, typer.Option(
    "--browse-seconds", help="how long to listen for announcements", min=0.2, max=60.0)]


def find_cluster(cluster: str | None, seconds: float) -> Announcement:
    """The announced cluster a node with no address joins (``cluster`` by name, else the only
    one); ValueError saying why there is none to join."""
    from controlplane.messages import PROTOCOL_VERSION
    from zctl.discovery.browser import browse
    from zctl.discovery.records import JOIN_BY_ADDRESS, choose_cluster, listing

    try:
        sightings = browse(PROTOCOL_VERSION, seconds)
    except OSError as exc:
        raise ValueError(f"cannot listen for announcements ({exc}); {JOIN_BY_ADDRESS}"
                         ) from None
    for name, reason in sightings.refused.items():
        err.print(f"[yellow]ignored[/] {escape(name)}: {escape(reason)}", soft_wrap=True,
                  highlight=False)
    names = sorted({a.cluster for a in sightings.announcements})
    if cluster is None and len(names) > 1 and sys.stdin.isatty():  # ask, at a terminal
        err.print(f"clusters announced:\n{listing(sightings.announcements)}", highlight=False)
        cluster = typer.prompt(f"join which cluster ({', '.join(names)})", err=True)
    found = choose_cluster(sightings.announcements, cluster)
    err.print(f"found {found.describe()}", soft_wrap=True, highlight=False)
    return found


def server_key_for(found: Announcement, given: Path | None, paired: Path) -> Path | None:
    """The coordinator key file a node joining ``found`` uses: the one ``given``, else the
    one an earlier pairing left (``paired``) if it is the key the cluster announces;
    ValueError when the node's key and the announcement disagree (key_problem)."""
    from zctl.discovery.records import key_problem

    key = given
    if key is None and found.curve and paired.is_file() and \
            key_file_fingerprint(paired) == found.fingerprint:
        key = paired
    problem = key_problem(found, key_file_fingerprint(key))
    if problem:
        raise ValueError(problem + ("" if key else "; or pair: zctl cluster pair on the "
                                    "coordinator, then zctl node join --pair CODE"))
    return key


def key_file_fingerprint(key_file: Path | None) -> str:
    """The fingerprint of a coordinator key file ("": no file); ValueError if unreadable."""
    from controlplane.security import SecurityError, key_fingerprint, read_public_key

    if key_file is None:
        return ""
    try:
        return key_fingerprint(read_public_key(key_file))
    except SecurityError as exc:
        raise ValueError(str(exc)) from None


def cluster_ls(seconds: BrowseSeconds = 2.0,
               show_refused: Annotated[bool, typer.Option(
                   "--refused/--no-refused", help="also list announcements refused, and why")
               ] = True) -> None:
    """The clusters announced on this LAN (DNS-SD over multicast DNS)."""
    from controlplane.messages import PROTOCOL_VERSION
    from zctl.discovery.browser import browse
    from zctl.discovery.records import short_fingerprint

    try:
        sightings = browse(PROTOCOL_VERSION, seconds)
    except OSError as exc:
        err.print(f"[bold red]error:[/] cannot listen for announcements: {escape(str(exc))}")
        raise typer.Exit(1) from None
    if not sightings.announcements:
        out.print("no cluster is announced on this LAN (zctl doctor checks multicast)")
    else:
        table = Table("cluster", "control", "protocol", "OpenVINO", "CURVE key", "coordinator")
        for a in sorted(sightings.announcements, key=lambda a: (a.cluster, a.control)):
            table.add_row(a.cluster, a.control, str(a.protocol), a.openvino,
                          short_fingerprint(a.fingerprint) if a.curve else "off",
                          a.coordinator_id)
        out.print(table)
    if show_refused:
        for name, reason in sorted(sightings.refused.items()):
            out.print(f"refused {escape(name)}: {escape(reason)}", soft_wrap=True,
                      highlight=False)
