"""One prefill + one decode worker + router over TCP on loopback, shared by every test in this module.

Covers: greedy output identical to the in-process engine for concurrent mixed-length requests, the
first token streamed before decoding is done, every bad-input case, deadlines, client cancellation,
health + reflection + ListWorkers, and the pools' free block counts returning to their start values.
"""

from __future__ import annotations

import math
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client, build_request
from pdserve.probe import free_port, scrape_metrics

pytestmark = pytest.mark.slow
PROMPT_LENS = [1, 5, 16, 17, 40, 100]
MAX_TOKENS = [8, 3, 12, 1, 20, 6]


def prompts(vocab: int = 1024) -> list[list[int]]:
    return [[(7 * i + 13 * n + 3) % (vocab - 10) + 5 for i in range(n)] for n in PROMPT_LENS]


def reference(model_dir, prompt_list: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=256, device="cpu"))
    return [engine.generate([p], SamplingParams(max_tokens=m))[0] for p, m in zip(prompt_list, max_tokens,
                                                                                   strict=True)]


def run_concurrently(router: str, prompt_list, max_tokens, *, each=None, **kw) -> list:
    """Every prompt at once, one client each; ``each(i)``: request i's own keyword arguments."""
    results: list = [None] * len(prompt_list)

    def one(i: int) -> None:
        with Client(router, timeout=120) as c:
            results[i] = c.generate(prompt_ids=prompt_list[i], max_tokens=max_tokens[i], **kw,
                                    **(each(i) if each is not None else {}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompt_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    model = make_checkpoint("llama")
    metrics_port = free_port()
    with LocalCluster(model, prefill=1, decode=1, transport="tcp",
                      decode_args=("--metrics-port", str(metrics_port)),
                      run_dir=tmp_path_factory.mktemp("c1p1d")) as c:
        c.model, c.decode_metrics_port = model, metrics_port
        c.start_free = c.free_blocks()
        yield c
        # Leak check for the whole module: every block back, nothing running or leased.
        stats = c.wait_idle(c.start_free)
        assert {w: s.free_blocks for w, s in stats.items()} == c.start_free


def test_penalties_and_bias_match_engine(cluster) -> None:
    """Penalized greedy and seeded requests, disaggregated: the prefill worker picks the first token
    with them, the decode worker counts it and goes on; equal to the in-process engine."""
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    ps = prompts()[1:5]
    kws = [dict(max_tokens=16, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5),
           dict(max_tokens=16, ignore_eos=True, repetition_penalty=1.4, logit_bias={9: 4.0, 10: -100.0}),
           dict(max_tokens=16, ignore_eos=True, temperature=0.9, seed=11, frequency_penalty=0.8),
           dict(max_tokens=16, ignore_eos=True, presence_penalty=-0.5, logit_bias={12: 1.5})]
    engine = LLMEngine(EngineConfig(model=str(cluster.model), num_blocks=256, device="cpu"))
    want = [engine.generate([p], SamplingParams(**kw))[0] for p, kw in zip(ps, kws, strict=True)]
    results: list = [None] * len(ps)

    def one(i: int) -> None:
        with Client(cluster.router, timeout=120) as c:
            results[i] = c.generate(prompt_ids=ps[i], **kws[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [r.token_ids for r in results] == want
    assert 10 not in results[1].token_ids


def test_the_standard_event_loop_serves_the_same(cluster, tmp_path) -> None:
    """Every process of the module's cluster runs on uvloop (the default); a cluster on asyncio's own
    loop (``--event-loop asyncio``) gives the same tokens, and every block comes back."""
    ps, mt = prompts()[:4], MAX_TOKENS[:4]
    want = reference(cluster.model, ps, mt)
    loop = ("--event-loop", "asyncio")
    with LocalCluster(cluster.model, prefill=1, decode=1, transport="tcp", run_dir=tmp_path,
                      worker_args=("--num-blocks", "256", *loop), router_args=loop) as c:
        start = c.free_blocks()
        got = run_concurrently(c.router, ps, mt)
        assert [r.token_ids for r in got] == want
        assert {w: s.free_blocks for w, s in c.wait_idle(start).items()} == start
        assert not any(map(_maps_uvloop, _pids(c)))
    assert all(map(_maps_uvloop, _pids(cluster)))


def _pids(c: LocalCluster) -> list[int]:
    return [c.cluster.router.pid, *(h.pid for h in c.workers)]


def _maps_uvloop(pid: int) -> bool:
    """Whether uvloop's extension is loaded in process ``pid`` (it is imported only to run on it)."""
    with open(f"/proc/{pid}/maps") as f:
        return "uvloop" in f.read()


def test_greedy_matches_engine_concurrent(cluster) -> None:
    ps = prompts()
    want = reference(cluster.model, ps, MAX_TOKENS)
    got = run_concurrently(cluster.router, ps, MAX_TOKENS)
    for r, w, m in zip(got, want, MAX_TOKENS, strict=True):
        assert r.token_ids == w
        assert r.finish_reason in ("length", "stop") and len(r.token_ids) <= m
        f = r.final
        assert f["transport"] == "tcp" and f["prefill_worker"].startswith("prefill")
        assert f["decode_worker"].startswith("decode")
        assert f["usage"]["completion_tokens"] == len(r.token_ids)
        # the first token's time by stage: the Prefill call holds the worker's queue + compute + KV wait
        assert f["allocate_ms"] > 0 and f["prefill_compute_ms"] > 0 and f["prefill_queue_ms"] >= 0
        inner = f["prefill_queue_ms"] + f["prefill_compute_ms"] + f["kv_wait_ms"]
        assert f["prefill_rpc_ms"] >= inner - 1.0  # 1 ms: the two clocks are read in two processes
    # sent at once, the later ones were placed behind the earlier ones' prompts: the router's admission
    # estimate of their wait is in their facts
    assert any(r.final.get("admission_wait_est_ms", 0.0) > 0 for r in got)
    # prompts of 16/17/40/100 tokens have full blocks: those the decode worker does not cache went over
    # the wire (another test of this module may have sent the same prompt first), and the last block
    # always does
    by_len = dict(zip(PROMPT_LENS, got, strict=True))
    f100 = by_len[100].final
    assert f100["kv_blocks_sent"] + f100["kv_blocks_reused"] == 7 and f100["kv_blocks_sent"] >= 1
    assert f100["kv_bytes_sent"] > 0
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free


def test_decode_worker_exports_the_engine_counters(cluster) -> None:
    """--metrics-port on a decode worker: the engine's counters as Prometheus counters, moving with the
    requests it decodes (pdserve/app/worker_metrics.py)."""
    def counters() -> dict[str, float]:  # each name summed over its labels (finished: every reason)
        out: dict[str, float] = {}
        for key, value in scrape_metrics(cluster.decode_metrics_port).items():
            if key.startswith("pdserve_worker_"):
                name = key.split("{")[0]
                out[name] = out.get(name, 0.0) + value
        return out

    before = counters()
    got = run_concurrently(cluster.router, prompts()[:3], [6, 6, 6])
    after = counters()
    assert all(len(r.token_ids) == 6 for r in got)
    # the first token of each comes from the prefill worker; the decode worker samples the other five
    gained = {k: after[k] - before.get(k, 0.0) for k in after}
    assert gained["pdserve_worker_generated_tokens_total"] >= 15
    assert gained["pdserve_worker_steps_total"] > 0
    assert gained["pdserve_worker_finished_requests_total"] >= 3
    assert after["pdserve_worker_total_blocks"] > 0


def test_text_prompt_and_session_reuse(cluster) -> None:
    with Client(cluster.router, timeout=60) as c:
        first = c.generate(prompt="The quick brown fox jumps over the lazy dog " * 4, max_tokens=4,
                           session_id="s1")
        assert first.text and first.final["usage"]["prompt_tokens"] > 32
        # same prompt again: the decode worker holds its full blocks, only the tail block moves
        again = c.generate(prompt="The quick brown fox jumps over the lazy dog " * 4, max_tokens=4,
                           session_id="s1")
    assert again.token_ids == first.token_ids
    assert again.final["kv_blocks_reused"] >= 2
    assert again.final["kv_blocks_sent"] < first.final["kv_blocks_sent"]


def test_first_token_streams_before_decode_finishes(cluster) -> None:
    decode = next(h for h in cluster.workers if h.role == "decode")
    with Client(cluster.router, timeout=120) as c:
        stream = c.stream(prompt_ids=prompts()[4], max_tokens=300, ignore_eos=True)
        first = next(stream)
        # The first message is the prefill's token alone; at this point the decode worker still
        # holds the request (leased or running): the answer is nowhere near done.
        from pdserve.app.launcher.local import get_stats

        s = get_stats(decode.address, "decode")
        assert len(first.token_ids) == 1 and not first.HasField("final")
        assert s.num_running + s.num_leased >= 1
        rest = [m for m in stream]
    assert sum(len(m.token_ids) for m in rest) == 299
    assert rest[-1].final.usage.completion_tokens == 300


BAD = [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (dict(prompt_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (dict(prompt_ids=[5] * 2000, max_tokens=100), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    (dict(prompt_ids=[5, 6], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt_ids=[5, 6], temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt_ids=[5, 6], top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt_ids=[5, 6], top_p=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt_ids=[5, 6], top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (dict(prompt_ids=[5, 6], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt_ids=[5, 6], max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt_ids=[5, -1]), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    (dict(prompt_ids=[5, 1024]), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    (dict(prompt_ids=[5], stop_token_ids=[-2]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    (dict(prompt_ids=[5], request_id="x" * 500), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
]


@pytest.mark.parametrize("kwargs,code,needle", BAD, ids=[f"{i}-{b[2] or 'oversize'}" for i,
                                                         b in enumerate(BAD)])
def test_bad_input_is_refused_cleanly(cluster, kwargs, code, needle) -> None:
    with Client(cluster.router, timeout=30) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(build_request(**kwargs))
    assert info.value.code() == code, info.value.details()
    assert needle in (info.value.details() or "")
    assert cluster.free_blocks() == cluster.start_free


def test_oversize_message_is_refused_by_the_router(cluster) -> None:
    from pdserve.v1 import router_pb2_grpc

    # A channel that is willing to send 20 MiB, so the router's own 16 MiB limit is what refuses it.
    with grpc.insecure_channel(cluster.router, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(router_pb2_grpc.RouterStub(ch).Generate(build_request(prompt="a" * (20 << 20)), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert cluster.free_blocks() == cluster.start_free


def test_no_prompt_at_all(cluster) -> None:
    from pdserve.v1 import router_pb2

    with Client(cluster.router, timeout=30) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(router_pb2.GenerateRequest(max_tokens=3))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_deadline_exceeded_frees_blocks(cluster) -> None:
    with Client(cluster.router) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(prompt_ids=prompts()[5], max_tokens=1000, ignore_eos=True, timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free


def test_client_cancel_mid_stream_frees_both_pools(cluster) -> None:
    with Client(cluster.router) as c:
        call = c.stream(prompt_ids=prompts()[5], max_tokens=1000, ignore_eos=True, timeout=120)
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                break
        during = cluster.free_blocks()
        call.cancel()
    assert any(during[w] < cluster.start_free[w] for w in during)  # it really held blocks
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free
    assert all(s.num_leased == 0 and s.num_running == 0 for s in stats.values())


def test_health_reflection_and_list_workers(cluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for h in [*cluster.workers, cluster.cluster.router]:
        service = {"prefill": "pdserve.v1.Prefill", "decode": "pdserve.v1.Decode",
                   "router": "pdserve.v1.Router"}[h.role]
        with grpc.insecure_channel(h.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]), timeout=5))
            names = {s.name for s in replies[0].list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names
    with Client(cluster.router, timeout=10) as c:
        workers = c.list_workers()
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all(w["healthy"] for w in workers)
    stats = cluster.stats()
    for s in stats.values():
        assert s.incarnation and s.layout_hash and s.total_blocks == 256 and s.block_size == 16
    decode = next(s for s in stats.values() if s.role == "decode")
    assert decode.kv_endpoint and decode.transports == ["tcp"]


def test_cli_client_json_and_error(cluster, capsys) -> None:
    import json

    from pdserve.app.cli import main

    assert main(["client", "--router", cluster.router, "--prompt-ids", "5,6,7", "--max-tokens", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("token_ids", "text", "finish_reason", "prefill_worker", "decode_worker", "transport",
                "kv_blocks_sent", "kv_bytes_sent", "kv_blocks_reused"):
        assert key in out
    assert len(out["token_ids"]) == 4 and out["transport"] == "tcp"
    assert out["prefill_mode"] == "remote"  # conditional disaggregation is off by default
    assert main(["client", "--router", cluster.router, "--prompt-ids", "5", "--max-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    # the same text prompt through `pdserve generate` (one in-process engine) and the cluster
    text = "The quick brown fox"
    assert main(["generate", "--model", str(cluster.model), "--prompt", text, "--max-tokens", "12",
                 "--device", "cpu", "--json"]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["client", "--router", cluster.router, "--prompt", text, "--max-tokens", "12", "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]


def _decode_stub(cluster):
    from pdserve.v1 import decode_pb2_grpc

    decode = next(h for h in cluster.workers if h.role == "decode")
    return grpc.insecure_channel(decode.address), decode_pb2_grpc.DecodeStub


def test_no_kv_blocks_is_resource_exhausted(cluster) -> None:
    from pdserve.v1 import common_pb2, decode_pb2

    channel, stub_cls = _decode_stub(cluster)
    with channel:
        stub = stub_cls(channel)
        # Hold every decode block with direct reservations (as if many prompts were in flight).
        held = []
        for i in range(40):
            try:
                stub.Allocate(decode_pb2.AllocateRequest(request_id=f"hog-{i}", prompt_ids=[9 + i] * 256,
                                                         sampling=common_pb2.SamplingParams(max_tokens=1),
                                                         lease_ms=60_000), timeout=10)
                held.append(f"hog-{i}")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                break
        assert held and len(held) < 40
        with Client(cluster.router, timeout=30) as c, pytest.raises(grpc.RpcError) as info:
            c.generate(prompt_ids=list(range(5, 300)), max_tokens=4)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for rid in held:
            assert stub.Release(decode_pb2.ReleaseRequest(request_id=rid), timeout=10).found
        assert not stub.Release(decode_pb2.ReleaseRequest(request_id=held[0]), timeout=10).found
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free


def test_lease_expires_when_prefill_never_delivers(cluster) -> None:
    from pdserve.v1 import common_pb2, decode_pb2

    channel, stub_cls = _decode_stub(cluster)
    with channel:
        stub = stub_cls(channel)
        resp = stub.Allocate(decode_pb2.AllocateRequest(request_id="orphan", prompt_ids=list(range(5, 60)),
                                                        sampling=common_pb2.SamplingParams(max_tokens=4),
                                                        lease_ms=2000), timeout=10)
        # Reserved (not checked through GetStats: a machine stalled past the 2 s lease would see the
        # reaper's work already done, which is what the test waits for next anyway).
        assert resp.block_ids
        stats = cluster.wait_idle(cluster.start_free)  # the reaper frees it, nobody calls Release
        assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Decode(decode_pb2.DecodeRequest(request_id="orphan", first_token_id=5), timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
