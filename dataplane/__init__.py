"""Data plane: run stage shards with OpenVINO and move hidden states between them.

Nothing here imports torch or transformers: a worker node that only runs shards
installs openvino, pyzmq, numpy, tokenizers and jinja2.
"""
