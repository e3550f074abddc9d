"""Process entry points: ``python -m controlplane coordinator|node|status|local|authorize``.

Thin argparse wrappers over the library (the ``zctl`` CLI may call the same
functions); each prints errors as one clear line and exits non-zero.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from controlplane.records import RuntimeSpec

err = Console(stderr=True)


def _runtime(args: argparse.Namespace) -> RuntimeSpec:
    precision = None if args.precision == "default" else args.precision
    kv = None if args.kv_cache_precision == "default" else args.kv_cache_precision
    return RuntimeSpec(device=args.device, precision=precision, num_threads=args.threads,
                       kv_cache_precision=kv,
                       dynamic_quantization=not args.no_dynamic_quantization)


def _launcher(args: argparse.Namespace, base: Any) -> Any:
    """``base`` (a launcher) with the emulated link shape of --link-* applied, or None."""
    if not (args.link_delay_ms or args.link_jitter_ms or args.link_rate_mbit):
        return None
    from dataplane.link import link_options

    try:
        options = link_options(args.link_delay_ms, args.link_jitter_ms, args.link_rate_mbit)
    except ValueError as exc:
        raise ValueError(f"bad --link-delay-ms/--link-jitter-ms/--link-rate-mbit: {exc}") \
            from None
    err.print(f"emulated link on outbound frames: {options.delay_ms:g} ms one-way"
              + (f" + 0..{options.jitter_ms:g} ms jitter" if options.jitter_ms else "")
              + (f", {options.rate_mbit:g} Mbit/s" if options.rate_mbit else ""))
    return functools.partial(base, options=options)


def _placement(pins: list[str]) -> dict[int, str]:
    out = {}
    for pin in pins:
        stage, sep, node_id = pin.partition("=")
        if not sep or not stage.isdigit() or not node_id:
            raise ValueError(f"bad --place {pin!r}: expected STAGE=NODE_ID, e.g. 1=pc2-1a2b3c4d")
        out[int(stage)] = node_id
    return out


def _confine(args: argparse.Namespace) -> None:
    """Apply --cpus before anything starts a thread or compiles a stage."""
    if args.cpus:
        from controlplane.cpusets import confine_to

        err.print(f"confined to CPUs {args.cpus}")
        confine_to(args.cpus)


def _row_groups(args: argparse.Namespace) -> int:
    """--row-groups, or one group per stage of the export."""
    if args.row_groups is None:
        from common.manifest import load_manifest

        return len(load_manifest(args.export_dir, verify_files=False).stages)
    if args.row_groups < 0:
        raise ValueError(f"--row-groups must be >= 0, not {args.row_groups}")
    return int(args.row_groups)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from controlplane.coordinator import Coordinator, CoordinatorConfig
    from controlplane.launch import head_launcher
    from controlplane.security import CurveServer, key_dir

    _confine(args)
    launcher = _launcher(args, head_launcher)
    state_dir = args.state_dir or _home() / "coordinator"
    curve = None
    if args.curve:
        curve = CurveServer.from_state_dir(state_dir, state_dir / "authorized")
        err.print(f"CURVE on: give nodes {key_dir(state_dir) / 'coordinator.key'}; admit a node "
                  f"with: zctl cluster authorize NODE.key (or python -m controlplane authorize "
                  f"NODE.key --state-dir {state_dir})")
    config = CoordinatorConfig(endpoint=args.bind, state_dir=state_dir, host=args.host,
                               data_port=args.data_port, heartbeat_interval=args.heartbeat,
                               liveness=args.liveness, expect_nodes=args.expect_nodes,
                               placement=_placement(args.place), runtime=_runtime(args),
                               reassign_after=args.reassign_after, curve=curve)
    coordinator = Coordinator(args.export_dir, config, launcher=launcher)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    err.print(f"coordinator {coordinator.node_id}: nodes join with "
              f"zctl node join {coordinator.bind()}")
    service = None
    if args.serve:
        from controlplane.service import GenerationService

        service = GenerationService(
            args.export_dir, lambda: getattr(coordinator.local_handle, "pipeline", None), args.serve,
            row_groups=_row_groups(args), shared_cores=args.shared_cores,
            health=coordinator.pipeline_problem, resume_timeout_s=args.resume_timeout)
        err.print(f"generation service on {service.start()}")
    try:
        coordinator.run()
    finally:
        if service is not None:
            service.stop()
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from console.view import TransferProgress
    from controlplane.agent import AgentConfig, NodeAgent
    from controlplane.launch import default_launcher
    from controlplane.security import CurveClient, key_dir, read_public_key

    _confine(args)
    launcher = _launcher(args, default_launcher)
    state_dir = args.state_dir or _home() / "node"
    curve = (CurveClient.from_state_dir(state_dir, read_public_key(args.curve_server_key))
             if args.curve_server_key else None)
    config = AgentConfig(args.coordinator, state_dir=state_dir, data_host=args.host,
                         data_port=args.data_port, heartbeat_interval=args.heartbeat,
                         reconnect_min=args.reconnect_min, reconnect_max=args.reconnect_max,
                         tok_s=args.tok_s, curve=curve)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with TransferProgress() as progress:
        agent = NodeAgent(config, launcher=launcher, on_progress=progress.update)
        err.print(f"node {agent.node_id} (data {agent.data_addr}) joining {args.coordinator}")
        if curve is not None:
            err.print(f"CURVE: this node's public key is {key_dir(state_dir) / 'node.key'}; "
                      "the coordinator must admit it (zctl cluster authorize NODE.key)")
        try:
            agent.run()
        except KeyboardInterrupt:
            pass
    if agent.refusal:
        err.print(f"[bold red]refused:[/] {agent.refusal}")
        return 2
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from console.view import status_table
    from controlplane.client import query_status
    from controlplane.security import CurveClient, read_public_key

    curve = None
    if args.curve_server_key:
        import zmq.auth

        public, secret = zmq.auth.load_certificate(args.curve_keys)
        curve = CurveClient(read_public_key(args.curve_server_key), public, secret or b"")
    status = query_status(args.endpoint, args.timeout, curve)
    if args.json:
        print(json.dumps(status.to_dict(), indent=2))
    else:
        Console().print(status_table(status))
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from console.view import status_table
    from controlplane.local import LocalCluster

    cluster = LocalCluster(args.export_dir, args.nodes, root=args.state_dir,
                           runtime=_runtime(args))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with cluster:
        status = cluster.start(args.timeout)
        Console().print(status_table(status))
        err.print(f"serving; status: python -m controlplane status {status.endpoint}; "
                  "Ctrl-C stops")
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


def cmd_authorize(args: argparse.Namespace) -> int:
    from controlplane.security import authorize

    state_dir = args.state_dir or _home() / "coordinator"
    target = authorize(state_dir / "authorized", args.name or args.key_file.stem, args.key_file)
    err.print(f"admitted {args.key_file} as {target} (a running coordinator picks it up)")
    return 0


def _home() -> Path:
    from common.paths import zctl_home

    return zctl_home()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m controlplane",
                                     description="zctl control plane processes.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    def runtime_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="CPU")
        p.add_argument("--precision", default="f32", help="'default' keeps the plugin's")
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--kv-cache-precision", default="default",
                       help="KV cache element type; 'default' keeps the plugin's (u8 on CPU); "
                            "f32 (with --no-dynamic-quantization) keeps speculative decoding "
                            "token-exact (a quantised cache can flip near-tied tokens between "
                            "a 1-token and a K+1-token step)")
        p.add_argument("--no-dynamic-quantization", action="store_true",
                       help="f32 activations: no dynamic int8 quantization of matmul inputs "
                            "(the CPU plugin's default on AVX-512-VNNI/AMX CPUs, which can "
                            "flip near-tied tokens between a 1-token and a K+1-token step)")

    def process_args(p: argparse.ArgumentParser) -> None:
        """This process's emulated outbound link and CPU set."""
        p.add_argument("--link-delay-ms", type=float, default=0.0,
                       help="emulated one-way latency on every data frame this process "
                            "sends on (WAN tests; 0: none)")
        p.add_argument("--link-jitter-ms", type=float, default=0.0,
                       help="plus uniform random 0..J ms per frame (order is kept)")
        p.add_argument("--link-rate-mbit", type=float, default=0.0,
                       help="emulated bandwidth cap in Mbit/s (0: none)")
        p.add_argument("--cpus", default=None,
                       help="run on these CPUs only, e.g. 0-3 (nodes sharing a machine)")

    p = sub.add_parser("coordinator", help="serve an export; runs stage 0 here")
    p.add_argument("export_dir", type=Path)
    p.add_argument("--bind", default="tcp://*:5550")
    p.add_argument("--host", default=None, help="address nodes reach this machine at")
    p.add_argument("--data-port", type=int, default=0)
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--liveness", type=int, default=3)
    p.add_argument("--expect-nodes", type=int, default=None)
    p.add_argument("--place", action="append", default=[], help="STAGE=NODE_ID (repeatable)")
    p.add_argument("--reassign-after", type=float, default=None,
                   help="give a dead node's stage to a spare after this many seconds")
    p.add_argument("--resume-timeout", type=float, default=120.0,
                   help="generations pause while a stage's node is down and resume (replaying "
                        "their tokens) when it is back or a spare took its stage; after this "
                        "many seconds they end with an error (0: at once)")
    p.add_argument("--curve", action="store_true", help="CURVE: admit only authorized nodes")
    p.add_argument("--serve", default=None,
                   help="bind the generation service here (what zctl run talks to)")
    p.add_argument("--row-groups", type=int, default=None,
                   help="batch the one-token decode steps of concurrent streams into this many "
                        "row groups (one inference per stage per group); 0: every stream "
                        "steps alone; default: one per stage (every stage busy)")
    p.add_argument("--shared-cores", action="store_true",
                   help="the stages share this machine's cores (a local cluster): weigh their "
                        "compute together when deciding whether concurrent streams draft")
    runtime_args(p)
    process_args(p)
    p.set_defaults(fn=cmd_coordinator)

    p = sub.add_parser("node", help="join a coordinator and serve the stage it assigns")
    p.add_argument("--coordinator", required=True, help="e.g. tcp://10.0.0.1:5550")
    p.add_argument("--host", default=None, help="address other nodes reach this one at")
    p.add_argument("--data-port", type=int, default=0)
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--reconnect-min", type=float, default=1.0)
    p.add_argument("--reconnect-max", type=float, default=32.0)
    p.add_argument("--tok-s", type=float, default=None, help="measured speed, for placement")
    p.add_argument("--curve-server-key", type=Path, default=None,
                   help="the coordinator's public key file (turns CURVE on)")
    process_args(p)
    p.set_defaults(fn=cmd_node)

    p = sub.add_parser("status", help="ask a coordinator for its status")
    p.add_argument("endpoint")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--curve-server-key", type=Path, default=None)
    p.add_argument("--curve-keys", type=Path, default=None, help="this client's .key_secret")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("local", help="coordinator and N-1 nodes in this process (loopback)")
    p.add_argument("export_dir", type=Path)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    runtime_args(p)
    p.set_defaults(fn=cmd_local)

    p = sub.add_parser("authorize", help="admit a node's CURVE public key")
    p.add_argument("key_file", type=Path)
    p.add_argument("--name", default=None)
    p.add_argument("--state-dir", type=Path, default=None)
    p.set_defaults(fn=cmd_authorize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    if args.command == "status" and args.curve_server_key and not args.curve_keys:
        err.print("[bold red]error:[/] --curve-server-key needs --curve-keys (a .key_secret)")
        return 1
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, RuntimeError) as exc:
        err.print(f"[bold red]error:[/] {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
