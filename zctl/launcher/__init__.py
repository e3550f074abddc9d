"""Starting zctl's processes: the coordinator and node processes from typed
configurations (``processes``; ``python -m zctl.launcher`` is their entry), CPU sets for
processes sharing a machine (``cpusets``), and local clusters of such processes on
loopback addresses, with their record and teardown (``local``). The command line, the
tests and the benchmarks all start clusters through this room.
"""
