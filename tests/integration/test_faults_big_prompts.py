"""One client's huge prompts must not stall another client's small requests.

1 prefill + 1 decode worker, two routers in front of them:

- router A (the launcher's, defaults, context 2048): 8 MiB text prompts from 3 clients are refused by
  their length alone (no tokenization: at least 123k tokens for a 2k context), INVALID_ARGUMENT;
- router B (its own copy of the model directory claiming a 100k-token context, ``--max-request-bytes``
  4 MiB): 8 MiB prompts are refused by gRPC's message limit (RESOURCE_EXHAUSTED) before they are
  parsed; 1 MiB prompts pass the length bound and are tokenized (seconds of CPU each) on the
  router's tokenizer threads, then refused because they are longer than the context.

Meanwhile a 4th client sends small requests one after the other. The assertion is structural: while
the big prompts are being tokenized, small requests keep completing (a blocked event loop would
complete none before the first big one returns). Small-request latency with and without the big
ones is printed as a ratio, never asserted.
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time

import grpc
import pytest

from pdserve.app.launcher.local import QUIET_ENV, LocalCluster
from pdserve.app.launcher.procs import spawn
from pdserve.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
WORDS = "hello world, this is a test of the tokenizer. "


def big_text(n_bytes: int) -> str:
    return (WORDS * (n_bytes // len(WORDS) + 1))[:n_bytes]


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    model = make_checkpoint("llama")
    run_dir = tmp_path_factory.mktemp("bigprompts")
    long_ctx = run_dir / "model-100k"
    shutil.copytree(model, long_ctx)
    cfg = json.loads((long_ctx / "config.json").read_text())
    cfg["max_position_embeddings"] = 100_000
    (long_ctx / "config.json").write_text(json.dumps(cfg))
    with LocalCluster(model, prefill=1, decode=1, transport="tcp", run_dir=run_dir) as c:
        addrs = {h.role: h.address for h in c.workers}
        router_b = spawn("router", ["--model", str(long_ctx), "--prefill", addrs["prefill"],
                                    "--decode", addrs["decode"], "--max-request-bytes", str(4 << 20)],
                         run_dir / "router-b.log", env=QUIET_ENV)
        try:
            c.router_b = router_b.address
            c.start_free = c.free_blocks()
            yield c
        finally:
            router_b.stop(10)
        stats = c.wait_idle(c.start_free)
        assert {w: s.free_blocks for w, s in stats.items()} == c.start_free


def small_latencies(router: str, n: int) -> list[float]:
    out = []
    with Client(router, timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.generate(prompt_ids=[5 + i, 6, 7, 8], max_tokens=4, ignore_eos=True)
            assert len(r.token_ids) == 4
            out.append(time.perf_counter() - t0)
    return out


def flood(router: str, text: str, n_clients: int) -> tuple[list[grpc.RpcError], list[float], list[float]]:
    """n_clients big prompts at once while one client sends small requests until they are all back:
    (the big ones' errors, when each big one returned, when each small one completed)."""
    errors: list = [None] * n_clients
    big_done: list[float] = []
    small_done: list[float] = []
    small_lat: list[float] = []
    stop = threading.Event()

    def big(i: int) -> None:
        try:
            with Client(router, timeout=240) as c:
                c.generate(prompt=text, max_tokens=4)
        except grpc.RpcError as exc:
            errors[i] = exc
        big_done.append(time.perf_counter())

    def small() -> None:
        with Client(router, timeout=60) as c:
            i = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                r = c.generate(prompt_ids=[9 + i % 50, 6, 7, 8], max_tokens=4, ignore_eos=True)
                assert len(r.token_ids) == 4
                small_done.append(time.perf_counter())
                small_lat.append(small_done[-1] - t0)
                i += 1

    bigs = [threading.Thread(target=big, args=(i,)) for i in range(n_clients)]
    s = threading.Thread(target=small)
    s.start()
    for t in bigs:
        t.start()
    for t in bigs:
        t.join(280)
    stop.set()
    s.join(60)
    flood.small_latencies = small_lat  # type: ignore[attr-defined]
    return errors, big_done, small_done


def test_8mib_prompts_refused_by_length_without_tokenizing(cluster) -> None:
    alone = statistics.median(small_latencies(cluster.router, 10))
    errors, _big_done, small_done = flood(cluster.router, big_text(8 << 20), 3)
    assert all(e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
    assert all("exceeds the model's context" in e.details() for e in errors)
    during = statistics.median(flood.small_latencies)  # type: ignore[attr-defined]
    print(f"\nrouter A: small request p50 {alone * 1e3:.1f} ms alone, {during * 1e3:.1f} ms beside 3x8 MiB "
          f"prompts (ratio {during / alone:.2f}); {len(small_done)} small requests served meanwhile")


def test_large_prompts_tokenized_off_the_event_loop(cluster) -> None:
    alone = statistics.median(small_latencies(cluster.router_b, 10))
    # Over --max-request-bytes: gRPC refuses before parsing.
    errors, _, _ = flood(cluster.router_b, big_text(8 << 20), 3)
    assert all(e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors), errors
    # Under it, and under the length bound: tokenized on the tokenizer threads, then refused.
    start = time.perf_counter()
    errors, big_done, small_done = flood(cluster.router_b, big_text(1 << 20), 3)
    assert all(e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors), errors
    assert all("exceeds the model's context of 100000 tokens" in e.details() for e in errors)
    first_big = min(big_done)
    served_meanwhile = sum(1 for t in small_done if start < t < first_big)
    during = statistics.median(flood.small_latencies)  # type: ignore[attr-defined]
    print(f"\nrouter B: big prompts back after {first_big - start:.1f}-{max(big_done) - start:.1f} s; "
          f"{served_meanwhile} small requests completed before the first of them; small p50 "
          f"{alone * 1e3:.1f} ms alone, {during * 1e3:.1f} ms beside them (ratio {during / alone:.2f})")
    assert served_meanwhile >= 2, "small requests stalled while the big prompts were tokenized"
