"""``zctl cluster pair`` (the coordinator's side) and ``zctl node join --pair CODE``'s
exchange (the node's): CURVE keys traded over a channel authenticated by a one-time code
(controlplane.pairing), so no key file is copied by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
out = Console()
PAIRED_KEY = "coordinator.key"  # in a node's <state_dir>/curve/: the key pairing received

PairPort = Annotated[int, typer.Option(
    help="the port zctl cluster pair listens on, on the coordinator's machine", min=1,
    max=65535)]


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(1)


def paired_key_file(state_dir: Path) -> Path:
    """Where a node keeps the coordinator key that pairing gave it."""
    from controlplane.security import key_dir

    return key_dir(state_dir) / PAIRED_KEY


def cluster_pair(
    minutes: Annotated[float, typer.Option(help="how long the code is valid", min=0.1,
                                           max=60.0)] = 5.0,
    port: PairPort = 5549,
) -> None:
    """Show a one-time code that admits one node to this machine's --curve cluster: on the
    node, zctl node join --pair CODE. Waits until a node pairs (then shows its key's
    fingerprint), the code expires, or wrong codes spend it."""

    from controlplane.pairing import PairingDesk, PairingError, new_code
    from controlplane.security import (
        SecurityError,
        key_dir,
        key_fingerprint,
        load_or_create_keypair,
        write_public_key,
    )
    from zctl.discovery.records import short_fingerprint
    from zctl.launcher.record import read_record

    record = read_record()
    if record is None or not record.curve_dir:
        _fail("no --curve cluster is up here (zctl cluster up --curve)")
    state = Path(record.curve_dir)
    try:
        public, _ = load_or_create_keypair(key_dir(state), "coordinator")
    except SecurityError as exc:
        _fail(str(exc))

    def admit(paired) -> None:  # noqa: ANN001 - a controlplane.pairing.Paired
        label = f"paired-{paired.node_id or paired.fingerprint[:12]}"
        label = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in label)
        # admitted as cluster authorize admits a key file: into the authorized keys
        write_public_key(state / "authorized" / f"{label}.key", paired.public,
                         f"paired {paired.node_id}")

    code = new_code()
    desk = PairingDesk(f"tcp://*:{port}", code, public, admit, valid_s=minutes * 60)
    try:
        desk.bind()
    except PairingError as exc:
        _fail(str(exc))
    out.print(f"pairing code: [bold]{code}[/] (valid {minutes:g} min, once; port {port})")
    out.print(f"this coordinator's key: {short_fingerprint(key_fingerprint(public))}; on the "
              f"node run: zctl node join --pair {code}", highlight=False)
    try:
        paired = desk.serve()
    except PairingError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        desk.close()
        _fail("pairing stopped; the code is spent")
    out.print(f"paired node {escape(paired.node_id or '?')}: its key "
              f"{short_fingerprint(paired.fingerprint)} is admitted", highlight=False)


def pair_node(code: str, control: str, port: int, state_dir: Path, node_id: str,
              announced_fingerprint: str) -> Path:
    """Pair this node (its key pair in ``state_dir``) with the coordinator at ``control``
    by ``code``; the coordinator key file it received. ValueError says why not: the code,
    the desk, or a key other than the one the cluster announces."""
    from controlplane.pairing import PairingError, pair
    from controlplane.security import (
        SecurityError,
        key_dir,
        key_fingerprint,
        load_or_create_keypair,
        write_public_key,
    )
    from zctl.discovery.records import short_fingerprint
    from zctl.endpoints import split_address, tcp_address

    try:
        public, _ = load_or_create_keypair(key_dir(state_dir), "node")
        paired = pair(tcp_address(split_address(control)[0], port), code, public, node_id)
    except (PairingError, SecurityError) as exc:
        raise ValueError(f"pairing failed: {exc}") from None
    if announced_fingerprint and paired.fingerprint != announced_fingerprint:
        raise ValueError(f"pairing gave the key {short_fingerprint(paired.fingerprint)} but the "
                         f"cluster announces {short_fingerprint(announced_fingerprint)}: not "
                         "joining")
    target = write_public_key(paired_key_file(state_dir), paired.public, "received by pairing")
    err.print(f"paired: the coordinator's key is {short_fingerprint(paired.fingerprint)}; this "
              f"node's is {short_fingerprint(key_fingerprint(public))}", highlight=False)
    return target
