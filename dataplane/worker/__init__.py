"""The stage worker: a node's end of the data plane. ``StageWorker`` (``stage_worker``)
takes frames from the previous hop, runs its stage and sends the result on; its prefix
entries, cancels and bookkeeping are its own objects (``prefixes``, ``cancels``,
``state``); ``hop`` is one stage's hop, shared with the cluster head's stage 0.
``python -m dataplane.worker`` serves one stage.
"""
