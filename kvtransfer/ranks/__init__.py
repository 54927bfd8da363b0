"""KV transfer between tensor-parallel workers: every rank moves its own KV heads (docs/tensor-parallel.md).

A worker at TP=N is N processes; rank r holds KV heads ``engine.tp_shard.kv_head_range(K, N, r)`` of
every block in a cache of its own (same block ids on every rank). Each rank owns kvtransfer
transports over its cache (``agent.RankAgent``); rank 0 plans which source rank sends which heads
to which destination rank (``shape.plan_pieces``), drives the other ranks over a local gRPC control
channel (``control``), and presents the whole worker to the services as one KV link (``link``).

    shape.py    pure: worker shapes, the ranked endpoint, the piece plan, the ranked layout hash
    staging.py  a source rank's staging area: heads gathered contiguously for a narrower receiver
    agent.py    one rank's transports: expect / regroup / send / push / abort / stats
    control.py  the KVRank gRPC servicer over an agent, and the client rank 0 uses for the others
    link.py     rank 0's KV link: one worker, N ranks, the interface prefill/decode workers use
"""
