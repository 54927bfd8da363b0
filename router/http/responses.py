"""The router's response messages → OpenAI response objects and stream chunks.

One ``Collector`` per request: it reads the ``GenerateResponse`` messages the shared path produces
(text deltas already detokenized and cut at stop strings, logprobs, the final path report) and
shapes them as a completion or a chat completion, whole or as chunks. The final message's
serving metadata (workers, transport, KV blocks and bytes, cached tokens, the TTFT stages) goes
into the ``pdserve`` extension field of the last object, and into ``x-pdserve-*`` headers of a
non-streamed answer, so HTTP users see what ``FinalInfo`` tells gRPC users.
"""

from __future__ import annotations

import time

from pdserve.v1 import router_pb2
from pdserve.wire import report, top_pairs

# FinalInfo fields also sent as x-pdserve-<name> headers on a non-streamed answer
HEADER_FIELDS = ("prefill_worker", "decode_worker", "transport", "kv_bytes_sent", "prefill_mode")


def path_report(final: router_pb2.FinalInfo) -> dict:
    """FinalInfo as plain JSON (usage is reported in OpenAI's own field)."""
    out = report(final)
    del out["usage"]
    return out


def report_headers(report: dict, usage: dict) -> dict[str, str]:
    out = {f"x-pdserve-{name.replace('_', '-')}": str(report[name]) for name in HEADER_FIELDS}
    out["x-pdserve-cached-tokens"] = str(usage["prompt_tokens_details"]["cached_tokens"])
    return out


class Collector:
    def __init__(self, *, kind: str, request_id: str, model: str, tokenizer: object | None,
                 logprobs: bool, include_usage: bool = False, return_token_ids: bool = False) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.token_logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []  # each token's alternatives (logprobs > 0)
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.report: dict | None = None
        self._text_offset = 0

    # ---- reading the router's messages ------------------------------------------------------------
    def add(self, msg: router_pb2.GenerateResponse) -> None:
        self.text.append(msg.text)
        self.token_ids.extend(msg.token_ids)
        self.token_logprobs.extend(msg.logprobs)
        self.top.extend(top_pairs(t) for t in msg.top_logprobs)
        if msg.HasField("final"):
            f = msg.final
            self.finish_reason = f.finish_reason
            u = f.usage
            self.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                          "total_tokens": u.prompt_tokens + u.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
            self.report = path_report(f)

    # ---- whole answers ----------------------------------------------------------------------------
    def response(self) -> dict:
        text = "".join(self.text)
        lps = self._logprobs(self.token_ids, self.token_logprobs, self.top) if self.logprobs else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                      "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": self.finish_reason}
            obj = "text_completion"
        if self.return_token_ids:
            choice["token_ids"] = self.token_ids
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage, "pdserve": self.report}

    # ---- stream chunks ----------------------------------------------------------------------------
    def first_chunk(self) -> dict | None:
        """Chat opens with the assistant's role (OpenAI's first delta); completions need no opener."""
        return self._chunk({"role": "assistant", "content": ""}, None) if self.chat else None

    def chunk(self, msg: router_pb2.GenerateResponse) -> list[dict]:
        """The chunks for one router message: its text (if any), then the final ones."""
        self.add(msg)
        out = []
        lps = (self._logprobs(list(msg.token_ids), list(msg.logprobs),
                              [top_pairs(t) for t in msg.top_logprobs])
               if self.logprobs and msg.token_ids else None)
        final = msg.HasField("final")
        if msg.text or lps or (self.return_token_ids and msg.token_ids):
            delta = {"content": msg.text} if self.chat else msg.text
            out.append(self._chunk(delta, None, lps))
            if self.return_token_ids:
                out[-1]["choices"][0]["token_ids"] = list(msg.token_ids)
        if final:
            last = self._chunk({} if self.chat else "", self.finish_reason)
            last["pdserve"] = self.report
            out.append(last)
            if self.include_usage:
                out.append({"id": self.id, "object": self._chunk_object(), "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage})
        return out

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, delta, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        choice = ({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
                  if self.chat else
                  {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        out = {"id": self.id, "object": self._chunk_object(), "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    # ---- logprobs ---------------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, ids: list[int], lps: list[float], top: list[list[tuple[int, float]]]) -> dict:
        """OpenAI's logprobs object for ``ids``; ``top``: each token's alternatives, or empty when none
        were asked (chat then gives empty lists, completions ``top_logprobs: null``)."""
        tokens = [self._token_text(t) for t in ids]
        alts = [[(self._token_text(t), lp) for t, lp in pairs] for pairs in top]
        if self.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                 "top_logprobs": [{"token": t, "logprob": a, "bytes": list(t.encode())}
                                                  for t, a in (alts[i] if i < len(alts) else ())]}
                                for i, (tok, lp) in enumerate(zip(tokens, lps, strict=False))]}
        offsets = []
        for tok in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(tok)
        top_dicts = None
        if alts:  # OpenAI: the sampled token is always there too (so up to logprobs + 1 entries)
            top_dicts = [{} for _ in alts]
            for d, pairs in zip(top_dicts, alts, strict=True):
                for t, a in pairs:  # two ids of one text: the likelier one's value
                    d.setdefault(t, a)
            for d, tok, lp in zip(top_dicts, tokens, lps, strict=False):
                d.setdefault(tok, lp)
        return {"tokens": tokens, "token_logprobs": lps[:len(tokens)], "top_logprobs": top_dicts,
                "text_offset": offsets}
