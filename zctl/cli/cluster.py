"""``zctl cluster up|down|status|authorize`` and ``zctl node join`` (``zctl run``: zctl.cli.run;
``zctl cluster ls`` and finding a cluster to join: zctl.cli.discovery)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer
from rich.console import Console
from rich.markup import escape

from controlplane.planner.search import objective_problem
from controlplane.records import DEFAULT_REPLAN_GAIN, HEARTBEAT_S, LIVENESS
from zctl.cli.discovery import BrowseSeconds, find_cluster, server_key_for
from zctl.cli.exports import (
    AUTO,
    WEIGHTS_HELP,
    ensure_export,
    fleet_export_ranges,
    is_export,
    local_export_ranges,
)
from zctl.cli.pairing import PairPort, pair_node, paired_key_file
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.api import cors_origin, parse_api, start_api
from zctl.launcher.local import start_coordinator, start_local_cluster, stop_processes, wait_serving
from zctl.launcher.processes import CoordinatorProcess, link_shape, placement_of, runtime_spec
from zctl.launcher.record import ClusterError, ClusterRecord, cluster_file, read_record, write_record
from zctl.serve.tls import ApiTls, api_tls

cluster_app = typer.Typer(help="Start, inspect and stop a cluster.", no_args_is_help=True)
node_app = typer.Typer(help="Run this machine as a node of a cluster.", no_args_is_help=True)
err = Console(stderr=True)
out = Console()

Precision = Annotated[str, typer.Option(help="INFERENCE_PRECISION_HINT, or 'default'")]
Exact = Annotated[bool | None, typer.Option(
    "--exact/--fast",
    help="exact: an f32 KV cache and f32 activations; fast: the CPU plugin's defaults (a u8 "
         "KV cache and, on AVX-512-VNNI/AMX CPUs, int8 activations: 1.1-1.4x faster "
         "decoding). On paged stages (the default on CPUs) greedy output is repeatable "
         "under both: cached or not, batched or not, speculative or not; stateful stages "
         "need exact for that. Default: fast", show_default=False)]
KvPrecision = Annotated[str | None, typer.Option(
    help="KV cache element type (f32, f16, bf16, u8, u4, or 'default': the plugin's); "
         "default: as --exact/--fast say", show_default=False)]
PagedAttention = Annotated[bool, typer.Option(
    "--paged-attention/--stateful-attention",
    help="KV in blocks on PagedAttention (fast prompt chunks over a long past, row groups "
         "without copies, shared prefixes), or each stream's KV as OpenVINO state (CPU: paged)")]
DynamicQuantization = Annotated[bool | None, typer.Option(
    "--dynamic-quantization/--no-dynamic-quantization",
    help="int8 activations for compressed matmuls where the CPU supports them; default: as "
         "--exact/--fast say", show_default=False)]


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def _running_record() -> ClusterRecord | None:
    """The cluster in cluster.json if its coordinator runs. A file whose coordinator
    exited is removed, and the processes it started with it (local nodes, the API) are
    stopped, so that the next cluster up starts afresh on their state dirs (the nodes'
    cached shards are kept; nodes that joined from other machines enrol again by
    themselves with a coordinator started again on the same address)."""
    from zctl.launcher.local import stop_processes
    from zctl.launcher.record import alive, zctl_process

    record = read_record()
    if record is None:
        return None
    if not record.pids or not alive(record.pids[0]):
        leftovers = [pid for pid in record.pids[1:] if alive(pid) and zctl_process(pid)]
        if leftovers:
            err.print(f"[yellow]note:[/] the coordinator in {cluster_file()} had exited: "
                      f"stopping the {len(leftovers)} process(es) it started with it",
                      soft_wrap=True)
            stop_processes(leftovers)
        cluster_file().unlink(missing_ok=True)  # a stale file from a cluster that died
        return None
    return record


Link = Annotated[float, typer.Option(
    help="emulated one-way latency in ms on every data frame this cluster's processes send "
         "(WAN experiments; 0: none)")]
LinkJitter = Annotated[float, typer.Option(help="plus uniform random 0..J ms per frame")]
LinkRate = Annotated[float, typer.Option(help="emulated bandwidth cap in Mbit/s (0: none)")]
Heartbeat = Annotated[float, typer.Option(help="seconds between heartbeats (until the "
                                               "coordinator's welcome sets a node's)")]

CpuSets = Annotated[str, typer.Option(
    help="with --local: shared (every stage may use every core: lowest one-stream "
         "latency) | split (each node its own cores, like separate PCs: stages "
         "compute different streams at once)")]
RowGroups = Annotated[int | None, typer.Option(
    help="batch concurrent streams' decode steps into this many row groups (one "
         "inference per stage per group); 0: each stream steps alone; default: 1 "
         "for a --local cluster with shared CPUs, else one per stage")]
ReassignAfter = Annotated[float | None, typer.Option(
    help="give a dead node's stage to an idle spare node after this many seconds "
         "(default: wait for the node to come back)")]
Heal = Annotated[bool, typer.Option(
    help="when a node is lost and no spare can take its stages, its neighbours in the "
         "chain take them (memory permitting) and generations resume; --no-heal waits "
         "for the node or a spare")]
HealAfter = Annotated[float, typer.Option(
    help="seconds a node may be down before its stages go to the survivors")]
ResumeTimeout = Annotated[float, typer.Option(
    help="generations pause while a stage's node is down and resume where they were "
         "once it is back or a spare took over; after this many seconds they end with "
         "an error (0: at once)")]
Curve = Annotated[bool, typer.Option(
    "--curve", help="CURVE: encrypt and authenticate the control and data pipes; only "
                    "nodes admitted with zctl cluster authorize may join (a --local "
                    "cluster admits its own nodes)")]
MaxStreams = Annotated[int, typer.Option(
    help="generations at once (each its own KV on every stage; more wait their turn)")]
KvMemory = Annotated[int, typer.Option(
    "--kv-memory-mb", help="KV memory a stage may hold for running streams and cached "
    "prefixes; a request that does not fit waits, one that never can is refused")]
PrefixCacheMb = Annotated[int, typer.Option(
    "--prefix-cache-mb", help="of --kv-memory-mb, how much may keep finished streams' KV for "
    "prompts that start the same way (0: no prefix cache)")]
ExpectNodes = Annotated[int, typer.Option(
    help="nodes to wait for before placing the stages (0: place them at once on the nodes "
         "there are, this machine alone if need be; nodes that join later take stages over)")]
MemoryMb = Annotated[int, typer.Option(
    "--memory-mb", help="RAM this machine lends its stages, in MB (0: what is free)")]
ReplanGain = Annotated[float, typer.Option(
    help="while serving, re-place the stages by the planner when a node joins (or leaves, "
         "or profiles and links change) and the new placement is predicted this much "
         "faster (0.10: 10%)")]
Place = Annotated[list[str] | None, typer.Option(
    help="pin a stage to a node: STAGE=NODE_ID (repeatable)")]
Profile = Annotated[bool | None, typer.Option(
    "--profile/--no-profile",
    help="measure each machine's profile for the model the first time it serves it (zctl "
         "node profile; kept in its state directory, shown by zctl cluster status); default: "
         "on, except for --local clusters, whose processes share this machine",
    show_default=False)]


@cluster_app.command("up")
def cluster_up(
    local: Annotated[int | None, typer.Option(
        help="N: a local cluster of N processes on this machine (1: this process runs every "
             "stage; more: the coordinator and N-1 nodes on 127.0.0.2..)")] = None,
    model: Annotated[str, typer.Option(help="model name/path or an export directory")] = "smollm2-135m",
    stages: Annotated[int | None, typer.Option(
        help="stages of the export made for a model name (default: --local N, else 2)")] = None,
    weights: Annotated[str, typer.Option(help=WEIGHTS_HELP)] = AUTO,
    exact_experts: Annotated[bool, typer.Option(
        "--exact-experts", help="export a mixture of experts with its MXFP4 experts kept "
                                "exactly (zctl export --exact-experts), and place it so")
    ] = False,
    fleet: Annotated[Path | None, typer.Option(
        help="a TOML file of the PCs that will join (examples/fleets/): the model is exported "
             "in the stages of the planner's best placement on them (zctl plan --fleet); "
             "without --local or --stages")] = None,
    bind: Annotated[str, typer.Option(help="control address (without --local)")] = "0.0.0.0:5550",
    host: Annotated[str | None, typer.Option(help="address nodes reach the coordinator at")] = None,
    precision: Precision = "f32",
    exact: Exact = None,
    kv_cache_precision: KvPrecision = None,
    dynamic_quantization: DynamicQuantization = None,
    paged_attention: PagedAttention = True,
    threads: Annotated[int | None, typer.Option(help="INFERENCE_NUM_THREADS per stage")] = None,
    device: Annotated[str, typer.Option(help="CPU | GPU | NPU | AUTO")] = "CPU",
    timeout: Annotated[float, typer.Option(help="seconds to wait for the pipeline")] = 300.0,
    cpu_sets: CpuSets = "shared",
    row_groups: RowGroups = None,
    foreground: Annotated[bool, typer.Option(help="run the coordinator in this process "
                                                  "(containers, service managers)")] = False,
    reassign_after: ReassignAfter = None,
    heal: Heal = True,
    heal_after: HealAfter = 0.0,
    resume_timeout: ResumeTimeout = 120.0,
    curve: Curve = False,
    expect_nodes: ExpectNodes = 0,
    place: Place = None,
    memory_mb: MemoryMb = 0,
    link_delay_ms: Link = 0.0,
    link_jitter_ms: LinkJitter = 0.0,
    link_rate_mbit: LinkRate = 0.0,
    heartbeat: Heartbeat = HEARTBEAT_S,
    liveness: Annotated[int, typer.Option(help="heartbeats a node may miss before it is "
                                               "marked dead")] = LIVENESS,
    api: Annotated[str | None, typer.Option(
        help="also serve the OpenAI API at HOST:PORT (zctl serve; its key from ZCTL_API_KEY)")
    ] = None,
    api_cors_origins: Annotated[list[str] | None, typer.Option(
        "--api-cors-origin", help="a web origin whose pages may call that API from a browser "
                                  "(scheme://host[:port], or '*'); repeat for more")] = None,
    api_ssl_certfile: Annotated[Path | None, typer.Option(
        help="serve that API over HTTPS with this PEM certificate")] = None,
    api_ssl_keyfile: Annotated[Path | None, typer.Option(
        help="the certificate's PEM private key")] = None,
    max_streams: MaxStreams = DEFAULT_MAX_STREAMS,
    kv_memory_mb: KvMemory = 2048,
    prefix_cache_mb: PrefixCacheMb = 512,
    profile: Profile = None,
    replan_gain: ReplanGain = DEFAULT_REPLAN_GAIN,
    objective: Annotated[str, typer.Option(
        help="what the planner places the stages for: latency (one stream's tok/s) or "
             "throughput (--max-streams streams' aggregate tok/s, with KV reserved for "
             "them)")] = "latency",
    announce: Annotated[bool, typer.Option(
        "--announce/--no-announce",
        help="announce the cluster on the LAN (DNS-SD over multicast DNS) so nodes join "
             "with no address (without --local)")] = True,
    cluster_name: Annotated[str | None, typer.Option(
        help="the announced name nodes join by (default: this machine's host name)")] = None,
    announce_interfaces: Annotated[list[str] | None, typer.Option(
        "--announce-interface", help="announce on this interface only (repeat for more; "
                                     "default: those carrying --bind, never container "
                                     "bridges or loopback)")] = None,
    announce_loopback: Annotated[bool, typer.Option(
        help="with --bind 0.0.0.0: announce on loopback too")] = False,
) -> None:
    """Start the coordinator (and with --local N, N-1 node processes on 127.0.0.2...) in the
    background. It serves as soon as the stages fit the machines there are (this one alone
    if need be); machines that join later take stages over."""
    if _running_record() is not None:
        _fail(f"a cluster is already up ({cluster_file()}); zctl cluster down first")
    stage_count = stages or local or 2
    problem = (_up_problem(local, stage_count, row_groups, cpu_sets, foreground, resume_timeout,
                           reassign_after, heal_after, expect_nodes, memory_mb, replan_gain)
               or _fleet_problem(fleet, local, stages, model)
               or objective_problem(objective)
               or max_streams_problem(max_streams) or kv_problem(kv_memory_mb, prefix_cache_mb))
    if problem:
        _fail(problem)
    try:
        if cluster_name is not None:
            from zctl.discovery.records import check_cluster_name

            check_cluster_name(cluster_name)
        if announce and local is None and announce_interfaces:
            _check_announce_interfaces(bind, announce_interfaces)
        api_opts = api_options(api, api_cors_origins, api_ssl_certfile, api_ssl_keyfile)
        kv, dq = numerics(exact, kv_cache_precision, dynamic_quantization)
        runtime = runtime_spec(None if precision == "default" else precision, threads, device,
                               kv, dq, paged_attention)
        link = link_shape(link_delay_ms, link_jitter_ms, link_rate_mbit)
        placement = placement_of(place or [])  # (checked before anything is exported)
        ranges = None
        if local is not None and local > 1 and stages is None and not is_export(model):
            ranges, source = local_export_ranges(model, local, weights, device, memory_mb,
                                                 exact_experts)
            err.print(f"stages: {source}", soft_wrap=True)
        if fleet is not None:
            ranges, source = fleet_export_ranges(model, fleet, weights, objective,
                                                 max_streams, exact_experts)
            err.print(f"stages: {source}", soft_wrap=True)
        stage_count = len(ranges) if ranges is not None else stage_count
        export_dir = ensure_export(model, stage_count, weights, ranges, exact_experts)
        coordinator = CoordinatorProcess(
            str(export_dir), bind=f"tcp://{bind}", host=host, heartbeat=heartbeat,
            liveness=liveness, expect_nodes=expect_nodes, placement=placement,
            reassign_after=reassign_after, heal_after=heal_after if heal else None,
            resume_timeout=resume_timeout, curve=curve,
            row_groups=row_groups, max_streams=max_streams, kv_memory_mb=kv_memory_mb,
            prefix_cache_mb=prefix_cache_mb, runtime=runtime, link=link, memory_mb=memory_mb,
            profile=local is None if profile is None else profile, replan_gain=replan_gain,
            objective=objective,
            announce=announce and local is None, cluster_name=cluster_name or "",
            announce_interfaces=announce_interfaces or [], announce_loopback=announce_loopback)
        if foreground:
            raise typer.Exit(_serve_foreground(coordinator))
        if local is None:
            record = _start_remote_coordinator(coordinator)
            write_record(record)
            if api_opts is not None:
                write_record(record := api_opts.start(record))
                out.print(f"OpenAI API at {record.api}/v1, the web page at {record.api}/")
            _print_join(record, curve, coordinator.announced_name if coordinator.announce else "")
            return
        record, status = _up_local(coordinator, local, cpu_sets, timeout, api_opts)
    except (ClusterError, ValueError, OSError) as exc:
        rec = read_record() if cluster_file().is_file() else None
        if rec is not None:
            stop_processes(rec.pids)
            cluster_file().unlink(missing_ok=True)
        _fail(str(exc))
    from zctl.cli.view import status_table

    out.print(status_table(status))
    served = (f"; the OpenAI API at {record.api}/v1, the web page at {record.api}/"
              if record.api else "")
    out.print(f"serving {status.model} on {len(status.stages)} stages{served}; zctl run "
              "\"...\"; zctl cluster down stops it")


class ApiOptions(NamedTuple):
    """``cluster up --api``: where zctl serve listens, the origins it lets call it, its TLS."""

    address: str
    cors_origins: tuple[str, ...]
    tls: ApiTls | None

    def start(self, record: ClusterRecord) -> ClusterRecord:
        return start_api(record, self.address, cors_origins=self.cors_origins, tls=self.tls)


def api_options(api: str | None, origins: list[str] | None, certfile: Path | None,
                keyfile: Path | None) -> ApiOptions | None:
    """The API's options, checked before anything is exported (None: no API)."""
    cors = tuple(cors_origin(o, "--api-cors-origin") for o in origins or ())
    tls = api_tls(certfile, keyfile, "--api-ssl-certfile and --api-ssl-keyfile")
    if not api:
        if cors or tls:
            raise ValueError(f"--api-{'cors-origin' if cors else 'ssl-*'} needs --api HOST:PORT")
        return None
    parse_api(api)
    return ApiOptions(api, cors, tls)


def _up_local(coordinator: CoordinatorProcess, nodes: int, cpu_sets: str, timeout: float,
              api: ApiOptions | None) -> tuple[ClusterRecord, Any]:
    """Start a local cluster of ``nodes`` with the coordinator's settings, wait until it
    serves (and start the API); its record and status."""
    c, link = coordinator, coordinator.link
    record = start_local_cluster(
        Path(c.export_dir), nodes, c.runtime, link_delay_ms=link.delay_ms,
        link_jitter_ms=link.jitter_ms, link_rate_mbit=link.rate_mbit, cpu_sets=cpu_sets,
        row_groups=c.row_groups, curve=c.curve, resume_timeout=c.resume_timeout,
        reassign_after=c.reassign_after, heal_after=c.heal_after, max_streams=c.max_streams,
        kv_memory_mb=c.kv_memory_mb, prefix_cache_mb=c.prefix_cache_mb,
        memory_mb=c.memory_mb, profile=c.profile, replan_gain=c.replan_gain,
        objective=c.objective)
    write_record(record)
    status = wait_serving(record, timeout)
    if api is not None:
        write_record(record := api.start(record))
    return record, status


MAX_STREAMS_LIMIT = 256


def kv_problem(kv_memory_mb: int, prefix_cache_mb: int) -> str:
    """Why ``--kv-memory-mb``/``--prefix-cache-mb`` cannot be used ("" when they can)."""
    if kv_memory_mb < 1:
        return f"--kv-memory-mb must be at least 1, not {kv_memory_mb}"
    if not 0 <= prefix_cache_mb <= kv_memory_mb:
        return (f"--prefix-cache-mb must be in 0..--kv-memory-mb ({kv_memory_mb}), not "
                f"{prefix_cache_mb}")
    return ""


def max_streams_problem(max_streams: int) -> str:
    """Why ``--max-streams`` cannot be used ("" when it can)."""
    if not 1 <= max_streams <= MAX_STREAMS_LIMIT:
        return f"--max-streams must be in 1..{MAX_STREAMS_LIMIT}, not {max_streams}"
    return ""


def _up_problem(local: int | None, stages: int, row_groups: int | None, cpu_sets: str,
                foreground: bool, resume_timeout: float, reassign_after: float | None,
                heal_after: float = 0.0, expect_nodes: int = 0, memory_mb: int = 0,
                replan_gain: float = DEFAULT_REPLAN_GAIN) -> str:
    """Why these ``zctl cluster up`` options cannot go together ("" when they can), found
    before anything is exported or started."""
    if local is not None and local < 1:
        return f"--local takes the number of processes, at least 1 (this one), not {local}"
    if stages < 1:
        return f"--stages must be at least 1, not {stages}"
    if local is not None and expect_nodes:
        return "--local N waits for its own N-1 nodes: drop --expect-nodes"
    if expect_nodes < 0 or memory_mb < 0:
        return "--expect-nodes and --memory-mb must be >= 0"
    if row_groups is not None and row_groups < 0:
        return f"--row-groups must be >= 0, not {row_groups}"
    if local is None and cpu_sets != "shared":
        return "--cpu-sets applies to --local clusters; a node sets its own with zctl node join --cpus"
    if foreground and local is not None:
        return "--foreground runs only the coordinator; start nodes with zctl node join"
    if resume_timeout < 0 or heal_after < 0 or (reassign_after is not None and reassign_after < 0):
        return "--resume-timeout, --heal-after and --reassign-after must be >= 0 seconds"
    if not 0 <= replan_gain <= 10:
        return f"--replan-gain is a fraction (0.10: a re-plan predicted 10% faster), not {replan_gain}"
    return ""


def _fleet_problem(fleet: Path | None, local: int | None, stages: int | None,
                   model: str) -> str:
    """Why ``--fleet`` cannot go with the other options ("" when it can)."""
    if fleet is None:
        return ""
    if local is not None:
        return "--local N plans for this machine's N processes: drop --fleet"
    if stages is not None:
        return "--fleet lets the planner choose the stages: drop --stages"
    if is_export(model):
        return f"{model} is an export, whose stages are made: --fleet plans a model's"
    if not fleet.is_file():
        return f"--fleet {fleet}: no such file"
    return ""


def _start_remote_coordinator(coordinator: CoordinatorProcess) -> ClusterRecord:
    """The coordinator of a cluster of other machines, in the background; nodes reach it at
    ``--host`` (default: this machine's address when it binds every interface)."""
    import socket

    from zctl.paths import zctl_home

    bind_host = coordinator.bind_host
    public = coordinator.host or (socket.gethostbyname(socket.gethostname())
                                  if bind_host in ("0.0.0.0", "*", "") else bind_host)
    root = zctl_home() / "cluster"
    if coordinator.curve:  # made now so its public key can be shown (the coordinator reuses it)
        from controlplane.security import key_dir, load_or_create_keypair

        load_or_create_keypair(key_dir(root / "coordinator"), "coordinator")
    record = start_coordinator(replace(coordinator, host=public), root)
    record.curve_dir = str(root / "coordinator") if coordinator.curve else ""
    return record


def _check_announce_interfaces(bind: str, named: list[str]) -> None:
    """ValueError if an interface named is missing or none carries the bind address (where
    the coordinator announces among them, with the host nodes reach it at, is its own
    choice: it says so in its log)."""
    from zctl.discovery.interfaces import local_interfaces, named_interfaces
    from zctl.endpoints import split_address

    named_interfaces(local_interfaces(), split_address(bind)[0], named)


def _print_join(record: ClusterRecord, curve: bool, announced: str) -> None:
    join = f"zctl node join {record.control}"
    if announced:
        join = f"zctl node join (it finds the cluster {announced} on the LAN), or {join}"
    if curve:
        server_key = Path(record.curve_dir) / "curve" / "coordinator.key"
        join += f" --curve-server-key coordinator.key (a copy of {server_key})"
        out.print("CURVE on: admit each node's key here with zctl cluster authorize "
                  "NODE.key (its node.key, printed when it joins)")
    out.print(f"coordinator up at {record.control}: it serves as soon as the stages fit the "
              f"machines there are, this one included (zctl cluster status); on each other "
              f"PC run: {join}")


def _log_to_stderr() -> None:
    """A foreground process's log lines (enrolment, wiring, liveness) on stderr."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")


def _serve_foreground(coordinator: CoordinatorProcess) -> int:
    """Run the coordinator here (recorded in cluster.json so zctl run finds it)."""
    import os

    from zctl.launcher.local import free_port
    from zctl.launcher.processes import run_coordinator
    from zctl.paths import zctl_home

    _log_to_stderr()
    serve = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    state = zctl_home() / "coordinator"  # the coordinator's default state dir
    write_record(ClusterRecord(control=coordinator.control,
                               serve=serve, export_dir=coordinator.export_dir,
                               pids=[os.getpid()],
                               curve_dir=str(state) if coordinator.curve else ""))
    try:
        return run_coordinator(replace(coordinator, serve=serve, state_dir=str(state)),
                               lambda text: err.print(text, highlight=False))
    finally:
        cluster_file().unlink(missing_ok=True)


@cluster_app.command("down")
def cluster_down() -> None:
    """Stop the background cluster started by zctl cluster up, and every coordinator and
    node of this zctl home whose command is gone (a cluster whose cluster.json was removed,
    or an embedded cluster's whose command was killed)."""
    from zctl.launcher.embedded import embedded_dir, sweep
    from zctl.launcher.orphans import orphans, running_processes
    from zctl.launcher.record import alive, zctl_process
    from zctl.paths import zctl_home

    try:
        record = read_record()
    except ClusterError as exc:  # damaged: its processes are found as orphans below
        err.print(f"[yellow]note:[/] {escape(str(exc))}", soft_wrap=True)
        record = None
        cluster_file().unlink(missing_ok=True)
    found = orphans(running_processes(), zctl_home().resolve(), record.pids if record else ())
    if record is not None:  # (a pid that no zctl process holds by now is left alone)
        recorded = [pid for pid in record.pids if alive(pid) and zctl_process(pid)]
        stop_processes(recorded)
        cluster_file().unlink(missing_ok=True)
        out.print(f"stopped {len(recorded)} processes of the cluster in {cluster_file()}",
                  soft_wrap=True, highlight=False)
    if found:
        stop_processes([p.pid for p in found])
        out.print(f"stopped {len(found)} process(es) of this zctl home whose command is gone, "
                  "that no cluster.json accounts for:", soft_wrap=True)
        for process in found:
            out.print(f"  {process.describe()}", soft_wrap=True, highlight=False)
    if embedded_dir().is_dir():
        sweep(embedded_dir(), running_processes())
    if record is None and not found:
        out.print("no cluster is up")


@cluster_app.command("status")
def cluster_status(
    endpoint: Annotated[str | None, typer.Option(help="coordinator control address")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    curve_server_key: Annotated[Path | None, typer.Option(
        help="with --endpoint of a --curve cluster: the coordinator's public key file")] = None,
    curve_keys: Annotated[Path | None, typer.Option(
        help="with --curve-server-key: this client's admitted key pair (its .key_secret)")] = None,
) -> None:
    """Nodes, stages, layers, versions and liveness of the running cluster."""
    from controlplane.client import ClusterUnreachable, query_status
    from zctl.cli.view import status_table

    record = read_record()
    target = endpoint or (record.control if record else None)
    if target is None:
        _fail("no cluster is up (zctl cluster up), or give --endpoint tcp://HOST:PORT")
    if bool(curve_server_key) != bool(curve_keys):
        _fail("--curve-server-key and --curve-keys go together")
    from zctl.launcher.record import control_curve

    try:
        curve = (_client_curve(curve_server_key, curve_keys) if curve_server_key and curve_keys
                 else control_curve(record) if endpoint is None else None)
        status = query_status(target, curve=curve)
    except (ClusterUnreachable, OSError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(status.to_dict()))
    else:
        out.print(status_table(status))


def _client_curve(server_key: Path, key_pair: Path):  # noqa: ANN202 - a CurveClient
    """The CURVE client of an admitted key pair for the coordinator with ``server_key``."""
    from controlplane.security import CurveClient, SecurityError

    try:
        return CurveClient.from_files(server_key, key_pair)
    except SecurityError as exc:
        raise ValueError(str(exc)) from None


@cluster_app.command("authorize")
def cluster_authorize(
    node_key: Annotated[Path, typer.Argument(help="the node's public key file (its node.key)")],
    name: Annotated[str | None, typer.Option(help="a name for it (default: the file's)")] = None,
) -> None:
    """Admit a node to this machine's --curve cluster (takes effect within a heartbeat)."""
    from controlplane.security import SecurityError, authorize

    record = read_record()
    if record is None or not record.curve_dir:
        _fail("no --curve cluster is up here (zctl cluster up --curve)")
    label = name or node_key.stem
    if not label.replace("-", "").replace("_", "").replace(".", "").isalnum():
        _fail(f"--name {label!r}: use letters, digits, '-', '_' and '.'")
    try:
        target = authorize(Path(record.curve_dir) / "authorized", label, node_key)
    except SecurityError as exc:
        _fail(str(exc))
    out.print(f"admitted {node_key} as {target.name}")


@node_app.command("join")
def node_join(
    coordinator: Annotated[str | None, typer.Argument(
        help="tcp://HOST:PORT of the coordinator (default: the cluster announced on the LAN)")
    ] = None,
    cluster: Annotated[str | None, typer.Option(
        help="with no address: join the announced cluster of this name")] = None,
    browse_seconds: BrowseSeconds = 2.0,
    pair: Annotated[str | None, typer.Option(
        "--pair", help="a --curve cluster's one-time code from zctl cluster pair: trade keys "
                       "with the coordinator (no key files)")] = None,
    pair_port: PairPort = 5549,
    host: Annotated[str | None, typer.Option(help="address other nodes reach this one at")] = None,
    data_port: Annotated[int, typer.Option(help="inbound data port (0: last used, or free)")] = 0,
    state_dir: Annotated[Path | None, typer.Option(help="node id and shard cache")] = None,
    cpus: Annotated[str | None, typer.Option(
        help="run on these CPUs only, e.g. 0-7 (several nodes on one machine)")] = None,
    curve_server_key: Annotated[Path | None, typer.Option(
        help="the coordinator's public key file (coordinator.key) of a --curve cluster")] = None,
    tok_s: Annotated[float | None, typer.Option(help="this node's measured speed, for "
                                                     "placement")] = None,
    link_delay_ms: Link = 0.0,
    link_jitter_ms: LinkJitter = 0.0,
    link_rate_mbit: LinkRate = 0.0,
    heartbeat: Heartbeat = HEARTBEAT_S,
    reconnect_max: Annotated[float, typer.Option(
        help="longest wait in seconds between tries to reach a lost coordinator (the wait "
             "doubles from 1 s)")] = 32.0,
    memory_mb: MemoryMb = 0,
    profile: Annotated[bool, typer.Option(
        "--profile/--no-profile",
        help="measure this machine's profile for the cluster's model the first time it "
             "joins with it (in the background, at most 30 s; zctl node profile)")] = True,
) -> None:
    """Enrol this machine with a coordinator and serve the stage it assigns (foreground)."""
    from zctl.cli.view import TransferProgress
    from zctl.launcher.processes import NodeProcess, run_node
    from zctl.paths import zctl_home

    if memory_mb < 0:
        _fail(f"--memory-mb must be >= 0, not {memory_mb}")
    if coordinator is not None and cluster is not None:
        _fail("give an address or --cluster NAME, not both")
    if pair is not None and curve_server_key is not None:
        _fail("--pair brings the coordinator's key: leave out --curve-server-key")
    try:
        state = state_dir or zctl_home() / "node"
        found = None if coordinator is not None else find_cluster(cluster, browse_seconds)
        control = coordinator if found is None else found.control
        if pair is not None:
            from controlplane.nodeinfo import load_or_create_node_id

            state.mkdir(parents=True, exist_ok=True)
            curve_server_key = pair_node(pair, control, pair_port, state,
                                         load_or_create_node_id(state),
                                         found.fingerprint if found else "")
        elif found is not None:
            curve_server_key = server_key_for(found, curve_server_key, paired_key_file(state))
        node = NodeProcess(control, rediscover=found.cluster if found else "",
                           fingerprint=found.fingerprint if found else "", host=host, data_port=data_port,
                           heartbeat=heartbeat, reconnect_max=reconnect_max,
                           state_dir=str(state_dir) if state_dir else None, tok_s=tok_s,
                           curve_server_key=str(curve_server_key) if curve_server_key else None,
                           link=link_shape(link_delay_ms, link_jitter_ms, link_rate_mbit),
                           cpus=cpus, memory_mb=memory_mb, profile=profile)
        _log_to_stderr()
        with TransferProgress() as progress:
            code = run_node(node, lambda text: err.print(text, highlight=False), progress.update)
    except (ClusterError, ValueError, OSError) as exc:
        _fail(str(exc))
    raise typer.Exit(code)


def numerics(exact: bool | None, kv_cache_precision: str | None,
             dynamic_quantization: bool | None) -> tuple[str, bool]:
    """(KV cache type, dynamic quantization) for a cluster: exact (True) is an f32 cache and
    f32 activations; fast (False or None) keeps the plugin's defaults; an explicit
    ``kv_cache_precision`` / ``dynamic_quantization`` overrides, but not against exact."""
    kv = kv_cache_precision or ("f32" if exact else "default")
    dq = dynamic_quantization if dynamic_quantization is not None else not exact
    if exact and (kv != "f32" or dq):
        raise ValueError("--exact means an f32 KV cache and f32 activations: drop "
                         "--kv-cache-precision / --dynamic-quantization, or use --fast")
    return kv, dq
