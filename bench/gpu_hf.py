"""Single-request decode: pdserve's decode path against ``transformers`` ``generate``, same weights.

pdserve's side is what the engine runs for one request: graph replay of the forward (flashinfer
decode), lm_head, argmax and one host sync per token. transformers' side is ``generate`` (greedy,
its default attention) with the very same parameter tensors (``load_state_dict(assign=True)``).
"""

from __future__ import annotations

import time

import torch

from engine.attention import backend_geometry
from engine.attention.base import BatchSpec
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.cuda_graphs import CudaGraphConfig, DecodeGraphRunner
from engine.kv_layout import KVLayout
from engine.model import CausalLM

BLOCK = 16


@torch.inference_mode()
def vs_transformers(model: CausalLM, cfg, prompt_len: int = 128, new: int = 128) -> dict:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig.from_dict(cfg.to_hf_dict())
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    missing, unexpected = hf.load_state_dict(model.state_dict(), assign=True, strict=False)  # share tensors
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    hf = hf.eval()
    torch.cuda.empty_cache()
    prompt = torch.randint(3, cfg.vocab_size, (1, prompt_len), device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(4)  # warm-up
    hf_s = min(gen(new + 1) - gen(1) for _ in range(2))
    hf_tps = new / hf_s
    # pdserve: the decode path the engine runs for one request (graph replay + lm_head + argmax + sync).
    layout = KVLayout.for_model(cfg, block_size=BLOCK, dtype="bfloat16", memory="cuda")
    n_blocks = -(-(prompt_len + new + 1) // BLOCK)
    kv = layout.allocate(n_blocks + 1, device="cuda")
    kw = dict(backend_geometry(cfg, block_size=BLOCK), device="cuda", dtype=torch.bfloat16)
    backend = FlashInferAttentionBackend(**kw)
    runner = DecodeGraphRunner(
        model, backend, kv, CudaGraphConfig(max_batch=1, max_model_len=n_blocks * BLOCK, buckets=(1,))
    )
    runner.capture()
    table = list(range(1, n_blocks + 1))
    with torch.inference_mode():
        pre = BatchSpec(query_lens=[prompt_len], context_lens=[0], block_tables=[table])
        meta = backend.plan(pre)
        tok = int(model.compute_logits(model(prompt[0], meta.positions, kv, meta)[-1:]).argmax())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(new):
            spec = BatchSpec(query_lens=[1], context_lens=[prompt_len + i], block_tables=[table])
            tok = int(model.compute_logits(runner.run([tok], spec)).argmax())
        ours_s = time.perf_counter() - t0
    ours_tps = new / ours_s
    print(
        f"  single request decode: pdserve {ours_tps:.1f} tok/s, transformers {hf_tps:.1f} tok/s "
        f"({ours_tps / hf_tps:.2f}x)",
        flush=True,
    )
    return {
        "prompt_len": prompt_len,
        "new_tokens": new,
        "pdserve_tokens_per_s": ours_tps,
        "transformers_tokens_per_s": hf_tps,
        "ratio_pdserve_over_transformers": ours_tps / hf_tps,
        "transformers_version": transformers.__version__,
        "transformers_attn": getattr(hf.config, "_attn_implementation", "?"),
        "pdserve_path": "flashinfer decode + CUDA graph replay, lm_head + argmax, one sync per token",
    }
