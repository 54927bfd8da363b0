"""The load generator's HTTP backend (``pdserve bench --backend openai``): the same requests through the
router's OpenAI-compatible door, with the official ``openai`` client.

``OpenAIBackend`` answers the one call the runner makes of ``pdserve.client.AsyncClient``
(``generate(GenerateRequest, timeout) -> Result``), so every workload (Poisson, sessions, traces,
sweeps) runs over either door unchanged and the two are comparable side by side. A request becomes a
streamed ``/v1/completions`` call with the prompt as token ids, ``ignore_eos`` and ``return_token_ids``
(so token counts and inter-token gaps are per token, as over gRPC), the session id in the
``x-session-affinity`` header; the final chunk's ``pdserve`` field is the same per-request report
gRPC's FinalInfo gives. An HTTP refusal is raised as the ``grpc.aio.AioRpcError`` its status maps
back to (429 → RESOURCE_EXHAUSTED with ``Retry-After`` as the ``retry-after-ms`` hint, 503 →
UNAVAILABLE, ...), so the runner counts and reports it exactly as a gRPC refusal.
"""

from __future__ import annotations

import time

import grpc

from pdserve.client import Result
from pdserve.v1 import router_pb2

_GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
              413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
              499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE,
              504: grpc.StatusCode.DEADLINE_EXCEEDED}


def _as_rpc_error(code: grpc.StatusCode, details: str,
                  retry_after_s: str | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if retry_after_s:
        try:
            trailing.add("retry-after-ms", str(int(float(retry_after_s) * 1000)))
        except ValueError:
            pass
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


_MODEL_OF: dict[str, str] = {}  # address -> served model name, asked once per process


class OpenAIBackend:
    def __init__(self, address: str, *, api_key: str = "", model: str = "") -> None:
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=f"http://{address}/v1", api_key=api_key or "none", max_retries=0)
        self.address = address
        self.model = model or _MODEL_OF.get(address, "")

    async def _model(self) -> str:
        if not self.model:
            models = await self.client.models.list()
            self.model = _MODEL_OF[self.address] = models.data[0].id
        return self.model

    async def generate(self, request: router_pb2.GenerateRequest, *, timeout: float | None = None) -> Result:
        import openai

        headers = {"x-session-affinity": request.session_id} if request.session_id else {}
        s = request.sampling
        body = {"ignore_eos": s.ignore_eos, "return_token_ids": True}
        res = Result(start=time.perf_counter())
        try:
            stream = await self.client.completions.create(
                model=await self._model(), prompt=list(request.token_ids.ids) or request.text,
                max_tokens=request.max_tokens if request.HasField("max_tokens") else 16,
                temperature=s.temperature if s.HasField("temperature") else 0.0, stream=True,
                stream_options={"include_usage": True}, extra_body=body, extra_headers=headers,
                timeout=timeout)
            async for chunk in stream:
                now = time.perf_counter()
                extra = chunk.model_extra or {}
                for choice in chunk.choices:
                    ids = (choice.model_extra or {}).get("token_ids") or []
                    res.token_ids.extend(ids)
                    res.token_times.extend([now] * len(ids))
                    res.text += choice.text or ""
                    if choice.finish_reason:
                        res.finish_reason = choice.finish_reason
                if extra.get("pdserve"):
                    res.final = dict(extra["pdserve"])
                if chunk.usage is not None:
                    u = chunk.usage
                    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
                    res.final["usage"] = {"prompt_tokens": u.prompt_tokens,
                                          "completion_tokens": u.completion_tokens, "cached_tokens": cached}
                    res.end = now
        except openai.APIStatusError as exc:
            code = _GRPC_CODE.get(exc.status_code, grpc.StatusCode.INTERNAL)
            raise _as_rpc_error(code, str(exc), exc.response.headers.get("retry-after")) from None
        except openai.APITimeoutError:
            raise _as_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "HTTP request timed out") from None
        except openai.APIConnectionError as exc:
            raise _as_rpc_error(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        if not res.end:
            res.end = time.perf_counter()
        return res

    async def close(self) -> None:
        await self.client.close()


def make_client(address: str, backend: str, *, api_key: str = ""):
    """The runner's client for ``backend``: gRPC's AsyncClient, or this module's HTTP one."""
    if backend == "openai":
        return OpenAIBackend(address, api_key=api_key)
    if backend != "grpc":
        raise ValueError(f"--backend must be grpc or openai, got {backend!r}")
    from pdserve.client import AsyncClient

    return AsyncClient(address)
