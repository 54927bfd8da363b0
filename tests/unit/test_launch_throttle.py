"""engine.layer_sink.launch_throttle / chain with a stand-in for CUDA events (CPU): the host waits for
the oldest layer once more than ``ahead`` are outstanding, oldest first; chained hooks all run."""

import torch

from engine import layer_sink


class FakeEvent:
    log: list = []
    done_after = 2  # each event completes on its 2nd query

    def __init__(self):
        self.n = len(FakeEvent.log)
        self.queries = 0
        FakeEvent.log.append(("new", self.n))

    def record(self):
        pass

    def query(self):
        self.queries += 1
        FakeEvent.log.append(("query", self.n))
        return self.queries >= FakeEvent.done_after


def test_throttle_waits_for_the_oldest_layer_beyond_the_lead(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(layer_sink, "_THROTTLE_NAP_S", 0.0)
    FakeEvent.log = []
    hook = layer_sink.launch_throttle(2)
    for i in range(5):
        hook(i)
    queried = [n for kind, n in FakeEvent.log if kind == "query"]
    # layers 0..2 launched before any wait; then each new layer waits for the one 2 behind the newest
    assert queried == [0, 0, 1, 1, 2, 2]
    assert FakeEvent.log[:4] == [("new", 0), ("new", 1), ("new", 2), ("query", 0)]


def test_chain_calls_every_hook_in_order():
    seen = []
    assert layer_sink.chain(None, None) is None
    one = layer_sink.chain(None, lambda i: seen.append(("a", i)))
    one(0)
    both = layer_sink.chain(lambda i: seen.append(("a", i)), None, lambda i: seen.append(("b", i)))
    both(1)
    assert seen == [("a", 0), ("a", 1), ("b", 1)]
