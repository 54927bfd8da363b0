import math

import pytest
import torch

from engine.sampler import Sampler, make_generator
from pdserve.sampling import SamplingParams

V = 50


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_ignores_filters():
    logits = logits_batch(6)
    out = Sampler("cpu")(logits, [SamplingParams(top_k=3, top_p=0.5)] * 6, [None] * 6)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_seed_gives_same_tokens_regardless_of_batch_mates():
    logits = logits_batch(8, seed=1)
    p = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler("cpu")

    def run_alone(steps: int) -> list[int]:
        g = make_generator(7, "cpu")
        return [sampler(logits[3:4], [p], [g]).token_ids.item() for _ in range(steps)]

    def run_in_batch(steps: int) -> list[int]:
        # Row 3 is seeded; its mates are greedy, unseeded random and differently seeded rows.
        params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=1),
                  p, SamplingParams(temperature=2.0, top_p=0.9), SamplingParams(), SamplingParams(top_k=2),
                  SamplingParams(temperature=1.0)]
        gens = [None, None, make_generator(1, "cpu"), make_generator(7, "cpu"), None, None, None, None]
        return [sampler(logits, params, gens).token_ids[3].item() for _ in range(steps)]

    alone = run_alone(30)
    assert alone == run_in_batch(30)
    assert len(set(alone)) > 3  # it really samples
    g8 = make_generator(8, "cpu")
    assert [sampler(logits[3:4], [p], [g8]).token_ids.item() for _ in range(30)] != alone


def test_top_k_restricts_support():
    logits = logits_batch(1, seed=2).repeat(200, 1)
    out = Sampler("cpu", seed=0)(logits, [SamplingParams(temperature=5.0, top_k=3)] * 200, [None] * 200)
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(out.token_ids.tolist()) == top3  # hot temperature: all three appear, nothing else


def test_top_p_restricts_support_to_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)) + 1e-9
    logits = probs.log()[None].repeat(400, 1)
    out = Sampler("cpu", seed=0)(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 400, [None] * 400)
    # 0.5 + 0.3 reaches 0.8: the nucleus is {0, 1}.
    assert set(out.token_ids.tolist()) == {0, 1}
    out = Sampler("cpu", seed=0)(logits, [SamplingParams(temperature=1.0, top_p=0.81)] * 400, [None] * 400)
    assert set(out.token_ids.tolist()) == {0, 1, 2}


def test_top_k_and_top_p_mixed_rows():
    logits = logits_batch(1, seed=3).repeat(3, 1)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=1.0, top_k=2, top_p=0.999)]
    sampler = Sampler("cpu", seed=0)
    best = logits[0].argmax().item()
    top2 = set(logits[0].topk(2).indices.tolist())
    for _ in range(20):
        toks = sampler(logits, params, [None] * 3).token_ids.tolist()
        assert toks[0] == best and toks[1] == best and toks[2] in top2


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = (probs + 1e-12).log()[None].repeat(4000, 1)
    toks = Sampler("cpu", seed=1)(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000).token_ids
    freq = torch.bincount(toks, minlength=V)[:3].float() / 4000
    assert torch.allclose(freq, probs[:3], atol=0.03), freq
    # Temperature 0.5 sharpens: p^2 normalised = [0.78, 0.2, 0.02].
    toks = Sampler("cpu", seed=1)(logits, [SamplingParams(temperature=0.5)] * 4000, [None] * 4000).token_ids
    freq = torch.bincount(toks, minlength=V)[:3].float() / 4000
    sharp = probs[:3] ** 2 / (probs[:3] ** 2).sum()
    assert torch.allclose(freq, sharp, atol=0.03), freq


def test_logprobs_of_chosen_and_top_alternatives():
    logits = logits_batch(3, seed=4)
    params = [SamplingParams(logprobs=0), SamplingParams(), SamplingParams(logprobs=4)]
    out = Sampler("cpu")(logits, params, [None] * 3)
    ref = torch.log_softmax(logits, -1)
    chosen = out.token_ids
    assert torch.allclose(out.logprobs, ref.gather(1, chosen[:, None])[:, 0])
    assert out.top_ids.shape == (3, 4)
    assert out.top_ids[2].tolist() == ref[2].topk(4).indices.tolist()
    assert math.isclose(out.top_logprobs[2, 0].item(), ref[2].max().item(), rel_tol=1e-6)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0), dict(logprobs=-1),
                                 dict(stop=("",)), dict(seed=1.5)])
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
