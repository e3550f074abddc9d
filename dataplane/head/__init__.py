"""The engine's executors (``zctl.engine.executor.Executor``): ``ClusterHead`` runs stage 0
on the coordinator and the rest on nodes over the wire (``cluster_head``; it owns a
``ReplyInbox`` of the steps in flight and their answers, ``inbox``, and the prefix drops the
chain has not taken yet, ``prefix_drops``), ``LocalChain`` runs every stage in this process
(``local_chain``). ``replies`` is what a step's answer is (``ClusterReply``), ``errors`` what
the head raises, ``metrics`` what both executors measured, kept for a metrics scrape.
"""
