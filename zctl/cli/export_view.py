"""Rich progress for ``zctl export``: one bar per stage, advancing through its phases."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from exporter.export import PHASES, ExportProgress, StageReport


class RichExportProgress(ExportProgress):
    def __init__(self, num_stages: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]stage {task.fields[stage]}[/] {task.fields[layers]}"),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.tasks: dict[int, int] = {}
        self.num_stages = num_stages

    def __enter__(self) -> RichExportProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def stage_started(self, index: int, layers: tuple[int, int]) -> None:
        self.tasks[index] = self.progress.add_task(
            "waiting", total=len(PHASES), stage=f"{index}/{self.num_stages}",
            layers=f"layers {layers[0]}-{layers[1] - 1}",
        )

    def phase(self, index: int, name: str) -> None:
        task = self.tasks[index]
        self.progress.update(task, description=name, completed=PHASES.index(name))

    def stage_done(self, report: StageReport) -> None:
        timings = " ".join(f"{k} {v:.1f}s" for k, v in report.timings.items())
        self.progress.update(
            self.tasks[report.index], completed=len(PHASES),
            description=f"done ({timings}, peak {report.peak_rss_mb:.0f} MB)",
        )

    def note(self, text: str) -> None:
        self.progress.console.log(text)
