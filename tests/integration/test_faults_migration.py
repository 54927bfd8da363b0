"""Worker deaths under load: supervised restarts and token-exact migration (process launcher).

One cluster for the module: 1 prefill + 2 decode workers over TCP, the launcher's supervisor
restarting dead processes after 0.5 s. Covers:

- ``kill -9`` of a decode worker under 16 greedy + 4 seeded streams (three of them with penalties and
  a logit bias): every stream completes, token for token what one in-process engine produces without
  a fault (the router continues each of the dead worker's streams on the other decode worker from
  prompt + the tokens already sent, the seeded ones resume their seed's stream, the penalties count
  the tokens already sent), the dead worker is back at its address under a new incarnation
  (the time is printed: the supervisor adds its 0.5 s backoff to a process start), the router counted
  the death and the restart;
- ``kill -9`` of the only prefill worker while requests arrive: they wait for its restart and
  complete, token-exact;
- SIGSTOP of a decode worker under 16 greedy streams: its call is given up, the streams continue
  token-exact elsewhere, a request made meanwhile is served, and after SIGCONT nothing is leaked;
- leak checks on every worker at the end of each test.

Tests with clusters of their own (crash loop, liveness, the Ray launcher) are in test_faults_restart.py,
which shares this module's helpers.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from pdserve.app.launcher.local import LocalCluster, get_stats
from pdserve.app.launcher.supervisor import RestartPolicy
from pdserve.client import Client
from pdserve.probe import free_port
from pdserve.probe import scrape_metrics as scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
FAST_RESTART = RestartPolicy(backoff_s=0.5, max_backoff_s=2.0, max_restarts=5, window_s=120.0, poll_s=0.2)
# Long enough that no stream can finish between the last stream's first token and the kill, even on a
# loaded 2-core box (48 tokens was not: seed 1954735865 killed a worker whose streams had all ended);
# short enough that all 20 streams fit one decode worker's 512 blocks after the kill.
MAX_TOKENS = 300


def prompt(i: int, n: int = 20) -> list[int]:
    return [(i * 131 + k * 17) % 1000 + 5 for k in range(n)]


def reference(model_dir, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=512, device="cpu"))
    return engine.generate(prompts, [SamplingParams(**kw) for kw in params])


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    model = make_checkpoint("llama")
    port = free_port()
    with LocalCluster(model, prefill=1, decode=2, transport="tcp", run_dir=tmp_path_factory.mktemp("migrate"),
                      worker_args=("--num-blocks", "512"), restart=FAST_RESTART,
                      # a process start takes tens of seconds on a loaded 2-core box
                      router_args=("--metrics-port", str(port), "--retry-wait-s", "180")) as c:
        c.model, c.metrics_port = model, port
        c.start_free = c.free_blocks()
        yield c


def leak_check(c) -> None:
    stats = c.wait_idle(c.start_free, timeout=60)
    assert {w: s.free_blocks for w, s in stats.items()} == c.start_free
    assert all(s.num_leased == 0 and s.num_running == 0 and s.queue_depth == 0 for s in stats.values())
    deadline = time.monotonic() + 10
    while scrape(c.metrics_port)["pdserve_router_inflight_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(c.metrics_port)["pdserve_router_inflight_requests"] == 0


def wait_back(c, worker, old_incarnation: str, timeout: float = 240.0) -> float:
    """Seconds until ``worker`` answers under a new incarnation and the router places on it again.

    The bound is generous on purpose (a process start on a loaded CI box); the time is printed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            inc = get_stats(worker.address, worker.role, timeout=2).incarnation
            with Client(c.router, timeout=5) as cl:
                seen = {w["worker_id"]: w for w in cl.list_workers()}
            if inc != old_incarnation and seen.get(worker.worker_id, {}).get("healthy"):
                return time.monotonic() - t0
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{worker.worker_id} not back within {timeout:.0f}s")


def stream_all(router: str, prompts, params, started: threading.Event, min_tokens: int):
    """Start every stream; ``started`` is set once each has received ``min_tokens`` tokens."""
    results: list = [None] * len(prompts)
    got = [0] * len(prompts)
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            with Client(router, timeout=180) as c:
                ids, final = [], None
                for msg in c.stream(prompt_ids=prompts[i], **params[i]):
                    ids.extend(msg.token_ids)
                    with lock:
                        got[i] = len(ids)
                        if min(got) >= min_tokens:
                            started.set()
                    if msg.HasField("final"):
                        final = msg.final
                results[i] = (ids, final)
        except grpc.RpcError as exc:
            results[i] = exc
            started.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results


def joined(threads, results, timeout: float) -> list:
    """Wait for every stream; none may have failed. Returns the results (token ids, final) in order."""
    for t in threads:
        t.join(timeout)
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    assert not errors, [(e.code(), e.details()) for e in errors]
    return results


def streams_on_the_busiest(c, prompts, params):
    """Start every stream, wait until each has its first token: (threads, results, the decode worker
    running the most of them)."""
    started = threading.Event()
    threads, results = stream_all(c.router, prompts, params, started, min_tokens=1)
    assert started.wait(240)
    victim = max((h for h in c.workers if h.role == "decode"),
                 key=lambda h: get_stats(h.address, "decode").num_running)
    return threads, results, victim


def test_decode_worker_killed_mid_stream_streams_continue_token_exact(cluster) -> None:
    prompts = [prompt(i) for i in range(20)]
    params = [dict(max_tokens=MAX_TOKENS, ignore_eos=True) for _ in range(16)]
    params += [dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, top_k=50, seed=100 + i)
               for i in range(4)]
    # penalties count the tokens sent before the move (engine.penalties): greedy and seeded
    for i in (0, 1, 16):
        params[i].update(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.1,
                         logit_bias={7 + i: 2.5})
    want = reference(cluster.model, prompts, params)
    before = scrape(cluster.metrics_port)
    # every stream is decoding: kill the decode worker running the most of them
    threads, results, victim = streams_on_the_busiest(cluster, prompts, params)
    old_inc = get_stats(victim.address, "decode").incarnation
    cluster.kill(victim)  # SIGKILL: no drain
    killed_at = time.monotonic()
    joined(threads, results, 180)
    for (ids, final), w in zip(results, want, strict=True):
        assert ids == w
        assert final.usage.completion_tokens == MAX_TOKENS and final.finish_reason == "length"
    moved = [f for _, f in results if f.facts.decode_worker != victim.worker_id]
    after = scrape(cluster.metrics_port)
    retried = after.get('pdserve_router_request_retries_total{stage="mid_stream"}', 0) - \
        before.get('pdserve_router_request_retries_total{stage="mid_stream"}', 0)
    back = wait_back(cluster, victim, old_inc)
    print(f"\n{len(moved)}/20 streams finished on the survivor, {retried:.0f} continued mid-stream; "
          f"{victim.worker_id} back {time.monotonic() - killed_at:.1f}s after the kill ({back:.1f}s wait)")
    assert retried >= 1, "no stream was on the killed worker: the test proved nothing"
    assert victim.restarts >= 1
    after = scrape(cluster.metrics_port)
    assert after['pdserve_router_worker_deaths_total{pool="decode"}'] >= 1
    assert after['pdserve_router_worker_restarts_total{pool="decode"}'] >= 1
    leak_check(cluster)


def test_constrained_streams_migrated_after_kill_resume_their_grammar_token_exact(cluster) -> None:
    """Structured output across a ``kill -9``: the router continues each stream elsewhere from prompt +
    the tokens already sent, and the new decode worker replays those tokens into a fresh matcher
    (engine.grammar.state), so every answer is a single engine's, and still holds its constraint."""
    from pdserve.sampling import Constraint

    numbers = {"type": "integer", "minimum": 0, "maximum": 99}
    long_json = Constraint("json_schema", json.dumps({"type": "array", "minItems": 70, "maxItems": 70,
                                                      "items": numbers}))
    words = Constraint("regex", "([a-z]{2,5} ){60}[a-z]{1,5}")
    prompts = [prompt(i) for i in range(12)]
    params = [dict(max_tokens=MAX_TOKENS, constraint=long_json if i % 2 else words) for i in range(12)]
    params[5].update(temperature=0.8, seed=9)  # seeded: the continuation resumes the seed's stream too
    want = reference(cluster.model, prompts, params)
    key = 'pdserve_router_request_retries_total{stage="mid_stream"}'
    before = scrape(cluster.metrics_port).get(key, 0)
    threads, results, victim = streams_on_the_busiest(cluster, prompts, params)
    old_inc = get_stats(victim.address, "decode").incarnation
    cluster.kill(victim)
    joined(threads, results, 180)
    assert [ids for ids, _ in results] == want
    assert all(final.finish_reason == "stop" for _, final in results)
    retried = scrape(cluster.metrics_port).get(key, 0) - before
    print(f"\n{retried:.0f} of 12 constrained streams continued mid-stream after the kill")
    assert retried >= 1, "no stream was on the killed worker: the test proved nothing"
    wait_back(cluster, victim, old_inc)
    leak_check(cluster)


def test_decode_worker_frozen_mid_stream_streams_move_on_and_new_requests_are_served(cluster) -> None:
    """SIGSTOP, not SIGKILL: the process lives and its TCP connections stay open, so nothing but the
    router's own health poll tells. The router gives up the frozen worker's DecodeMany call (the call
    carried nothing while its poll failed; on a loaded box keepalive may end it first), the streams
    continue token-exact on the other decode worker, a request made during the freeze is served, and
    after SIGCONT the worker frees what it held."""
    import os
    import signal

    prompts = [prompt(200 + i) for i in range(16)]
    params = [dict(max_tokens=MAX_TOKENS, ignore_eos=True) for _ in prompts]
    late, late_params = prompt(299), dict(max_tokens=8, ignore_eos=True)
    want = reference(cluster.model, [*prompts, late], [*params, late_params])
    before = scrape(cluster.metrics_port)
    threads, results, victim = streams_on_the_busiest(cluster, prompts, params)
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        with Client(cluster.router, timeout=120) as c:
            assert c.generate(prompt_ids=late, **late_params).token_ids == want[-1]
        assert [ids for ids, _ in joined(threads, results, 180)] == want[:-1]
        after = scrape(cluster.metrics_port)
        # the call ended under its streams: given up at a failed poll (the usual way, seconds in), or
        # ended by the channel's keepalive (10-15 s in) where the box was too loaded for the poll to
        # find it silent first
        delta = {k: after.get(f"pdserve_router_decode_mux_{k}_total", 0)
                 - before.get(f"pdserve_router_decode_mux_{k}_total", 0) for k in ("broken", "abandoned")}
        assert delta["broken"] >= 1, f"the frozen worker's call did not end under its streams: {delta}"
        with Client(cluster.router, timeout=10) as c:
            seen = {w["worker_id"]: w for w in c.list_workers()}
        assert seen[victim.worker_id]["healthy"] is False  # still frozen: out of placement
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    leak_check(cluster)


def test_only_prefill_worker_killed_requests_complete_after_restart(cluster) -> None:
    victim = next(h for h in cluster.workers if h.role == "prefill")
    old_inc = get_stats(victim.address, "prefill").incarnation
    prompts = [prompt(50 + i, 40) for i in range(6)]
    params = [dict(max_tokens=12, ignore_eos=True) for _ in prompts]
    want = reference(cluster.model, prompts, params)
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            with Client(cluster.router, timeout=120) as c:
                results[i] = c.generate(prompt_ids=prompts[i], **params[i]).token_ids
        except grpc.RpcError as exc:
            results[i] = exc

    cluster.kill(victim)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(0.05)
    assert joined(threads, results, 150) == want
    wait_back(cluster, victim, old_inc)
    leak_check(cluster)
