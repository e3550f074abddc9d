"""Data plane: run stage shards with OpenVINO and move hidden states between them.

``runtime`` runs a stage (and keeps its streams' KV), ``wire`` carries frames between
stages; neither imports the other. ``worker`` serves a stage on a node over both, and
``head`` holds the engine's executors: ``ClusterHead`` (stage 0 here, the rest on the
nodes) and ``LocalChain`` (every stage in this process).

Nothing here imports torch or transformers: a worker node that only runs shards
installs openvino, pyzmq, numpy, tokenizers and jinja2.
"""
