"""Stage runtimes: one compiled stage shard and the KV of every stream it serves. The
stateful runner (``stateful.StageRunner``), the paged one (``paged.PagedStageRunner``,
KV in blocks) and the static NPU one (``static.StaticStageRunner``) share
``base``; ``stage_chain`` runs consecutive stages as one; ``kv`` holds the KV
bookkeeping (slots, blocks, masks, row groups, prefix entries). No sockets here.
"""
