"""Errors of the HTTP door in OpenAI's JSON shape, with the HTTP status mapped from the gRPC status.

The router decides with gRPC status codes (DESIGN.md "Errors"); this module is the one place that
says what each means over HTTP, so a refusal reads the same through either door:

    INVALID_ARGUMENT, OUT_OF_RANGE  400     RESOURCE_EXHAUSTED  429 (+ Retry-After)
    UNAUTHENTICATED                 401     UNAVAILABLE, FAILED_PRECONDITION  503
    PERMISSION_DENIED               403     DEADLINE_EXCEEDED   504
    NOT_FOUND                       404     CANCELLED           499 (the client went away)
    (request body too large)        413     anything else       500

Body: ``{"error": {"message", "type", "param", "code"}}`` as OpenAI's clients parse it.
"""

from __future__ import annotations

import math

import grpc
from fastapi.responses import JSONResponse

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
              429: "rate_limit_error", 499: "cancelled", 501: "not_implemented_error",
              503: "service_unavailable_error", 504: "timeout_error"}
DEFAULT_RETRY_AFTER_S = 1


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str, *,
                  retry_after_ms: float | None = None) -> OpenAIError:
        status = HTTP_STATUS.get(code, 500)
        retry = None
        if status == 429:
            retry = retry_after_ms / 1e3 if retry_after_ms else DEFAULT_RETRY_AFTER_S
        return cls(status, message, code=code.name.lower(), retry_after_s=retry)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)
