"""The generation engine: sessions, the scheduler, sampling, drafting, the tokenizer and
the service that turns requests into streamed tokens.

It drives its executors through the ``zctl.engine.executor.Executor`` contract only, and imports
neither OpenVINO nor ZeroMQ: ``dataplane.head.local_chain.LocalChain`` (in process) and
``dataplane.head.cluster_head.ClusterHead`` (over ZeroMQ) are its executors.
"""
