"""The ops a SendHandle's queue carries to its transport path (kvtransfer/sender.py).

A queued op is ``("push", layers, final)`` or ``FINISH``; it lives apart from ``sender.py`` so that
the per-transport paths (``sender_tcp.py``, ``sender_nixl.py``) and the handle import it alike,
without importing each other.
"""

FINISH = ("finish",)  # the op that finish() queues
