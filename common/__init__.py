"""The neutral base every zctl package may import: where state lives (``paths``) and the
stage-shard manifest format (``manifest``). Imports nothing of zctl's own."""
