"""``python -m tools.plan [--cases C,..] [--json]`` (``zctl bench plan``)."""

import typer

from tools.plan.cli import main

typer.run(main)
