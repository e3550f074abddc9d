"""``zctl cluster up|down|status``, ``zctl node join`` and ``zctl run`` (with its live dashboard)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live

from console.cluster_procs import (
    ClusterError,
    ClusterRecord,
    cluster_file,
    read_record,
    runtime_args,
    start_coordinator,
    start_local_cluster,
    stop_processes,
    wait_serving,
    write_record,
)
from console.dashboard import RunSnapshot, StageInfo, StreamView, render_run

cluster_app = typer.Typer(help="Start, inspect and stop a cluster.", no_args_is_help=True)
node_app = typer.Typer(help="Run this machine as a node of a cluster.", no_args_is_help=True)
err = Console(stderr=True)
out = Console()

Precision = Annotated[str, typer.Option(help="INFERENCE_PRECISION_HINT, or 'default'")]
Exact = Annotated[bool | None, typer.Option(
    "--exact/--fast",
    help="exact: an f32 KV cache and f32 activations, so speculative output is token-identical "
         "to greedy; fast: the CPU plugin's defaults (a u8 KV cache and, on AVX-512-VNNI/AMX "
         "CPUs, int8 activations: 1.1-1.4x faster decoding, but a near-tied token can flip "
         "between a 1-token and a K+1-token step). Default: fast, except in the embedded "
         "cluster of a speculative zctl run", show_default=False)]
KvPrecision = Annotated[str | None, typer.Option(
    help="KV cache element type (f32, f16, bf16, u8, u4, or 'default': the plugin's); "
         "default: as --exact/--fast say", show_default=False)]
DynamicQuantization = Annotated[bool | None, typer.Option(
    "--dynamic-quantization/--no-dynamic-quantization",
    help="int8 activations for compressed matmuls where the CPU supports them; default: as "
         "--exact/--fast say", show_default=False)]


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def ensure_export(model: str, stages: int, weights: str) -> Path:
    """The cached export for (model, stages, weights); exported on first use with progress."""
    from console.cli import default_export_dir, default_split, quiet_ml_libraries
    from dataplane.manifest import ManifestError, load_manifest

    target = Path(model) if (Path(model) / "manifest.json").is_file() else default_export_dir(
        model, stages, weights)
    try:
        load_manifest(target)
        return target
    except ManifestError:
        if target == Path(model):
            raise
    err.print(f"exporting {model} in {stages} {weights} stages (first use) to {target}")
    try:
        from console.export_view import RichExportProgress
        from console.paths import source_cache_dir
        from exporter.export import export_model
        from exporter.sources import open_source
    except ImportError as exc:
        raise ClusterError(f"exporting needs the export extra (pip install 'zctl[export]'): {exc}") \
            from None
    quiet_ml_libraries()
    source = open_source(model, source_cache_dir())
    with RichExportProgress(stages, err) as progress:
        export_model(source, default_split(source, stages), weights, target, force=True,
                     progress=progress)
    return target


def _running_record() -> ClusterRecord | None:
    from console.cluster_procs import alive

    record = read_record()
    if record is None:
        return None
    if not record.pids or not alive(record.pids[0]):
        cluster_file().unlink(missing_ok=True)  # a stale file from a cluster that died
        return None
    return record


@cluster_app.command("up")
def cluster_up(
    local: Annotated[int | None, typer.Option(help="N: a local cluster of N nodes (N stages)")] = None,
    model: Annotated[str, typer.Option(help="model name/path or an export directory")] = "smollm2-135m",
    stages: Annotated[int | None, typer.Option(help="stages (default: --local N, else 2)")] = None,
    weights: Annotated[str, typer.Option(help="int4 | int8 | fp16 | fp32")] = "int4",
    bind: Annotated[str, typer.Option(help="control address (without --local)")] = "0.0.0.0:5550",
    host: Annotated[str | None, typer.Option(help="address nodes reach the coordinator at")] = None,
    precision: Precision = "f32",
    exact: Exact = None,
    kv_cache_precision: KvPrecision = None,
    dynamic_quantization: DynamicQuantization = None,
    threads: Annotated[int | None, typer.Option(help="INFERENCE_NUM_THREADS per stage")] = None,
    device: Annotated[str, typer.Option(help="CPU | GPU | NPU | AUTO")] = "CPU",
    timeout: Annotated[float, typer.Option(help="seconds to wait for the pipeline")] = 300.0,
    cpu_sets: Annotated[str, typer.Option(
        help="with --local: shared (every stage may use every core: lowest one-stream "
             "latency) | split (each node its own cores, like separate PCs: stages "
             "compute different streams at once)")] = "shared",
    row_groups: Annotated[int | None, typer.Option(
        help="batch concurrent streams' decode steps into this many row groups (one "
             "inference per stage per group); 0: each stream steps alone; default: 1 "
             "for a --local cluster with shared CPUs, else one per stage")] = None,
    foreground: Annotated[bool, typer.Option(help="run the coordinator in this process "
                                                  "(containers, service managers)")] = False,
    reassign_after: Annotated[float | None, typer.Option(
        help="give a dead node's stage to an idle spare node after this many seconds "
             "(default: wait for the node to come back)")] = None,
    resume_timeout: Annotated[float, typer.Option(
        help="generations pause while a stage's node is down and resume where they were "
             "once it is back or a spare took over; after this many seconds they end with "
             "an error (0: at once)")] = 120.0,
    curve: Annotated[bool, typer.Option(
        "--curve", help="CURVE: encrypt and authenticate the control and data pipes; only "
                        "nodes admitted with zctl cluster authorize may join (a --local "
                        "cluster admits its own nodes)")] = False,
) -> None:
    """Start the coordinator (and with --local N, N-1 node processes on 127.0.0.2...) in the background."""
    if _running_record() is not None:
        _fail(f"a cluster is already up ({cluster_file()}); zctl cluster down first")
    stage_count = stages or local or 2
    if local is not None and local != stage_count:
        _fail(f"--local {local} runs {local} stages; drop --stages or make them equal")
    if row_groups is not None and row_groups < 0:
        _fail(f"--row-groups must be >= 0, not {row_groups}")
    if local is None and cpu_sets != "shared":
        _fail("--cpu-sets applies to --local clusters; a node sets its own with "
              "zctl node join --cpus")
    try:
        kv, dq = numerics(exact, kv_cache_precision, dynamic_quantization)
        if resume_timeout < 0 or (reassign_after is not None and reassign_after < 0):
            raise ValueError("--resume-timeout and --reassign-after must be >= 0 seconds")
        rt = runtime_args(None if precision == "default" else precision, threads, device, kv, dq)
        rt += ["--resume-timeout", str(resume_timeout)]  # (coordinator arguments from here)
        if reassign_after is not None:
            rt += ["--reassign-after", str(reassign_after)]
        export_dir = ensure_export(model, stage_count, weights)
        if foreground:
            if local is not None:
                _fail("--foreground runs only the coordinator; start nodes with zctl node join")
            groups = ["--row-groups", str(row_groups)] if row_groups is not None else []
            raise typer.Exit(_serve_foreground(export_dir, bind, host, [*rt, *groups], curve))
        if curve:
            rt.append("--curve")
        if local is not None:
            rt = [a for a in rt if a != "--curve"]  # start_local_cluster adds it, with keys
            record = start_local_cluster(export_dir, local, rt, cpu_sets=cpu_sets,
                                         row_groups=row_groups, curve=curve)
        else:
            import socket

            bind_host, _, port = bind.rpartition(":")
            public = host or (socket.gethostbyname(socket.gethostname())
                              if bind_host in ("0.0.0.0", "*", "") else bind_host)
            from console.paths import zctl_home

            groups = ["--row-groups", str(row_groups)] if row_groups is not None else []
            root = zctl_home() / "cluster"
            if curve:  # made now so its public key can be shown (the coordinator reuses it)
                from controlplane.security import key_dir, load_or_create_keypair

                load_or_create_keypair(key_dir(root / "coordinator"), "coordinator")
            record = start_coordinator(export_dir, bind_host or "0.0.0.0", public, int(port),
                                       [*rt, *groups], None, root)
            record.curve_dir = str(root / "coordinator") if curve else ""
        write_record(record)
        if local is None:
            join = f"zctl node join {record.control}"
            if curve:
                server_key = Path(record.curve_dir) / "curve" / "coordinator.key"
                join += f" --curve-server-key coordinator.key (a copy of {server_key})"
                out.print("CURVE on: admit each node's key here with zctl cluster authorize "
                          "NODE.key (its node.key, printed when it joins)")
            out.print(f"coordinator up at {record.control}; on each node run: {join}")
            return
        status = wait_serving(record, timeout)
    except (ClusterError, ValueError, OSError) as exc:
        rec = read_record() if cluster_file().is_file() else None
        if rec is not None:
            stop_processes(rec.pids)
            cluster_file().unlink(missing_ok=True)
        _fail(str(exc))
    from controlplane.view import status_table

    out.print(status_table(status))
    out.print(f"serving {status.model} on {len(status.stages)} stages; zctl run \"...\"; "
              "zctl cluster down stops it")


def _serve_foreground(export_dir: Path, bind: str, host: str | None, rt: list[str],
                      curve: bool = False) -> int:
    """Run the coordinator here (recorded in cluster.json so zctl run finds it)."""
    import os

    from console.cluster_procs import free_port
    from console.paths import zctl_home
    from controlplane.__main__ import main as controlplane_main

    bind_host, _, port = bind.rpartition(":")
    public = host or bind_host
    serve = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    state = zctl_home() / "coordinator"  # the coordinator's default state dir
    write_record(ClusterRecord(control=f"tcp://{public}:{port}", serve=serve,
                               export_dir=str(export_dir), pids=[os.getpid()],
                               curve_dir=str(state) if curve else ""))
    args = ["coordinator", str(export_dir), "--bind", f"tcp://{bind_host}:{port}", "--serve", serve,
            "--state-dir", str(state), *rt, *(["--curve"] if curve else [])]
    if host:
        args += ["--host", host]
    try:
        return controlplane_main(args)
    finally:
        cluster_file().unlink(missing_ok=True)


@cluster_app.command("down")
def cluster_down() -> None:
    """Stop the background cluster started by zctl cluster up."""
    try:
        record = read_record()
    except ClusterError as exc:
        _fail(str(exc))
    if record is None:
        out.print("no cluster is up")
        return
    stop_processes(record.pids)
    cluster_file().unlink(missing_ok=True)
    out.print(f"stopped {len(record.pids)} processes")


@cluster_app.command("status")
def cluster_status(
    endpoint: Annotated[str | None, typer.Option(help="coordinator control address")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Nodes, stages, layers, versions and liveness of the running cluster."""
    from controlplane.client import ClusterUnreachable, query_status
    from controlplane.view import status_table

    record = read_record()
    target = endpoint or (record.control if record else None)
    if target is None:
        _fail("no cluster is up (zctl cluster up), or give --endpoint tcp://HOST:PORT")
    from console.cluster_procs import control_curve

    try:
        status = query_status(target, curve=control_curve(record) if endpoint is None else None)
    except ClusterUnreachable as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(status.to_dict()))
    else:
        out.print(status_table(status))


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
    coordinator: Annotated[str, typer.Argument(help="tcp://HOST:PORT of the coordinator")],
    host: Annotated[str | None, typer.Option(help="address other nodes reach this one at")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="node id and shard cache")] = None,
    cpus: Annotated[str | None, typer.Option(
        help="run on these CPUs only, e.g. 0-7 (several nodes on one machine)")] = None,
    curve_server_key: Annotated[Path | None, typer.Option(
        help="the coordinator's public key file (coordinator.key) of a --curve cluster")] = None,
) -> None:
    """Enrol this machine with a coordinator and serve the stage it assigns (foreground)."""
    from controlplane.__main__ import main as controlplane_main

    args = ["node", "--coordinator", coordinator]
    if curve_server_key:
        args += ["--curve-server-key", str(curve_server_key)]
    if host:
        args += ["--host", host]
    if state_dir:
        args += ["--state-dir", str(state_dir)]
    if cpus:
        args += ["--cpus", cpus]
    raise typer.Exit(controlplane_main(args))


def _stages_from_status(status: Any) -> list[StageInfo]:
    nodes = {n.node_id: n for n in status.nodes}
    rows = []
    for stage in status.stages:
        node = nodes.get(stage.node_id or "")
        device = node.devices[0].name if node and node.devices else "?"
        rows.append(StageInfo(stage.index, node.host if node else "-",
                              f"{stage.layer_start}-{stage.layer_end - 1}", device))
    return rows


def _stage_breakdown(stages: list[StageInfo], timing: dict[str, dict[str, float]]) -> list[dict]:
    rows = []
    for info in stages:
        i = info.index
        hop = f"hop{i}-{i + 1}"
        rows.append({"stage": i, "node": info.node, "layers": info.layers, "device": info.device,
                     **{f"{k}_ms": timing.get(name, {})
                        for k, name in [("compute", f"stage{i}.compute"), ("queue", f"{hop}.queue"),
                                        ("serialise", f"{hop}.serialise"),
                                        ("network", f"{hop}.network")]}})
    return rows


def parse_k(value: str) -> int:
    """``--k``: 'auto' (0: adaptive) or a draft length 1..MAX_DRAFT_TOKENS."""
    from controlplane.service_messages import MAX_DRAFT_TOKENS

    if value == "auto":
        return 0
    if not value.isdigit() or not 1 <= int(value) <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--k must be 'auto' or a draft length 1..{MAX_DRAFT_TOKENS}, not {value!r}")
    return int(value)


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


def parse_speculative(value: str) -> str:
    """``--speculative``: '' (off), 'lookup', or 'draft:PATH' with PATH made absolute (the
    coordinator loads it, possibly from another working directory)."""
    if value in ("", "off", "none"):
        return ""
    if value == "lookup":
        return value
    if value.startswith("draft:") and len(value) > 6:
        path = Path(value.removeprefix("draft:")).expanduser()
        if not path.is_dir():
            raise ValueError(f"draft model {path} is not a directory (export one with "
                             "zctl export MODEL --stages 1 --out DIR)")
        return f"draft:{path.resolve()}"
    raise ValueError(f"--speculative must be 'lookup' or 'draft:PATH', not {value!r}")


def check_sampling(temperature: float, top_k: int, top_p: float,
                   seed: int | None) -> dict[str, Any]:
    """The sampling options, validated here so a bad one fails before a cluster starts."""
    from dataplane.sampling import SamplingParams

    SamplingParams(temperature, top_k, top_p, seed)  # raises ValueError with the reason
    if seed is not None and seed < 0:
        raise ValueError(f"--seed must be >= 0, not {seed}")
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}


def stream_run(record: ClusterRecord, prompts: list[str], max_tokens: int, chat: bool,
               as_json: bool, ignore_eos: bool = False, speculative: str = "",
               k: int = 0, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send the prompts to the generation service (run concurrently, one stream each);
    live dashboard unless --json. Returns the run's report."""
    from console.cluster_procs import control_curve
    from controlplane.balance import suggest_layers
    from controlplane.client import generate_many, query_status
    from controlplane.service_messages import GenerateDone, GenerateRequest

    status = query_status(record.control, curve=control_curve(record))
    if speculative and not status.runtime.exact:
        err.print("[yellow]note:[/] this cluster runs fast numerics (a quantised KV cache or "
                  "int8 activations): speculative output can differ from greedy at near-tied "
                  "tokens; zctl cluster up --exact makes it identical", soft_wrap=True)
    sampling = sampling or {}
    seed = sampling.pop("seed", None)
    requests = [GenerateRequest(uuid.uuid4().hex[:16], p, max_tokens, chat, ignore_eos,
                                speculative, k, **sampling,
                                seed=None if seed is None else seed + i)  # streams differ
                for i, p in enumerate(prompts)]
    index = {r.request_id: i for i, r in enumerate(requests)}
    snapshot = RunSnapshot(_stages_from_status(status), [StreamView(p) for p in prompts])
    dones: dict[int, GenerateDone] = {}
    first_at: dict[int, float] = {}
    start = time.monotonic()
    live = None if as_json else Live(render_run(snapshot), console=out, refresh_per_second=8)
    try:
        if live is not None:
            live.start()
        for msg in generate_many(record.serve, requests):
            i = index[msg.request_id]
            view = snapshot.streams[i]
            now = time.monotonic()
            first_at.setdefault(i, now)
            view.ttft_ms, view.tok_s, view.spec = msg.ttft_ms, msg.tok_s, msg.spec
            snapshot.timing = msg.timing or snapshot.timing
            if isinstance(msg, GenerateDone):
                dones[i] = msg
                view.text, view.tokens = msg.text, len(msg.tokens)
                view.status = "error" if msg.error else f"done ({msg.stop_reason})"
            else:
                view.text += msg.text
                view.tokens = msg.produced
                if msg.note:
                    view.status = msg.note
                    view.notes.append(msg.note)
            after_first = sum(max(v.tokens - 1, 0) for v in snapshot.streams)
            if len(prompts) > 1 and now > min(first_at.values()):
                snapshot.aggregate_tok_s = after_first / (now - min(first_at.values()))
            if live is not None:
                live.update(render_run(snapshot))
    finally:
        if live is not None:
            live.stop()
            if not out.is_terminal:  # Live ends a redirected dashboard without a newline
                out.line()
    errors = [d.error for d in dones.values() if d.error]
    if errors:
        raise ClusterError(errors[0])
    end = time.monotonic()
    since_first = end - min(first_at.values(), default=start)  # every stream's decode
    streams = [{"tokens": len(d.tokens), "text": d.text, "ttft_ms": round(d.ttft_ms, 2),
                "tok_s": round(d.tok_s, 2), "prompt_tokens": d.prompt_tokens,
                "stop_reason": d.stop_reason, "spec": d.spec,
                "notes": snapshot.streams[i].notes}
               for i, d in ((i, dones[i]) for i in range(len(prompts)))]
    last = dones[len(prompts) - 1].timing if len(prompts) == 1 else snapshot.timing
    report: dict[str, Any] = {
        "streams": streams, "wall_s": round(end - start, 3),
        "aggregate_tok_s": round(sum(max(s["tokens"] - 1, 0) for s in streams)
                                 / max(since_first, 1e-9), 2),
        "stages": _stage_breakdown(snapshot.stages, last),
        "suggested_layers": suggest_layers(
            [info.layers for info in snapshot.stages],
            [last.get(f"stage{info.index}.compute", {}).get("p50", 0.0) for info in snapshot.stages]),
        "overhead_ms": last.get("overhead", {}), "step_ms": last.get("total", {}),
        "speculative": speculative, "k": k or "auto", "sampling": requests[0].temperature and {
            "temperature": requests[0].temperature, "top_k": requests[0].top_k,
            "top_p": requests[0].top_p, "seed": requests[0].seed}}
    if len(streams) == 1:
        report = {**streams[0], **report}
    else:
        report["tokens"] = sum(s["tokens"] for s in streams)
    return report


def run(
    prompts: Annotated[list[str], typer.Argument(help="what to ask (several: one stream each)")],
    max_tokens: Annotated[int, typer.Option(help="new tokens at most, per stream")] = 128,
    chat: Annotated[bool, typer.Option("--chat/--raw", help="apply the chat template")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object, no dashboard")] = False,
    streams: Annotated[int, typer.Option(
        help="concurrent streams (the prompts are repeated to fill them); 0: one per prompt")] = 0,
    speculative: Annotated[str, typer.Option(
        help="speculative decoding: 'lookup' (prompt n-grams) or 'draft:PATH' (a 1-stage export "
             "sharing the tokenizer); output stays identical to greedy on a cluster with exact "
             "numerics (zctl cluster up --exact; the embedded cluster of a speculative run "
             "has them)")] = "",
    k: Annotated[str, typer.Option("--k", help="draft tokens per step, or 'auto'")] = "auto",
    temperature: Annotated[float, typer.Option(
        help="0: greedy; > 0 samples (speculation then keeps the model's distribution)")] = 0.0,
    top_k: Annotated[int, typer.Option(help="sample among the k most likely tokens (0: all)")] = 0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling mass")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="sampling seed (stream i uses seed + i)")] = None,
    model: Annotated[str, typer.Option(help="model for the embedded cluster")] = "smollm2-135m",
    stages: Annotated[int, typer.Option(help="stages of the embedded cluster")] = 2,
    weights: Annotated[str, typer.Option(help="weights of the embedded cluster")] = "int4",
    precision: Precision = "f32",
    exact: Exact = None,
    kv_cache_precision: KvPrecision = None,
    dynamic_quantization: DynamicQuantization = None,
    ignore_eos: Annotated[bool, typer.Option(help="always produce max-tokens tokens")] = False,
) -> None:
    """Stream a generation through the running cluster (or an embedded local one)."""
    embedded = None
    try:
        draft_k, mode = parse_k(k), parse_speculative(speculative)
        sampling = check_sampling(temperature, top_k, top_p, seed)
        if streams < 0:
            raise ValueError(f"--streams must be >= 0, not {streams}")
        wanted = streams or len(prompts)
        prompts = [prompts[i % len(prompts)] for i in range(wanted)]
        record = _running_record()
        told = exact is not None or kv_cache_precision is not None or dynamic_quantization is not None
        if record is not None and told:
            err.print("[yellow]note:[/] --exact/--fast, --kv-cache-precision and "
                      "--dynamic-quantization shape an embedded cluster; the running one keeps "
                      "its own (zctl cluster status)", soft_wrap=True)
        if record is None:
            # the cluster is this command's own: a speculative run gets exact numerics
            # unless told otherwise (its output then equals greedy token for token)
            kv, dq = numerics(exact if told else bool(mode) or None,
                              kv_cache_precision, dynamic_quantization)
            rt = runtime_args(None if precision == "default" else precision, None, "CPU", kv, dq)
            export_dir = ensure_export(model, stages, weights)
            err.print(f"no cluster is up: starting an embedded local {stages}-node cluster")
            embedded = record = start_local_cluster(export_dir, stages, rt)
            wait_serving(record, 300)
        result = stream_run(record, prompts, max_tokens, chat, as_json, ignore_eos, mode, draft_k,
                            sampling)
    except (ClusterError, ValueError, OSError) as exc:
        _fail(str(exc))
    except RuntimeError as exc:  # ClusterUnreachable and data-plane errors
        _fail(str(exc))
    finally:
        if embedded is not None:
            stop_processes(embedded.pids)
    if as_json:
        print(json.dumps(result))
