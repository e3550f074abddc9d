"""The stage worker: a node's end of the data plane. ``StageWorker`` (``stage_worker``)
takes frames off its inbound pipe, applies them to its stage runtime in order (steps,
resets, rewinds, compactions, row groups, prefix entries, cancels) and sends the result on.
It owns its lookahead in the pipe (``lookahead``: frames taken ahead of their turn and the
cancels among them, so a cancelled step is skipped) and its bookkeeping (``state``: counters,
what it knows of each stream, the epoch rule); ``hop`` is one stage's hop, shared with the
cluster head's stage 0. ``python -m dataplane.worker`` serves one stage.
"""
