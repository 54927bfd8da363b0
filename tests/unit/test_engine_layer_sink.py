"""Layer sinks (engine.layer_sink): which step reports a prefill request's layers, in which order, and
what preemption / abort tell the sink. Every test ends with the engine's leak check."""

import random

import pytest
import torch

import engine.model_runner as model_runner
from engine.checkpoint import preset_config
from engine.engine import EngineConfig, LLMEngine
from engine.model import build_model
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")
PARAMS = SamplingParams(max_tokens=1)


class RecordingSink:
    """Records what it is told; on every layer checks that layer's KV of the last prompt token is
    written already and the next layer's is not (so "ready" means computed, not merely issued)."""

    def __init__(self, engine, step_box, prompt_len):
        self.engine, self.step_box, self.prompt_len = engine, step_box, prompt_len
        self.calls, self.table = [], None

    def begin(self, block_table):
        self.table = list(block_table)
        self.calls.append(("begin", self.step_box[0], tuple(block_table)))

    def layer_ready(self, layer, event):
        assert event is None  # CPU: synchronous
        bs = self.engine.config.block_size
        pos = self.prompt_len - 1
        block, off = self.table[pos // bs], pos % bs
        kv = self.engine.kv_cache
        assert kv[layer, block, :, off].abs().sum() > 0
        if layer + 1 < kv.shape[0]:
            assert kv[layer + 1, block, :, off].abs().sum() == 0
        self.calls.append(("layer", self.step_box[0], layer))

    def abort(self, reason):
        self.calls.append(("abort", self.step_box[0], reason))


@pytest.fixture(scope="module")
def model():
    return build_model(preset_config("tiny"), seed=0)


@pytest.fixture
def make_engine(model):
    engines = []

    def make(**overrides):
        cfg = dict(device="cpu", num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
        cfg.update(overrides)
        engines.append(LLMEngine(EngineConfig(**cfg), model=model))
        return engines[-1]

    yield make
    for e in engines:
        assert e.leak_report() is None, e.leak_report()


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def drive(engine, step_box, rids):
    """Step to the end; rid -> (step of its "prefilled" output, first token). Releases them."""
    done = {}
    while engine.has_unfinished():
        step_box[0] += 1
        for out in engine.step():
            if out.request_id in rids and out.finished:
                done[out.request_id] = (step_box[0], out.finish_reason, out.new_token_ids)
    tables = {rid: engine.block_table(rid) for rid, d in done.items() if d[1] == "prefilled"}
    for rid in rids:
        engine.release(rid)
    return done, tables


def test_layers_in_order_once_in_the_final_chunk_only(make_engine):
    ref = make_engine()
    eng = make_engine()
    lengths = [20, 30, 150, 9]  # 150 > the 64-token budget: chunked over four steps
    prompts = prompts_of(lengths)
    want = {f"r{i}": ref.generate([p], PARAMS)[0] for i, p in enumerate(prompts)}
    step, sinks = [0], {}
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        if i != 3:  # r3 has no sink: it must not be told anything, nor slow anyone down
            sinks[rid] = RecordingSink(eng, step, len(p))
        eng.add_prefill_request(rid, p, PARAMS, layer_sink=sinks.get(rid))
    done, tables = drive(eng, step, list(want))
    layers = eng.model_config.num_layers
    finals = set()
    for rid, sink in sinks.items():
        final_step, reason, tokens = done[rid]
        assert reason == "prefilled" and tokens == want[rid]
        assert sink.calls == [("begin", final_step, tuple(tables[rid]))] + [
            ("layer", final_step, i) for i in range(layers)]
        finals.add(final_step)
    assert done["r3"][2] == want["r3"]
    assert len(finals) < len(sinks)  # several sink requests were told within one step
    assert done["r2"][0] >= 3  # the chunked prompt's earlier chunks reported nothing


def test_one_token_final_chunk_after_a_prefix_hit_reports_every_layer(make_engine):
    eng = make_engine()
    prompt = prompts_of([32])[0]
    step = [0]
    eng.add_prefill_request("warm", prompt, PARAMS)
    drive(eng, step, ["warm"])
    sink = RecordingSink(eng, step, len(prompt))
    eng.add_prefill_request("hit", prompt, PARAMS, layer_sink=sink)  # 16 cached: final chunk = 16..31
    done, tables = drive(eng, step, ["hit"])
    assert [c[0] for c in sink.calls] == ["begin"] + ["layer"] * eng.model_config.num_layers
    assert done["hit"][1] == "prefilled" and sink.table == tables["hit"]


def test_no_sink_no_callback(make_engine, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a callback was built for a step without sinks")

    monkeypatch.setattr(model_runner, "layer_callback", boom)
    eng = make_engine()
    step = [0]
    for i, p in enumerate(prompts_of([5, 70])):
        eng.add_prefill_request(f"p{i}", p, PARAMS)
    eng.add_request("g", prompts_of([12], seed=1)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    done, _ = drive(eng, step, ["p0", "p1", "g"])
    assert done["p1"][1] == "prefilled" and done["g"][1] == "length"


def test_abort_between_chunks_tells_the_sink(make_engine):
    eng = make_engine()
    step = [0]
    prompt = prompts_of([200])[0]
    sink = RecordingSink(eng, step, len(prompt))
    eng.add_prefill_request("a", prompt, PARAMS, layer_sink=sink)
    step[0] += 1
    assert eng.step() == []  # first chunk only
    eng.abort("a")
    assert sink.calls == [("abort", 1, "aborted")]
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert sink.calls == [("abort", 1, "aborted")]  # nothing after


def test_preempted_prefill_tells_the_sink_and_recomputes_without_it(make_engine):
    # 7 blocks of 16: a generating request grows into the prefill request's blocks mid-prompt, so
    # the newest running request (the prefill) is preempted and recomputed later.
    eng = make_engine(num_blocks=7, max_num_batched_tokens=4, max_num_seqs=4)
    ref = make_engine()
    gen_prompt, prompt = prompts_of([30, 62], seed=3)
    want = ref.generate([prompt], PARAMS)[0]
    step = [0]
    eng.add_request("g", gen_prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    eng.step()  # g admitted first (8 of its 30 tokens)
    sink = RecordingSink(eng, step, len(prompt))
    eng.add_prefill_request("p", prompt, PARAMS, layer_sink=sink)
    done, _ = drive(eng, step, ["g", "p"])
    assert eng.stats.preemptions >= 1
    assert [c[0] for c in sink.calls] == ["abort"] and sink.calls[0][2] == "preempted"
    assert done["p"][1] == "prefilled" and done["p"][2] == want


def test_callback_tells_every_sink_one_event_per_layer():
    from engine.layer_sink import layer_callback

    got = []

    class Sink:
        def layer_ready(self, i, ev):
            got.append((i, ev))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cb = layer_callback([Sink(), Sink()], device)
    cb(0)
    cb(1)
    assert [i for i, _ in got] == [0, 0, 1, 1]
    if device.type == "cpu":
        assert all(ev is None for _, ev in got)
    else:  # one event per layer, shared by the step's sinks
        assert got[0][1] is got[1][1] and got[0][1] is not got[2][1]
        got[-1][1].synchronize()
