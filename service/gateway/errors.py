"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, with HTTP statuses.

gRPC statuses from the generation service map to the HTTP status an OpenAI
client expects: bad input 400, unknown model 404, a full queue 429 (the SDKs
retry it with backoff), a server going away 503, a deadline 504.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from starlette.responses import JSONResponse

# gRPC code -> (HTTP status, OpenAI error type, OpenAI error code or None)
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "unsupported_feature"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "context_length_exceeded"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "duplicate_request_id"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "server_busy"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", None),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}


@dataclass
class APIError(Exception):
    """An error answered to the HTTP client as an OpenAI error body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    @staticmethod
    def from_grpc(err: grpc.RpcError) -> APIError:
        code = err.code()
        status, kind, short = GRPC_TO_HTTP.get(code, (500, "server_error", None))
        details = err.details() or code.name
        param = details.split(":", 1)[0] if status == 400 and ":" in details else None
        return APIError(status, details, kind, param if param and " " not in param else None, short)


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def unsupported(param: str, message: str = "is not supported by this server") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")
