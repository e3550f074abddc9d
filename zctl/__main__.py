"""``python -m zctl`` runs the zctl command line."""

from zctl.cli.app import app

app()
