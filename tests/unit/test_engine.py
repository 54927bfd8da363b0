"""LLMEngine end to end on tiny random models: batching, prefix cache, chunking, KV pressure, hooks.

Every test runs twice, with synchronous steps and with decode steps launched ahead (engine.step_ahead),
and ends with a leak check (the ``make_engine`` fixture): no request left, every KV block free or in the
evictable prefix cache, every reference count zero.
"""

import random

import pytest
import torch

from engine.checkpoint import preset_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import DuplicateRequest, KVCacheFull, QueueFull, RequestTooLong, UnknownRequest
from engine.model import build_model
from pdserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(arch="llama"):
        if arch not in cache:
            cache[arch] = build_model(preset_config("tiny", arch=arch), seed=0)
        return cache[arch]

    return get


@pytest.fixture(params=[False, True], ids=["sync", "ahead"])
def make_engine(models, request, engine_factory):
    """Engines stepping synchronously, or launching decode steps ahead (engine.step_ahead): every test
    runs both ways; each engine ends with the leak check (``engine_factory``)."""

    def make(arch="llama", **overrides):
        cfg = dict(device="cpu", num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                   overlap_steps=request.param)
        return engine_factory(models(arch), **{**cfg, **overrides})

    return make


def prompts_of(lengths, seed=0, vocab=1024):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Add all requests, step to the end; request id -> list of its StepOutputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def alone(make_engine, prompt, params=GREEDY, arch="llama"):
    """Reference: the prompt alone in a fresh engine, one-shot prefill, no prefix cache."""
    engine = make_engine(arch, enable_prefix_caching=False, max_num_batched_tokens=512)
    return engine.generate([prompt], params)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_continuous_batch_matches_each_prompt_alone(make_engine, arch):
    lengths = [1, 5, 17, 33, 60, 8, 26, 3, 45, 12]
    prompts = prompts_of(lengths, seed=1)
    max_tokens = [5 + (i * 7) % 16 for i in range(len(prompts))]
    engine = make_engine(arch, max_num_batched_tokens=32)  # chunks, and prompts mixed with decodes
    got = {}
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
        if i % 3 == 2:  # staggered arrivals: new prompts join a batch that is already decoding
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert got[f"r{i}"] == alone(make_engine, p, SamplingParams(max_tokens=n, ignore_eos=True), arch), i
        assert len(got[f"r{i}"]) == n


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(make_engine):
    engine = make_engine()
    prompt, other = prompts_of([30, 11], seed=2)
    first = run(engine, {"a": (prompt, GREEDY)})["a"]
    assert first[0].num_cached_tokens == 0
    again = run(engine, {"b": (prompt, GREEDY)})["b"]
    assert again[0].num_cached_tokens == 28  # 7 full blocks; the last token is always recomputed
    assert tokens(again) == tokens(first) == alone(make_engine, prompt)
    # A prompt sharing the first 20 tokens hits 5 blocks and still matches a cold run.
    branch = prompt[:20] + other
    hit = run(engine, {"c": (branch, GREEDY)})["c"]
    assert hit[0].num_cached_tokens == 20
    assert tokens(hit) == alone(make_engine, branch)
    # Generated tokens are cached too: the whole first conversation as the next prompt hits it.
    turn2 = prompt + tokens(first) + other
    hit2 = run(engine, {"d": (turn2, GREEDY)})["d"]
    assert hit2[0].num_cached_tokens >= 40
    assert tokens(hit2) == alone(make_engine, turn2)
    assert engine.block_manager.hits > 0


def test_chunked_prefill_gives_the_same_tokens_as_one_shot(make_engine):
    prompt = prompts_of([150], seed=3)[0]
    chunked = make_engine(max_num_batched_tokens=16, max_num_seqs=4)
    got = chunked.generate([prompt], GREEDY)[0]
    assert chunked.stats.steps >= 150 // 16 + GREEDY.max_tokens - 1
    assert got == alone(make_engine, prompt)


def test_kv_pressure_queues_preempts_and_still_matches(make_engine):
    # 16 blocks of 4 tokens; each request ends up needing 6-7 blocks, so at most two run at once.
    engine = make_engine(num_blocks=16, max_num_seqs=8, max_queue=4)
    prompts = prompts_of([10, 14, 9, 12], seed=4)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    with pytest.raises(QueueFull, match="queue is full"):
        engine.add_request("overflow", prompts[0], params)
    assert engine.num_waiting == 4
    with pytest.raises(RequestTooLong, match="only 16"):
        engine.add_request("huge", prompts_of([40])[0], SamplingParams(max_tokens=40))
    got, max_waiting_while_running = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.error is None
        if engine.num_running:
            max_waiting_while_running = max(max_waiting_while_running, engine.num_waiting)
    assert max_waiting_while_running > 0  # requests really waited for KV
    assert engine.stats.preemptions > 0  # and running ones were preempted to let others grow
    for i, p in enumerate(prompts):
        assert got[f"q{i}"] == alone(make_engine, p, params), i


def test_seeded_sampling_is_independent_of_batch_mates(make_engine):
    prompt, *mates = prompts_of([9, 20, 4, 31], seed=5)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    solo = make_engine().generate([prompt], p)[0]
    engine = make_engine(max_num_batched_tokens=16)
    mixed = run(engine, {"x": (prompt, p), **{f"m{i}": (m, SamplingParams(max_tokens=10, temperature=0.8))
                                             for i, m in enumerate(mates)}})
    assert tokens(mixed["x"]) == solo
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1)
    assert make_engine().generate([prompt], other_seed)[0] != solo


def test_stop_token_ids_max_tokens_and_context_limit(make_engine):
    engine = make_engine()
    prompt = prompts_of([7], seed=6)[0]
    free = engine.generate([prompt], GREEDY)[0]
    stop_at = free[4]
    outs = run(engine, {"s": (prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))})["s"]
    assert tokens(outs) == free[:free.index(stop_at) + 1]  # the stop token is included
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert all(not o.finished for o in outs[:-1])
    # EOS stops unless ignore_eos: make the model's own next token the "eos".
    engine.eos_token_ids = frozenset({free[2]})
    assert tokens(run(engine, {"e": (prompt, SamplingParams(max_tokens=12))})["e"]) == free[:3]
    short = make_engine(max_model_len=12)
    outs = run(short, {"l": (prompt, GREEDY)})["l"]
    assert tokens(outs) == free[:5] and outs[-1].finish_reason == "length"


def test_stop_strings_cut_the_text(make_engine, models, tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_blocks=64, max_num_seqs=4,
                                    max_num_batched_tokens=64))
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox")
    free = run(engine, {"f": (prompt, SamplingParams(max_tokens=30, ignore_eos=True))})["f"]
    text = tok.decode(tokens(free))
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2]
                and "\ufffd" not in text[:i + 2])
    outs = run(engine, {"s": (prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))})["s"]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].text == text[:text.index(stop)]
    assert tokens(outs) == tokens(free)[:len(tokens(outs))] and len(tokens(outs)) < 30
    assert engine.leak_report() is None


def test_a_continuation_stops_on_a_stop_string_that_began_in_the_tokens_sent_before(tiny_llama_dir):
    """The router continues a request that lost its worker mid-stream as prompt + the k tokens already
    sent (router/migration.py). A stop string whose first characters were in those k tokens and whose
    last come from the continuation stops it where the unbroken request stopped (``stop_context``),
    and the finished text is the continuation's own."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_blocks=64, max_num_seqs=4,
                                    max_num_batched_tokens=64))
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox")
    free = tokens(run(engine, {"f": (prompt, SamplingParams(max_tokens=30, ignore_eos=True))})["f"])
    # a stop string of the last character of token j-1's text and the first of token j's, j >= 3
    cut = None
    for j in range(3, len(free) - 1):
        before, upto = tok.decode(free[:j]), tok.decode(free[:j + 1])
        if not before or len(upto) <= len(before) or not upto.startswith(before):
            continue
        stop = before[-1] + upto[len(before)]
        if stop.strip() == stop and "\ufffd" not in stop and stop not in before:
            cut = j
            break
    assert cut is not None, "no token boundary to straddle in this output"
    whole = run(engine, {"w": (prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))})["w"]
    assert tokens(whole) == free[:cut + 1] and whole[-1].finish_reason == "stop"
    sent = free[:cut]
    cont = SamplingParams(max_tokens=30 - cut, ignore_eos=True, stop=(stop,), stop_context=cut)
    outs = run(engine, {"c": (prompt + sent, cont)})["c"]
    assert tokens(outs) == [free[cut]] and outs[-1].finish_reason == "stop"
    assert outs[-1].text == ""  # the stop string began in the tokens sent before: nothing of its own
    blind = run(engine, {"b": (prompt + sent, SamplingParams(max_tokens=30 - cut, ignore_eos=True,
                                                                stop=(stop,)))})["b"]
    assert len(tokens(blind)) > 1  # without the context the straddling stop string is not seen
    assert engine.leak_report() is None


def test_logprobs(make_engine):
    engine = make_engine()
    prompt = prompts_of([6], seed=7)[0]
    outs = run(engine, {"p": (prompt, SamplingParams(max_tokens=3, logprobs=3))})["p"]
    for o in outs:
        (lp,) = o.new_logprobs
        assert lp.token_id == o.new_token_ids[0] and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the top token
        assert lp.top[0][1] == pytest.approx(lp.logprob) and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    plain = run(engine, {"q": (prompt, SamplingParams(max_tokens=2))})["q"]
    assert all(o.new_logprobs is None for o in plain)


def test_abort_at_any_stage_returns_blocks(make_engine):
    engine = make_engine(max_num_seqs=2)
    prompts = prompts_of([20, 20, 20], seed=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, GREEDY)
    engine.step()
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    assert engine.abort("a0") and engine.abort("a2")  # one running, one still queued
    assert not engine.abort("a2") and not engine.abort("nope")
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert [o.finish_reason for o in outs["a0"]] == ["abort"]
    assert [o.finish_reason for o in outs["a2"]] == ["abort"]
    assert outs["a1"][-1].finish_reason == "length"


def test_request_validation(make_engine):
    engine = make_engine(max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [1, 5000], GREEDY)
    with pytest.raises(RequestTooLong, match="context of 32"):
        engine.add_request("x", list(range(3, 35)), GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("x", [5], SamplingParams(stop=("a",)))
    engine.add_request("x", [5, 6], GREEDY)
    with pytest.raises(DuplicateRequest):
        engine.add_request("x", [5], GREEDY)
    engine.abort("x")
    engine.step()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, ignore_eos=True),
    # Seeded sampling: the first token is drawn on the prefill side, the rest on the decode side.
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.5, top_k=200, seed=1234),
], ids=["greedy", "seeded"])
def test_disaggregated_prefill_then_decode_matches_colocated(make_engine, params):
    """Prefill in one engine, copy its KV blocks into another engine's reservation, decode there."""
    prefill = make_engine(num_blocks=64)
    decode = make_engine(num_blocks=64)
    prompt, suffix = prompts_of([23, 9], seed=9)
    expected = alone(make_engine, prompt, params)

    def disaggregated(rid, prompt):
        prefill.add_prefill_request(rid, prompt, params)
        outs = []
        while prefill.has_unfinished():
            outs += prefill.step()
        (first,) = outs
        assert first.finished and first.finish_reason == "prefilled" and len(first.new_token_ids) == 1
        src = prefill.block_table(rid)
        assert len(src) == -(-len(prompt) // 4)
        assert first.block_ids == src  # the output carries the pinned table (no second engine call)
        res = decode.reserve(rid, prompt, params)
        assert len(res.block_ids) == len(src) and res.num_cached_tokens % 4 == 0
        skip = res.num_cached_tokens // 4  # only the blocks the decode side lacks travel
        with torch.no_grad():
            decode.kv_cache[:, res.block_ids[skip:]] = prefill.kv_cache[:, src[skip:]]
        prefill.release(rid)
        prefill.release(rid)  # idempotent
        decode.commit_prefilled(rid, first.new_token_ids[0])
        rest = []
        while decode.has_unfinished():
            rest += [t for o in decode.step() for t in o.new_token_ids]
        return first, res, [first.new_token_ids[0]] + rest

    first, res, got = disaggregated("d1", prompt)
    assert got == expected and res.num_cached_tokens == 0
    # Second turn on the same prefix: both sides hit their prefix caches.
    turn2 = prompt + suffix
    first, res, got = disaggregated("d2", turn2)
    assert first.num_cached_tokens == 20 and res.num_cached_tokens == 20
    assert got == alone(make_engine, turn2, params)

    decode.reserve("hold", list(range(3, 3 + 4 * 50)), params)  # 50 of the 64 blocks
    with pytest.raises(KVCacheFull, match="cannot reserve 20 KV blocks"):
        decode.reserve("big", list(range(3, 3 + 4 * 20)), params)
    decode.release("hold")
    with pytest.raises(RequestTooLong):
        decode.reserve("never", list(range(3, 3 + 4 * 70)), params)
    with pytest.raises(UnknownRequest):
        decode.commit_prefilled("never-reserved", 5)
    res = decode.reserve("r", prompt, SamplingParams(max_tokens=1))
    decode.commit_prefilled("r", 7)  # max_tokens=1: the first token finishes it
    (out,) = decode.step()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    decode.reserve("dropped", prompt, params)
    decode.release("dropped")  # a reservation dropped before KV arrives


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_cpu(make_engine, models):
    prompts = prompts_of([3, 40, 17, 64], seed=10)
    cpu = make_engine().generate(prompts, GREEDY)
    gpu = LLMEngine(EngineConfig(device="cuda", num_blocks=256, block_size=16, max_num_batched_tokens=64),
                    model=build_model(preset_config("tiny"), seed=0, device="cuda"))
    assert gpu.generate(prompts, GREEDY) == cpu
    assert gpu.leak_report() is None
