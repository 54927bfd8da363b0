"""What a request must satisfy before an engine queues it. Each failure raises with a message a person can
act on: ``ValueError``, or ``RequestTooLong`` (a ValueError too) when it can never fit the context or the
cache; the services map both to INVALID_ARGUMENT (engine.errors)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.errors import RequestTooLong
from pdserve.sampling import SamplingParams


def checked_prompt(prompt_ids: Seq[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                   has_tokenizer: bool, block_size: int, total_blocks: int, prefill_only: bool) -> list[int]:
    """The prompt as a list of ints, once it fits the vocabulary, the context and the whole KV cache;
    raises ValueError or RequestTooLong otherwise."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise RequestTooLong(f"prompt of {len(prompt)} tokens does not fit the model's context of "
                             f"{max_model_len} tokens (at least one token must be generated)")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; this model directory has no tokenizer.json")
    params.check_vocab(vocab_size)
    if params.seed_draws >= max_model_len:  # a longer skip is no stream this request resumes
        raise ValueError(f"seed_draws {params.seed_draws} must be below the context of {max_model_len}")
    total = min(len(prompt) + (1 if prefill_only else params.max_tokens), max_model_len)
    need = -(-total // block_size)
    if need > total_blocks:
        raise RequestTooLong(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs "
                             f"{need} KV blocks of {block_size} tokens; the cache has only {total_blocks}")
    return prompt
