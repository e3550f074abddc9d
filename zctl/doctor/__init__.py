"""``zctl doctor``'s checks: ``probes`` gathers facts on this machine and from the cluster
(CPU flags, devices, sockets, hashes, the API's /health), ``verdicts`` turns facts into
pass, warn and fail lines (pure), and ``checks`` runs them in order. The command that
prints them is ``zctl.cli.doctor``.
"""
