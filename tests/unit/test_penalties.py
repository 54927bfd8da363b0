"""Penalties and logit bias (engine.penalties): the sampler's arithmetic against a plain reference,
and greedy generation through one continuous batch against ``transformers`` on the same weights
(``repetition_penalty`` and ``sequence_bias`` are its own; OpenAI's presence / frequency penalties as
a logits processor written from their definition), mixed with unpenalized requests in the same
batch; a continuation and a prefilled-elsewhere first token count as generated; bad values refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from engine.engine import EngineConfig, LLMEngine
from engine.penalties import PenaltyState
from engine.sampler import Sampler
from pdserve.sampling import SamplingParams

V = 50


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int]):
    """vLLM's order: bias, repetition (prompt + generated), frequency and presence (generated)."""
    out = logits.clone()
    for t, b in params.logit_bias:
        out[t] += b
    for t in set(prompt) | set(generated):
        r = params.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(generated):
        out[t] -= params.frequency_penalty * generated.count(t) + params.presence_penalty
    return out


def test_penalties_match_the_reference_row_by_row() -> None:
    torch.manual_seed(0)
    sampler = Sampler("cpu", seed=0)
    cases = [
        (SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), [1, 2, 3], [4, 4, 5]),
        (SamplingParams(repetition_penalty=1.3), [6, 7, 7], [8]),
        (SamplingParams(logit_bias={9: 5.0, 10: -100.0}), [1], []),
        (SamplingParams(presence_penalty=-1.0, repetition_penalty=0.8, logit_bias={3: 2.0}), [3, 4],
         [4, 3, 3]),
        (SamplingParams(), [1, 2], [3]),  # unpenalized in the same batch
    ]
    logits = torch.randn(len(cases), V) * 3
    states = []
    for params, prompt, generated in cases:
        state = (PenaltyState(params, prompt + generated, generated=len(generated), vocab_size=V,
                              device=torch.device("cpu")) if params.penalized else None)
        states.append(state)
    from engine.penalties import penalized_logits

    rows = [i for i, s in enumerate(states) if s is not None]
    got = penalized_logits(logits, rows, [states[i] for i in rows])
    for i, (params, prompt, generated) in enumerate(cases):
        torch.testing.assert_close(got[i], reference(logits[i], params, prompt, generated))
    # greedy picks come from the penalized logits, and each pick is counted
    out = sampler(logits, [c[0] for c in cases], [None] * len(cases), states)
    assert out.token_ids.tolist() == got.argmax(-1).tolist()
    assert states[0].counts[out.token_ids[0]].item() == 1 + [4, 4, 5].count(out.token_ids[0].item())
    assert states[1].seen[out.token_ids[1]].item()
    # log-probabilities are the model's own (raw logits), not the penalized ones
    lp = sampler(logits[:1], [SamplingParams(logit_bias={0: 50.0}, logprobs=0)], [None],
                 [PenaltyState(SamplingParams(logit_bias={0: 50.0}), [1], generated=0, vocab_size=V,
                               device=torch.device("cpu"))])
    assert lp.token_ids.tolist() == [0]
    torch.testing.assert_close(lp.logprobs[0], torch.log_softmax(logits[0], -1)[0])


def test_a_bias_of_minus_100_bans_a_token_when_sampling() -> None:
    sampler = Sampler("cpu", seed=3)
    logits = torch.zeros(64, V)
    logits[:, 7] = 4.0  # the likeliest token everywhere
    params = [SamplingParams(temperature=1.0, logit_bias={7: -100.0})] * 64
    states = [PenaltyState(params[0], [1], generated=0, vocab_size=V, device=torch.device("cpu"))
              for _ in range(64)]
    assert 7 not in sampler(logits, params, [None] * 64, states).token_ids.tolist()


class OpenAIPenalties(LogitsProcessor):
    """presence / frequency penalties on the generated tokens, from OpenAI's definition."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for t in set(ids):
                scores[row, t] -= self.frequency * ids.count(t) + self.presence
        return scores


def hf_generate(model, prompt: list[int], params: SamplingParams) -> list[int]:
    kw = {}
    if params.repetition_penalty != 1.0:
        kw["repetition_penalty"] = params.repetition_penalty
    if params.logit_bias:
        kw["sequence_bias"] = {(t,): b for t, b in params.logit_bias}
    procs = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty))
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=params.max_tokens, do_sample=False, pad_token_id=1,
                         logits_processor=procs, **kw)
    return out[0, len(prompt):].tolist()


PENALIZED = [
    SamplingParams(max_tokens=14, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(max_tokens=14, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(max_tokens=14, ignore_eos=True, presence_penalty=1.8),
    SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={5: 8.0, 11: -100.0, 300: 3.5}),
    SamplingParams(max_tokens=10, ignore_eos=True),
]


def test_greedy_with_penalties_matches_transformers(make_checkpoint) -> None:
    """One continuous batch mixing every penalty with an unpenalized request: each answer equals
    transformers' greedy generate() with the same penalty; without penalties the same prompts differ
    (so each penalty really acted); no block is leaked."""
    path = make_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, num_blocks=200,
                                    max_num_seqs=8, max_num_batched_tokens=32, attention_backend="torch"))
    prompts = [[(7 * i + 3 * k) % 400 + 2 for k in range(6 + 3 * i)] for i in range(len(PENALIZED))]
    ours = engine.generate(prompts, PENALIZED)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for i, (prompt, params) in enumerate(zip(prompts, PENALIZED, strict=True)):
            assert ours[i] == hf_generate(ref, prompt, params), f"request {i}: {params}"
    plain = engine.generate(prompts[:4], [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True)
                                          for p in PENALIZED[:4]])
    assert all(p != o for p, o in zip(plain, ours[:4], strict=True))
    assert 5 in ours[3] and 11 not in ours[3]
    assert engine.leak_report() is None and engine.num_free_blocks == engine.num_total_blocks


def test_continuations_count_their_earlier_tokens(make_checkpoint) -> None:
    """A request continued from k generated tokens (prompt + those tokens, stop_context k: the router's
    migration) continues exactly as the uninterrupted request (the decode side of a disaggregated
    request is the cluster tests' part: tests/integration/test_penalties_cluster.py)."""
    path = make_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, num_blocks=120,
                                    attention_backend="torch"))
    prompt = [3, 9, 27, 81, 243, 100, 7]
    params = SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                            repetition_penalty=1.2)
    [whole] = engine.generate([prompt], params)
    k = 5
    cont = SamplingParams(max_tokens=12 - k, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                          repetition_penalty=1.2, stop_context=k)
    assert engine.generate([prompt + whole[:k]], cont)[0] == whole[k:]
    # what made that so: the continuation's state counts the k earlier tokens as generated
    state = PenaltyState(cont, prompt + whole[:k], generated=k, vocab_size=engine.model_config.vocab_size,
                         device=torch.device("cpu"))
    assert state.counts.sum().item() == k and all(state.counts[t] >= 1 for t in whole[:k])
    assert all(state.seen[t] for t in prompt + whole[:k])
    # a decode worker's reservation holds no state until it samples (its memory is a running request's)
    engine.reserve("waiting", prompt, params)
    assert engine._get("waiting").penalties is None
    engine.release("waiting")
    assert engine.leak_report() is None


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
    (dict(logit_bias={3: 101.0}), "logit_bias values"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "at most 1024"),
])
def test_bad_penalties_are_refused(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_bias_outside_the_vocabulary_is_refused(make_checkpoint) -> None:
    path = make_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", num_blocks=16, attention_backend="torch"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [1, 2], SamplingParams(logit_bias={engine.model_config.vocab_size: 1.0}))
    assert engine.leak_report() is None
