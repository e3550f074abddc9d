"""Stage runtimes: one compiled stage shard and the KV of every stream it serves.

``base`` declares what every runtime is (``StageRuntime``, its ``StageError``, the checks of
a step's arguments); ``config`` the settings a stage compiles with (``RuntimeSpec``, no
OpenVINO). The runtimes: the stateful runner (``stateful.StageRunner``, KV as OpenVINO
state), the paged one (``paged.PagedStageRunner``, KV in blocks), the static NPU one
(``static.StaticStageRunner``, KV on the host), and ``stage_chain.StageChain``, consecutive
stages run as one. ``load`` picks a stage's runner, ``startup`` opens and warms one up,
``rewind`` holds the rewinds they all take alike; ``kv`` the KV bookkeeping (slot tables,
row groups, masks, blocks, prefix entries). The rest serves them: host-side RoPE (``rope``),
a paged stage's bound inputs and step shapes (``bound_inputs``, ``step_shapes``), huge
pages and the malloc threshold (``hugepages``, ``heap``), and a draft model for speculation
(``draft_model``). No sockets here, and nothing of the wire.
"""
