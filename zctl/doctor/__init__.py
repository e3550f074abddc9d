"""``zctl doctor``: what to run when something is wrong. ``probes`` gathers facts on this
machine (CPU flags, devices, sockets, hashes), ``verdicts`` turns facts into pass, warn
and fail lines (pure), and ``command`` runs them and prints the report.
"""
