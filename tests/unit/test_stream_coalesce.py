"""Token coalescing on the decode stream: a consumer slower than the engine gets every token that is
ready in one message, with the same tokens in the same order as one token per message, and the
finishing output last; nothing stays held. The slow consumer is made deterministic: after its first
message it waits until the engine has finished the request, so everything else is ready at once."""

import asyncio
import itertools

import pytest

from decode_service.service import DecodeServicer
from decode_service.worker import DecodeWorker
from engine.async_engine import AsyncEngine
from engine.checkpoint import preset_config
from engine.engine import EngineConfig, LLMEngine
from engine.model import build_model
from pdserve.sampling import SamplingParams
from pdserve.v1 import decode_pb2

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_single_thread")]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]]


def engine() -> LLMEngine:
    cfg = EngineConfig(device="cpu", num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                       attention_backend="torch")
    return LLMEngine(cfg, model=build_model(preset_config("tiny"), seed=0))


class NoKV:
    """The KV adapter of a worker that prefills locally (nothing is pushed to it)."""

    def endpoint(self) -> bytes:
        return b""

    def expect(self, rid, blocks):
        return None

    def release(self, rid):
        return None


async def engine_done(ae: AsyncEngine, rid: str) -> None:
    """Until the engine thread has handed over ``rid``'s finishing output (its stream is dropped)."""
    while await ae.call(lambda e: rid in ae._streams):
        await asyncio.sleep(0.01)


async def reference(prompt: list[int]) -> list[int]:
    ae = AsyncEngine(engine())
    ae.start()
    try:
        return [t async for out in ae.generate("ref", prompt, PARAMS) for t in out.new_token_ids]
    finally:
        await ae.stop()


def test_slow_consumer_gets_ready_tokens_together_token_exact():
    async def main():
        want = [await reference(p) for p in PROMPTS]
        ae = AsyncEngine(engine())
        ae.start()
        try:
            async def consume(i: int, prompt: list[int]) -> list[list]:
                batches = []
                async for outs in ae.generate_ready(f"r{i}", prompt, PARAMS):
                    batches.append(outs)
                    await engine_done(ae, f"r{i}")  # a busy relay: the engine runs ahead meanwhile
                return batches

            got = await asyncio.gather(*(consume(i, p) for i, p in enumerate(PROMPTS)))
            for batches, ref in zip(got, want, strict=True):
                assert [t for outs in batches for out in outs for t in out.new_token_ids] == ref
                assert len(batches) == 2  # the first token(s), then all the rest in one
                flat = [out for outs in batches for out in outs]
                assert flat[-1].finished and not any(o.finished for o in flat[:-1])
            assert ae.engine.num_free_blocks == ae.engine.num_total_blocks
        finally:
            await ae.stop()

    asyncio.run(main())


async def servicer_stream(prompt: list[int], check, **servicer_kw) -> list:
    """One local-prefill Decode stream of ``prompt`` through a DecodeServicer on a fresh engine:
    ``check(ae, messages_so_far)`` runs after each message arrives; then the tokens must equal one
    engine's, the finish come last, and every block, lease and stream be given back."""
    want = await reference(prompt)
    ae = AsyncEngine(engine())
    ae.start()
    worker = DecodeWorker(engine=ae, kv=NoKV(), worker_id="d0", block_size=16)
    servicer = DecodeServicer(worker, address="127.0.0.1:0", transports=["tcp"], **servicer_kw)
    try:
        await worker.allocate("r", prompt, PARAMS)
        msgs = []
        async for msg in servicer.Decode(decode_pb2.DecodeRequest(request_id="r", prefill_locally=True),
                                         context=None):
            msgs.append(msg)
            await check(ae, msgs)
        assert [t for m in msgs for t in m.token_ids] == want
        assert msgs[-1].finish_reason == "length" and not any(m.finish_reason for m in msgs[:-1])
        assert msgs[-1].completion_tokens == len(want)
        await asyncio.sleep(0.1)
        assert ae.engine.num_free_blocks == ae.engine.num_total_blocks
        assert not worker.leases.ids() and not worker.active
        return msgs
    finally:
        await ae.stop()


def test_decode_servicer_messages_carry_several_tokens_token_exact():
    async def slow(ae, msgs):
        await engine_done(ae, "r")  # a busy relay: the engine runs ahead meanwhile

    msgs = asyncio.run(servicer_stream(PROMPTS[1], slow))
    assert len(msgs) == 2


def test_stream_interval_sends_tokens_n_at_a_time_token_exact():
    # A consumer as fast as the engine: with --stream-interval 5 every message but the first (the
    # stream's first token, sent at once) and the last (the finish) carries at least 5 tokens.
    async def fast(ae, msgs):
        return None

    msgs = asyncio.run(servicer_stream(PROMPTS[0], fast, stream_interval=5))
    assert len(msgs[0].token_ids) >= 1 and all(len(m.token_ids) >= 5 for m in msgs[1:-1])
    assert [m.completion_tokens for m in msgs] == list(itertools.accumulate(len(m.token_ids) for m in msgs))
    with pytest.raises(ValueError):
        DecodeServicer(None, address="127.0.0.1:0", transports=[], stream_interval=0)
