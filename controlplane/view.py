"""Rich views of the control plane: a node's shard-transfer progress bar, the status table."""

from __future__ import annotations

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

from controlplane.messages import ClusterStatus
from controlplane.placement import fmt_bytes

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


def status_table(status: ClusterStatus) -> Table:
    """The cluster at a glance: one row per node, then the pipeline line as caption."""
    table = Table(title=f"zctl cluster {status.model} ({status.endpoint})")
    for column in ("node", "host", "state", "stage", "devices", "free RAM", "last seen",
                   "transfer", "note"):
        table.add_column(column, justify="right" if column in ("stage", "free RAM") else "left")
    for node in status.nodes:
        style = STATE_STYLE.get(node.state, "")
        transfer = (f"{100 * node.transfer_done // node.transfer_total}%"
                    if node.transfer_total else "")
        table.add_row(node.node_id + (" (coordinator)" if node.local else ""), node.host,
                      f"[{style}]{node.state}[/]" if style else node.state,
                      "" if node.stage is None else str(node.stage),
                      ", ".join(d.name for d in node.devices), fmt_bytes(node.ram_free),
                      "" if node.local else f"{node.last_seen_s:.1f}s ago", transfer,
                      node.error[:60])
    rt = status.runtime
    caption = (f"pipeline {status.pipeline}, epoch {status.epoch}, {rt.device}, "
               f"{'exact' if rt.exact else 'fast'} numerics")
    if status.plan_error:
        caption += f" - {status.plan_error}"
    if status.refused:
        caption += f" - refused: {status.refused[-1].reason}"
    table.caption = caption
    return table
