"""When a request is finished: the generated token goes in, then its grammar's end, EOS, stop tokens, stop
strings, length.

One rule for every path that adds a token (a synchronous step, a step launched ahead whose token fills a
placeholder, the first token a prefill worker sampled for a decode worker's commit).
"""

from __future__ import annotations

from engine.sequence import Sequence


def append_token(seq: Sequence, token: int, *, eos_token_ids: frozenset[int], max_model_len: int) -> None:
    """Add a generated token (into its placeholder when a step launched ahead already holds its place,
    engine.step_ahead) and decide whether the request is finished (sets ``finish_reason``)."""
    if seq.pending_slot is None:
        seq.tokens.append(token)
        count = seq.num_tokens
    else:
        count = seq.pending_slot + 1
        seq.tokens[seq.pending_slot] = token
        seq.pending_slot = None
    p = seq.params
    if seq.grammar is not None and _grammar_ends(seq, token):
        return
    if (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids:
        seq.finish_reason = "stop"
    elif seq.decoder is not None and _hit_stop_string(seq, seq.decoder.push(token)):
        seq.finish_reason = "stop"
    elif count - seq.num_prompt_tokens >= p.max_tokens or count >= max_model_len:
        seq.finish_reason = "length"


def _hit_stop_string(seq: Sequence, delta: str) -> bool:
    """Add ``delta`` to the text; True (the text cut before the stop string) when a stop string appears."""
    if not delta:
        return False
    start = max(0, len(seq.text) - max(len(s) for s in seq.params.stop) + 1)
    seq.text += delta
    hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
    if hits:
        seq.text = seq.text[:min(hits)]
        return True
    return False


def _grammar_ends(seq: Sequence, token: int) -> bool:
    """Feed the token to the request's grammar (engine.grammar); True when that finishes the request: the
    answer is complete ("stop"), or the grammar refused the token ("error": only a token sampled without
    its mask could be, and the request must not go on outside its constraint)."""
    from engine.grammar.spec import GrammarError

    try:
        done = seq.grammar.accept(token)
    except GrammarError as exc:
        seq.error, seq.invalid = str(exc), True
        seq.finish_reason = "error"
        return True
    if done:
        seq.finish_reason = "stop"
    return done
