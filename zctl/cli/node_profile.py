"""``zctl node profile``: measure this PC for a model's layer shape and weight format.

The profile (controlplane/profiling.py) is kept in the node's state directory, one per
shape, format, device and OpenVINO version, and used again until one of them changes;
``--json`` prints it as a file a fleet file's PC can name (``profile = "FILE"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from controlplane.planner.measured import PROFILES_FORMAT
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import ROWS, ProfileError
from controlplane.planner.shape import ModelShape, ShapeError
from controlplane.planner.shape_sources import resolve_shape
from controlplane.records import ProfileRecord
from zctl.cli.exports import AUTO, resolve_weights
from zctl.cli.plan import fail
from zctl.cli.view import quota_text
from zctl.weights import INT8_FORMS, WEIGHT_FORMATS, default_int8_form

err = Console(stderr=True)
out = Console()
PROFILED_DEVICES = ("CPU", "GPU")  # what a stage runs on that a profile times (not the NPU's
# static shards)


def usable_devices() -> list[str]:
    """The OpenVINO devices of this PC a stage can run on and a profile can time."""
    from controlplane.nodeinfo import probe_devices

    return [d.name for d in probe_devices() if d.name.split(".")[0] in PROFILED_DEVICES]


def _row(record: ProfileRecord, how: str) -> list[str]:
    ms = [f"{v * 1e3:.3f}" for v in record.decode_s]
    return [record.device, how, " / ".join(ms), f"{record.head_decode_s[0] * 1e3:.2f}",
            f"{record.call_s * 1e3:.3f}", f"{record.prefill_tokens_per_s:,.0f}",
            f"{record.layer_bytes / 1e6:.1f}", f"{record.free_memory / 2**30:.1f}",
            quota_text(record)]


def _format(weights: str, int8_form: str | None, exact_experts: bool = False) -> str:
    """A weight format as the profile names it: with its INT8 form, if it has INT8, and
    its experts exact, if they are."""
    named = weights if int8_form is None else f"{weights}, INT8 {int8_form}"
    return named + (", exact experts" if exact_experts else "")


def _table(shape: ModelShape, weights: str, rows: list[tuple[ProfileRecord, str, Path]]) -> Table:
    table = Table(title=f"{shape.name} ({shape.describe()}), {weights}", title_justify="left")
    for name in ("device", "", f"layer ms at {'/'.join(map(str, ROWS))} rows", "head ms",
                 "call ms", "prefill tok/s a layer", "layer MB", "free GiB", "CPU quota"):
        table.add_column(name, justify="left" if name in ("device", "") else "right")
    for record, how, _ in rows:
        table.add_row(*_row(record, how))
    return table


def profile_command(
    model: Annotated[str, typer.Option(help=f"what zctl plan takes: a preset ({', '.join(PRESETS)}), "
                                            "a config.json, a .gguf file, a model directory "
                                            "or a hub id")] = "smollm2-135m",
    weights: Annotated[str, typer.Option(
        help=f"{AUTO} (the model's default format) | {' | '.join(WEIGHT_FORMATS)}")] = AUTO,
    device: Annotated[list[str] | None, typer.Option(
        help="an OpenVINO device to profile (repeatable; default: every CPU and GPU here)")
    ] = None,
    int8_form: Annotated[str | None, typer.Option(
        help=f"the form of the export's INT8 weights: {' | '.join(INT8_FORMS)} (default: "
             "the form an export is written in now; an export's manifest says int8_form)")
    ] = None,
    exact_experts: Annotated[bool, typer.Option(
        "--exact-experts", help="a mixture of experts' weights exact, as `zctl export "
                                "--exact-experts` keeps MXFP4 experts")] = False,
    budget: Annotated[float, typer.Option(help="seconds profiling one device may take at most",
                                          min=1.0)] = 30.0,
    state_dir: Annotated[Path | None, typer.Option(
        help="the node's state directory (default: zctl node join's)")] = None,
    memory_mb: Annotated[int, typer.Option(
        "--memory-mb", help="RAM this machine lends its stages, in MB (0: what is free)",
        min=0)] = 0,
    force: Annotated[bool, typer.Option(help="measure again even when a profile is kept")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="print the profile (several devices: a list of them) as JSON")] = False,
) -> None:
    """Measure this PC for a model's layer shape and weight format on each device: a
    decoder layer's decode step at 1, 2, 4 and 8 rows, its prefill throughput, the LM
    head's step, an inference call's fixed cost, a layer's memory and the free memory. No
    weights are needed: the layers are synthetic, with random weights in the format."""
    from controlplane.cpu_quota import current_share, read_quota
    from controlplane.profile_store import ProfileStore
    from controlplane.profile_turn import ProfilingTurn
    from controlplane.profiling import measure
    from zctl.paths import zctl_home

    if weights != AUTO and weights not in WEIGHT_FORMATS:
        fail(f"--weights is {AUTO} or one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    try:
        shape = resolve_shape(model)
    except ShapeError as exc:
        fail(str(exc))
    chosen = resolve_weights(model, weights)
    if int8_form is not None:
        if int8_form not in INT8_FORMS:
            fail(f"--int8-form is one of {', '.join(INT8_FORMS)}, not {int8_form!r}")
        if default_int8_form(chosen) is None:
            fail(f"--int8-form is for int8 and int4 exports: a {chosen} export holds no "
                 "INT8 weights")
    form = int8_form or default_int8_form(chosen)
    if exact_experts and not shape.moe:
        fail(f"--exact-experts: {shape.name} has no mixture of experts")
    devices = device or usable_devices()
    if not devices:
        fail("OpenVINO sees no CPU or GPU here to profile")
    store = ProfileStore(state_dir or zctl_home() / "node")
    done: list[tuple[ProfileRecord, str, Path]] = []
    failed = []
    for name in devices:
        record, why = store.load(shape, chosen, name, current_share(), form, exact_experts)
        if record is not None and not force:
            done.append((record, "kept", store.path(shape, chosen, name, form, exact_experts)))
            continue
        if why and record is None and why != "not profiled yet":
            err.print(f"{name}: {why}: measuring again", soft_wrap=True, highlight=False)
        err.print(f"profiling {shape.name} ({_format(chosen, form, exact_experts)}) on "
                  f"{name}, at most "
                  f"{budget:g} s...", highlight=False)
        try:
            with ProfilingTurn().wait(lambda: err.print(
                    "another zctl process on this machine is profiling: waiting for it",
                    highlight=False)):
                measurement = measure(shape, chosen, name, budget, memory_mb << 20,
                                      quota=read_quota(), int8_form=form,
                                      exact_experts=exact_experts)
            record, path = store.save(shape, measurement)
        except (ProfileError, OSError, ValueError) as exc:  # ValueError: a cgroup's quota
            failed.append(f"{name}: {exc}")
            continue
        done.append((record, f"measured in {measurement.seconds:.1f} s", path))
    if as_json:
        files = [json.loads(path.read_text()) for _, _, path in done]
        print(json.dumps(files[0] if len(files) == 1 else {"format": PROFILES_FORMAT,
                                                           "profiles": files}))
    elif done:
        out.print(_table(shape, _format(chosen, form, exact_experts), done))
        for _, _, path in done:
            out.print(f"kept in {path}", soft_wrap=True, highlight=False)
    if failed:
        fail("; ".join(failed))
