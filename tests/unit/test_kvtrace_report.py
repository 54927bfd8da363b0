"""bench/kvtrace_report.py: the three trace lines of a request (prefill worker, sender, receiver) joined
into the stages after the prefill; short prompts left out; the stall watch's loop episodes counted."""

import importlib
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_stages_and_stalls(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        kr = importlib.import_module("kvtrace_report")
    finally:
        sys.path.remove(str(BENCH))

    def line(side, rid, **t):
        return f"2026 INFO kvtransfer.trace: kvtrace {side} {rid} {json.dumps(t)}\n"

    prefill = (line("prefill", "long", called=0.0, first_step=0.01, prefill_done=0.21, acked=0.26)
               + line("prefill", "short", called=0.0, first_step=0.0, prefill_done=0.02, acked=0.021)
               + "2026 WARNING pdserve.stall: event loop stuck over 40 ms at _api.py:665 transfer <- x\n"
               + "2026 WARNING pdserve.stall: event loop was stuck 90 ms\n"
               + line("tx", "long", start=0.02, begin_sent=0.03, begin_ok=0.05, posted=0.23,
                      xfers_done=0.231, wrote_sent=0.232, acked=0.255)
               + line("tx", "short", start=0.0, begin_sent=0.0, begin_ok=0.001, posted=0.02, acked=0.021))
    decode = (line("rx", "long", expect=0.0, begin=0.031, wrote=0.233, complete=0.233)
              + line("rx", "short", expect=0.0, begin=0.0, complete=0.02))
    (tmp_path / "prefill-1.log").write_text(prefill)
    (tmp_path / "decode-2.log").write_text(decode)
    rep = kr.report(tmp_path, 0.08)
    assert rep["requests"] == 1  # the 20 ms prompt is not a long one
    st = {k: round(v["p50_ms"], 3) for k, v in rep["stages"].items()}
    assert st == {"kv_wait": 50.0, "posted": 20.0, "back": 22.0, "seen": 5.0, "begin_ok": 20.0}
    assert rep["loop_stalls"] == {"episodes": 1, "median_ms": 90.0, "max_ms": 90.0,
                                  "innermost": {"_api.py:665 transfer": 1}}


def test_littles_law_beside_the_time_to_the_answer(tmp_path):
    """bench/kvtrace_serving.py: frames ahead of each request over the point's throughput, beside its
    time to the answer, and the pairs acknowledged out of their compute order."""
    sys.path.insert(0, str(BENCH))
    try:
        ks = importlib.import_module("kvtrace_serving")
    finally:
        sys.path.remove(str(BENCH))

    def req(called, done, acked, frames):
        return {"prefill": {"called": called, "first_step": called, "prefill_done": done, "acked": acked},
                "tx-frames": {"frames": frames}}

    # a link of 10 frames/s in order: a is on it from 0 to 1 s, b (called at 0.5 s) waits for it
    law = ks.littles_law([req(0.0, 0.0, 1.0, 10), req(0.5, 0.5, 2.0, 10)])
    assert law["answer"] == [1.0, 1.5]
    assert law["ahead_over_rate"] == [0.0, 1.0] and law["overtaken"] == [0.0]
    # c computed after d but acknowledged first: one pair out of order
    law = ks.littles_law([req(0.0, 0.2, 2.0, 10), req(0.1, 0.3, 1.0, 10)])
    assert law["overtaken"] == [1.0]
    assert ks.littles_law([req(0.0, 0.1, 0.5, 10)]) == {}  # one request says nothing about a queue
    s = ks.summarise([req(0.0, 0.0, 1.0, 10), req(0.5, 0.5, 2.0, 10)])
    assert s["answer"]["p50_ms"] > 0 and s["overtaken"] == 0
