"""zctl: distributed LLM inference over fleets of ordinary PCs.

The product's namespace. Its rooms, lowest first (each imports only rooms below it):

- ``zctl.manifest``, ``zctl.paths``: the stage-shard manifest every room reads, and where
  state lives.
- ``zctl.engine``: the generation engine (sessions, scheduler, sampling, drafting); no
  sockets, no OpenVINO. It drives an ``Executor``.
- ``dataplane`` (top level): the stage runtimes, the wire, the stage workers, and the
  engine's executors (``dataplane.head``).
- ``controlplane`` (top level): membership, placement, shard transfer, wiring, healing.
- ``exporter`` (top level): cutting a model into stage shards (torch, NNCF).
- ``zctl.service``: the engine's front door over ZeroMQ (the generation service, its
  messages and its clients).
- ``zctl.launcher``: the coordinator and node processes, and local clusters of them.
- ``zctl.serve``: the HTTP front door (OpenAI's and Anthropic's APIs, metrics).
- ``zctl.doctor``: ``zctl doctor``'s probes and verdicts.
- ``zctl.cli``: the ``zctl`` command line and its Rich views.

docs/design.md draws the map and follows one token through it.
"""
