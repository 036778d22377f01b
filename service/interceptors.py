"""Server interceptors: undecodable requests, bearer-token auth.

* `DecodeErrors`: a request body that does not parse as its protobuf message is
  the client's fault: INVALID_ARGUMENT naming the method (gRPC's default is
  UNKNOWN with a DecodeError and a traceback in the log).
* `TokenAuth`: every call carries `authorization: Bearer <token>` with one of
  the configured tokens, else UNAUTHENTICATED; services named open (health,
  reflection) stay reachable without one.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

OPEN_SERVICE_NAMES = {
    "health": ("grpc.health.v1.Health",),
    "reflection": ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"),
}
TOKENS_ENV = "ZEROGAP_AUTH_TOKENS"


class _Undecodable:
    """Stands for a request message that did not parse; the handler wrapper refuses it."""

    def __init__(self, error: str):
        self.error = error


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:
            return _Undecodable(f"{type(e).__name__}: {e}")

    return parse


async def _call(behavior: Callable, request: Any, context: Any) -> Any:
    result = behavior(request, context)
    return await result if inspect.isawaitable(result) else result


async def _stream(behavior: Callable, request: Any, context: Any):
    result = behavior(request, context)
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    else:
        for item in result:
            yield item


def _with_check(handler: grpc.RpcMethodHandler, check: Callable) -> grpc.RpcMethodHandler:
    """The handler with `await check(request, context)` run before its behaviour (unary requests only)."""
    if handler.response_streaming:
        inner = handler.unary_stream

        async def unary_stream(request, context):
            await check(request, context)
            async for item in _stream(inner, request, context):
                yield item

        return handler._replace(unary_stream=unary_stream)
    inner_unary = handler.unary_unary

    async def unary_unary(request, context):
        await check(request, context)
        return await _call(inner_unary, request, context)

    return handler._replace(unary_unary=unary_unary)


class DecodeErrors(grpc.aio.ServerInterceptor):
    """A request that cannot be decoded gets INVALID_ARGUMENT with a clean message."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method

        async def check(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: the request message cannot be decoded ({request.error})",
                )

        return _with_check(handler._replace(request_deserializer=_safe(handler.request_deserializer)), check)


@dataclass(frozen=True)
class AuthConfig:
    tokens: tuple[str, ...]
    open_services: frozenset[str]  # full service names reachable without a token


def load_tokens(token_file: str | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """Bearer tokens: one per line in token_file ('#' comments, blanks ignored), and/or
    comma- or space-separated in $ZEROGAP_AUTH_TOKENS. Empty: auth is off."""
    tokens: list[str] = []
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            tokens += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    tokens += env.get(TOKENS_ENV, "").replace(",", " ").split()
    bad = [t for t in tokens if len(t) < 16]
    if bad:
        raise ValueError(f"auth tokens must be at least 16 characters ({len(bad)} shorter)")
    return tuple(dict.fromkeys(tokens))


def open_service_names(names: list[str]) -> frozenset[str]:
    unknown = set(names) - set(OPEN_SERVICE_NAMES)
    if unknown:
        raise ValueError(
            f"--auth-open: unknown service(s) {', '.join(sorted(unknown))} (known: {', '.join(OPEN_SERVICE_NAMES)})"
        )
    return frozenset(s for n in names for s in OPEN_SERVICE_NAMES[n])


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def unary(request_or_iterator, context):
        await context.abort(code, message)

    async def streaming(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover (abort raises)

    return handler._replace(
        unary_unary=unary, stream_unary=unary, unary_stream=streaming, stream_stream=streaming
    )


class TokenAuth(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` on every call outside the open services."""

    def __init__(self, config: AuthConfig):
        self.config = config
        self._tokens = [t.encode() for t in config.tokens]

    def authorized(self, metadata: Any) -> str | None:
        """None when the call may proceed, else why not."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "missing credentials: send the metadata 'authorization: Bearer <token>'"
        scheme, _, token = str(values[0]).strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "malformed authorization metadata: expected 'Bearer <token>'"
        given = token.strip().encode()
        ok = False
        for t in self._tokens:  # compare with every token: the time does not tell which one is close
            ok |= hmac.compare_digest(given, t)
        return None if ok else "invalid token"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in self.config.open_services:
            return handler
        why = self.authorized(handler_call_details.invocation_metadata)
        return handler if why is None else _deny(handler, grpc.StatusCode.UNAUTHENTICATED, why)
