"""The router's response messages → OpenAI response objects and stream chunks.

One ``Collector`` per choice: it reads the ``GenerateResponse`` messages the shared path produces
for one router request (text deltas already detokenized and cut at stop strings, logprobs, the final
path report) and shapes them as a completion or a chat completion choice, whole or as chunks. An
``Answer`` holds the choices of one HTTP request (``n`` per prompt, every prompt of a batch: one
router request each, frontend.py) and makes the response object, or the stream's chunks in the order
the choices' messages arrive, each carrying its choice's ``index``. Usage counts each prompt once
and every choice's completion tokens, as OpenAI's does.

The final message's serving metadata (workers, transport, KV blocks and bytes, cached tokens, the
TTFT stages) goes into the ``pdserve`` extension field (of the response, and of each choice when
there are several; of a stream's finishing chunk of each choice), and the first choice's into the
``x-pdserve-*`` headers of a non-streamed answer, so HTTP users see what ``FinalInfo`` tells gRPC
users.
"""

from __future__ import annotations

import time

from pdserve.v1 import router_pb2
from pdserve.wire import report, top_pairs
from router.http.tools import ToolStream, parse

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
                 logprobs: bool, include_usage: bool = False, return_token_ids: bool = False,
                 index: int = 0, echo: str = "", tool_parser: str | None = None) -> None:
        """``request_id``: the HTTP request's (every choice of it shares the response id); ``echo``:
        text put before the completion's (``echo`` of a completion: its prompt); ``tool_parser``: a
        chat answer's tool calls are read with it (router/http/tools.py)."""
        self.chat = kind == "chat"
        self.index = index
        self.echo = echo
        self.tool_parser = tool_parser if self.chat else None
        self._tools = ToolStream(tool_parser) if self.tool_parser else None
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
    def choice(self) -> dict:
        text = self.echo + "".join(self.text)
        lps = self._logprobs(self.token_ids, self.token_logprobs, self.top) if self.logprobs else None
        if self.chat:
            cut = self.finish_reason == "length"  # a call cut short is no call
            content, calls = parse(self.tool_parser, text) if self.tool_parser and not cut else (text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": self.index, "message": message, "logprobs": lps,
                      "finish_reason": "tool_calls" if calls else self.finish_reason}
        else:
            choice = {"index": self.index, "text": text, "logprobs": lps, "finish_reason": self.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = self.token_ids
        return choice

    def response(self) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [self.choice()],
                "usage": self.usage, "pdserve": self.report}

    # ---- stream chunks ----------------------------------------------------------------------------
    def first_chunk(self) -> dict | None:
        """Chat opens with the assistant's role (OpenAI's first delta); a completion with ``echo`` with
        its prompt; other completions need no opener."""
        if self.chat:
            return self._chunk({"role": "assistant", "content": ""}, None)
        return self._chunk(self.echo, None) if self.echo else None

    def chunk(self, msg: router_pb2.GenerateResponse, *, usage_chunk: bool = True) -> list[dict]:
        """The chunks for one router message: its text (if any), then the final ones (the usage chunk
        too when ``include_usage`` and ``usage_chunk``: an ``Answer`` of several choices sends its
        own once all have finished)."""
        self.add(msg)
        out = []
        lps = (self._logprobs(list(msg.token_ids), list(msg.logprobs),
                              [top_pairs(t) for t in msg.top_logprobs])
               if self.logprobs and msg.token_ids else None)
        final = msg.HasField("final")
        text = self._tools.feed(msg.text) if self._tools is not None else msg.text
        if text or lps or (self.return_token_ids and msg.token_ids):
            delta = {"content": text} if self.chat else text
            out.append(self._chunk(delta, None, lps))
            if self.return_token_ids:
                out[-1]["choices"][0]["token_ids"] = list(msg.token_ids)
        finish = self.finish_reason
        if final and self._tools is not None:
            rest, calls = self._tools.finish(self.finish_reason)
            if rest:
                out.append(self._chunk({"content": rest}, None))
            if calls:
                deltas = [{"index": i, **c} for i, c in enumerate(calls)]
                out.append(self._chunk({"tool_calls": deltas}, None))
                finish = "tool_calls"
        if final:
            last = self._chunk({} if self.chat else "", finish)
            last["pdserve"] = self.report
            out.append(last)
            if self.include_usage and usage_chunk:
                out.append(self.usage_chunk(self.usage))
        return out

    def usage_chunk(self, usage: dict | None) -> dict:
        return {"id": self.id, "object": self._chunk_object(), "created": self.created,
                "model": self.model, "choices": [], "usage": usage}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, delta, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        choice = ({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
                  if self.chat else
                  {"index": self.index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason})
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


class Answer:
    """The choices of one HTTP request, in index order. ``prompt_of[i]``: which prompt choice i
    answers (usage counts a prompt's tokens, and its cached tokens, once: from its first choice)."""

    def __init__(self, collectors: list[Collector], prompt_of: list[int]) -> None:
        self.collectors = collectors
        self.prompt_of = prompt_of
        self._finished = 0

    @property
    def first(self) -> Collector:
        return self.collectors[0]

    def add(self, index: int, msg: router_pb2.GenerateResponse) -> None:
        self.collectors[index].add(msg)

    @property
    def usage(self) -> dict | None:
        if any(c.usage is None for c in self.collectors):
            return None
        if len(self.collectors) == 1:
            return self.first.usage
        prompt = cached = completion = 0
        counted: set[int] = set()
        for c, p in zip(self.collectors, self.prompt_of, strict=True):
            completion += c.usage["completion_tokens"]
            if p not in counted:
                counted.add(p)
                prompt += c.usage["prompt_tokens"]
                cached += c.usage["prompt_tokens_details"]["cached_tokens"]
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def response(self) -> dict:
        out = self.first.response()
        if len(self.collectors) > 1:
            out["choices"] = [dict(c.choice(), pdserve=c.report) for c in self.collectors]
            out["usage"] = self.usage
        return out

    def first_chunks(self) -> list[dict]:
        return [chunk for c in self.collectors if (chunk := c.first_chunk()) is not None]

    def chunk(self, index: int, msg: router_pb2.GenerateResponse) -> list[dict]:
        if len(self.collectors) == 1:
            return self.first.chunk(msg)
        out = self.collectors[index].chunk(msg, usage_chunk=False)
        if msg.HasField("final"):
            self._finished += 1
            if self._finished == len(self.collectors) and self.first.include_usage:
                out.append(self.first.usage_chunk(self.usage))
        return out
