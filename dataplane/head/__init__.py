"""The engine's executors (``zctl.engine.executor.Executor``): ``ClusterHead`` runs stage 0
on the coordinator and the rest on nodes over the wire (``cluster_head``, with its
replies, prefix entries and types), ``LocalChain`` runs every stage in this process
(``local_chain``); ``figures`` keeps what both measured for a metrics scrape.
"""
