"""A TP-2 worker on two GPUs (NCCL ranks, rank 1 a child process as ``pdserve serve`` runs it): steps
launched ahead equal synchronous steps token for token, and the one-shot all-reduce over symmetric
memory (``PDSERVE_TP_ALLREDUCE=symm``) sets up and gives the same tokens as NCCL. These need two GPUs;
on a one-GPU machine they skip and say so (``bash bench/device_run.sh tests`` on a two-GPU lease runs
them)."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_gpu import _drive

from engine.engine import EngineConfig, LLMEngine
from pdserve.app.tp_ranks import rank_device, start_ranks
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="tensor parallelism on GPUs needs two of them (NCCL ranks)")


DEVICE = "cuda"  # the ranks' device setting ("cpu" runs the same path over gloo, to check the test itself)


def _generate(path, *, overlap_steps: bool) -> tuple[dict, str]:
    """Greedy and seeded requests that stop by length (the same batches either way) through a TP-2
    engine; returns (request id -> (tokens, finish reason, logprobs)), the group's all-reduce mode)."""
    config = EngineConfig(model=str(path), device=rank_device(DEVICE, 0), num_blocks=256, max_num_seqs=8,
                          max_num_batched_tokens=512, enable_prefix_caching=False,
                          overlap_steps=overlap_steps)
    ranks = start_ranks(config, 2)
    try:
        engine = LLMEngine(config, tp=ranks.group)
        try:
            g = random.Random(5)
            vocab = engine.model_config.vocab_size
            prompts = [[g.randrange(3, vocab) for _ in range(n)] for n in (5, 33, 80, 17)]
            requests = {f"g{i}": (p, SamplingParams(max_tokens=10 + 4 * i, logprobs=1, ignore_eos=True))
                        for i, p in enumerate(prompts)}
            requests["s"] = (prompts[1], SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=3,
                                                        logprobs=1, ignore_eos=True))
            out = _drive(engine, requests)  # id -> (tokens, finish reason, logprobs); leak-checked
            return out, ranks.group.allreduce_mode
        finally:
            engine.close()
    finally:
        ranks.stop()


def test_tp2_steps_launched_ahead_equal_synchronous_steps(make_checkpoint):
    path = make_checkpoint(preset="small", dtype="bfloat16")
    sync, mode = _generate(path, overlap_steps=False)
    ahead, _ = _generate(path, overlap_steps=True)
    assert mode == "nccl"
    assert ahead == sync
    assert [len(sync[f"g{i}"][0]) for i in range(4)] == [10, 14, 18, 22]


def test_tp2_one_shot_allreduce_sets_up_and_equals_nccl(make_checkpoint, monkeypatch):
    path = make_checkpoint(preset="small", dtype="bfloat16")
    nccl, _ = _generate(path, overlap_steps=False)
    monkeypatch.setenv("PDSERVE_TP_ALLREDUCE", "symm")  # the child rank inherits it
    symm, mode = _generate(path, overlap_steps=False)
    assert mode.startswith("symm"), mode  # set up and checked on both ranks, not fallen back to NCCL
    assert symm == nccl  # two ranks: either way one rounding of a + b
