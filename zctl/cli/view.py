"""Rich views of the control plane: a node's shard-transfer progress bar, the status table."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from controlplane.placement import fmt_bytes, layer_range
from controlplane.records import (
    ClusterStatus,
    LinkStatus,
    NodeStatus,
    PredictionStatus,
    ProfileRecord,
)

STATE_STYLE = {"serving": "green", "ready": "cyan", "wiring": "cyan", "transferring": "yellow",
               "idle": "dim", "failed": "red", "dead": "bold red", "left": "dim"}


class TransferProgress:
    """A progress bar per shard; pass ``update`` as the agent's ``on_progress``.

    The display runs only while a shard is arriving: a live display refreshing for the
    node's whole life would take the GIL four times a second from the stage it serves.
    """

    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(TextColumn("shard {task.fields[short]}"), BarColumn(),
                                 DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=console or Console(stderr=True), transient=False)
        self._tasks: dict[str, TaskID] = {}
        self._done: dict[str, int] = {}  # bytes done by shard
        self.showing = False

    def __enter__(self) -> TransferProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._hide()

    def update(self, shard_hash: str, done: int, total: int) -> None:
        task = self._tasks.get(shard_hash)
        if task is None or done < self._done.get(shard_hash, 0):  # new, or restarted
            if task is not None:
                self.progress.remove_task(task)
            task = self._tasks[shard_hash] = self.progress.add_task(
                "", total=total, short=shard_hash[:12])
        self._done[shard_hash] = done
        if not self.showing:
            self.progress.start()
            self.showing = True
        self.progress.update(task, completed=done, total=total)
        if all(t.finished for t in self.progress.tasks):
            self._hide()

    def _hide(self) -> None:
        """Stop the display (its last frame stays on screen) and drop the finished bars."""
        if self.showing:
            self.progress.stop()
            self.showing = False
        finished = {t.id for t in self.progress.tasks if t.finished}
        for shard_hash, task in list(self._tasks.items()):
            if task in finished:
                self.progress.remove_task(task)
                del self._tasks[shard_hash], self._done[shard_hash]


def short_version(version: str) -> str:
    """``2026.4.1-22982-e213a147257-releases/2026/4`` -> ``2026.4.1`` (build details dropped)."""
    return version.split("-", 1)[0]


def quota_text(profile: ProfileRecord) -> str:
    """The CPU quota a profile was measured under: "0.5 cores / 20 ms", or "none"."""
    if not profile.cpu_share:
        return "none"
    return f"{profile.cpu_share:.3g} cores / {profile.quota_period_s * 1e3:.3g} ms"


def profile_cell(node: NodeStatus) -> str:
    """A node's profile in a few characters: one layer's decode step at one row (and the
    CPU quota it is held to, if any), or what stands in the way (measuring, not profiled
    yet, failed)."""
    if node.profile is not None:
        quota = node.profile.cpu_share
        return (f"{node.profile.decode_s[0] * 1e3:.3f} ms/layer"
                + (f", CPU quota {quota_text(node.profile)}" if quota else ""))
    state = node.profile_state
    return "[red]failed[/]" if state.startswith("failed") else state.split(" (")[0]


def link_text(link: LinkStatus) -> str:
    """A link in a line: its round trip and bandwidth each way, or why it has none."""
    if not link.measured_at:
        return f"{link.a}->{link.b} {link.error or 'not measured'}"
    text = (f"{link.a}->{link.b} {link.rtt_s * 1e3:.2f} ms, {link.forward_bps / 1e6:,.0f}/"
            f"{link.backward_bps / 1e6:,.0f} MB/s")
    return text + (f" ({link.error})" if link.error else "")


def prediction_text(prediction: PredictionStatus) -> str:
    """The running placement's predicted speed in a line: one stream's tok/s and the most
    streams' (with their row groups), or why there is none."""
    if prediction.error:
        return f"no prediction: {prediction.error}"
    text = f"predicted 1 stream {prediction.tok_s:.3g} tok/s"
    if len(prediction.streams) > 1:
        most = prediction.streams[-1]
        text += (f", {most.streams} streams {most.tok_s:.3g} tok/s ({most.row_groups} row "
                 f"group{'s' if most.row_groups > 1 else ''} of {most.rows})")
    return text


def status_table(status: ClusterStatus) -> Table:
    """The cluster at a glance: one row per node in stage order (its stage's layers,
    devices, free RAM, liveness, profile), then the pipeline line, how the stages were
    placed (the nodes the planner left out, with its reasons), the links' figures and the
    predicted speed as caption. Versions go in the
    caption when every node runs the coordinator's (a node whose OpenVINO differs is
    refused at enrolment), else in a column; transfer and note columns appear only while
    some shard is arriving or some node reports a problem."""
    layers = {s.node_id: layer_range(s.layer_start, s.layer_end) for s in status.stages
              if s.node_id is not None}
    nodes = sorted(status.nodes, key=lambda n: (n.stage is None, n.stage or 0, n.node_id))
    mixed = any((n.openvino, n.zctl) != (status.openvino, status.zctl) for n in nodes)
    transferring = any(n.transfer_done < n.transfer_total for n in nodes)
    noted = any(n.error for n in nodes)
    table = Table(title=f"zctl cluster {status.model} ({status.endpoint})", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    columns = (["node", "host", "state", "stage", "layers", "dev", "free RAM", "seen", "profile"]
               + ["OpenVINO / zctl"] * mixed + ["transfer"] * transferring + ["note"] * noted)
    for column in columns:
        table.add_column(column, justify="right" if column in ("stage", "free RAM") else "left",
                         no_wrap=column in ("node", "host", "layers", "free RAM"))
    for node in nodes:
        style = STATE_STYLE.get(node.state, "")
        row = [node.node_id + ("*" if node.local else ""), node.host,
               f"[{style}]{node.state}[/]" if style else node.state,
               "" if node.stage is None else str(node.stage), layers.get(node.node_id, ""),
               ", ".join(d.name for d in node.devices), fmt_bytes(node.ram_free),
               "" if node.local else f"{node.last_seen_s:.1f}s", profile_cell(node)]
        if mixed:
            versions = f"{short_version(node.openvino)} / {node.zctl}"
            differs = (node.openvino, node.zctl) != (status.openvino, status.zctl)
            row.append(f"[red]{versions}[/]" if differs else versions)
        if transferring:
            row.append(f"{100 * node.transfer_done // node.transfer_total}%"
                       if node.transfer_total else "")
        if noted:
            row.append(node.error[:60])
        table.add_row(*row)
    rt = status.runtime
    caption = (f"* coordinator · pipeline {status.pipeline}, epoch {status.epoch}, {rt.device}, "
               f"{'exact' if rt.exact else 'fast'} numerics, "
               f"{'paged' if rt.paged_attention else 'stateful'} KV"
               f"{', CURVE' if status.curve else ''} · "
               + ("OpenVINO / zctl versions differ" if mixed else
                  f"OpenVINO {short_version(status.openvino)}, zctl {status.zctl} on every node"))
    if status.plan_error:
        caption += f" - {status.plan_error}"
    if status.placement:
        caption += f" · placed {status.placement}"
    if status.left_out:
        caption += " · left out: " + "; ".join(f"{node}: {why}" for node, why in
                                               sorted(status.left_out.items()))
    if status.refused:
        caption += f" - refused: {status.refused[-1].reason}"
    if status.links:
        caption += " · links: " + "; ".join(link_text(link) for link in status.links)
    if status.prediction is not None:
        caption += " · " + prediction_text(status.prediction)
    table.caption = caption
    return table
