"""The ``zctl`` command line (Typer) and its Rich views: ``app`` (export, verify, bench and
the command tree), ``cluster`` (cluster and node commands), ``run``, ``serve``, and the
views (``dashboard``, ``view``, ``export_view``).
"""
