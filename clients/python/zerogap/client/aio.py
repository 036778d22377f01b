"""The asyncio client (grpc.aio), with the same helpers as the blocking one.

async with AsyncClient("localhost:50051") as c:
    r = await c.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=32, temperature=0)
    async with c.stream("Once upon a time", max_new_tokens=64) as s:
        async for d in s:
            print(d.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerogap.client.channel import ChannelOptions
from zerogap.client.types import (
    QUEUED_METADATA_KEY,
    Chat,
    Completion,
    Constraint,
    Content,
    Delta,
    Input,
    Logprobs,
    Message,
    Sampling,
    ZerogapError,
    build_request,
    json_constraint,
)
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc


class AsyncStream:
    """A running GenerateStream: `async for` it for Deltas. Leaving an `async with`
    block, cancel(), or cancelling the task that reads it cancels the call (the
    server aborts the request and frees its KV cache). A bare `async for` that
    breaks cancels once the stream is dropped."""

    def __init__(self, call):
        self._call = call
        self.deltas: list[Delta] = []
        self._peeked: Delta | None = None  # read by queued(), not yet returned

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def queued(self) -> None:
        """Returns once the server has queued the request, which may be well before its first
        token (it waits for a free slot); raises the server's refusal (ZerogapError) instead."""
        try:
            metadata = await self._call.initial_metadata()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if metadata is not None and QUEUED_METADATA_KEY in metadata:
            return
        try:  # no mark: refused (the status came alone), or an older server; the first delta says
            self._peeked = await self.__anext__()
        except StopAsyncIteration:
            pass

    async def __anext__(self) -> Delta:
        if self._peeked is not None:
            d, self._peeked = self._peeked, None
            return d
        try:
            r = await self._call.read()
        except asyncio.CancelledError:
            self.cancel()
            raise
        except grpc.RpcError as e:
            raise ZerogapError.from_rpc(e) from None
        if r is grpc.aio.EOF:
            raise StopAsyncIteration
        d = Delta.from_proto(r)
        self.deltas.append(d)
        return d

    async def collect(self) -> Completion:
        """Reads the rest of the stream; the whole result."""
        async for _ in self:
            pass
        return Completion.from_deltas(self.deltas)

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if not self._call.done():
            self.cancel()


class AsyncClient:
    """An asyncio client for zerogap.v1.Generation (one channel; safe for many concurrent calls).

    `timeout` is the default deadline in seconds of every call (None: none)."""

    def __init__(
        self,
        target: str,
        options: ChannelOptions | None = None,
        timeout: float | None = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.options = options or ChannelOptions()
        self.timeout = timeout
        opts = self.options.grpc_options()
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            self.channel = grpc.aio.secure_channel(target, credentials, options=opts)
        self.stub = pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    # ---- plumbing ------------------------------------------------------------------------------
    async def _call(self, method, request, timeout: float | None):
        try:
            return await method(
                request, timeout=self._timeout(timeout), wait_for_ready=self.options.wait_for_ready
            )
        except grpc.RpcError as e:
            raise ZerogapError.from_rpc(e) from None

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- generation ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Input,
        sampling: Sampling | None = None,
        *,
        logprobs: Logprobs | bool | None = None,
        constraint: Constraint | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **overrides: Any,
    ) -> Completion:
        """One request to completion; cancelling the awaiting task cancels the call."""
        req = build_request(
            prompt, sampling, overrides, logprobs=logprobs, constraint=constraint, request_id=request_id
        )
        return Completion.from_proto(await self._call(self.stub.Generate, req, timeout))

    async def chat(
        self,
        messages: Sequence[Message | Mapping[str, Any] | tuple[str, Content]],
        sampling: Sampling | None = None,
        **kw: Any,
    ) -> Completion:
        return await self.generate(Chat(messages), sampling, **kw)

    def stream(
        self,
        prompt: Input,
        sampling: Sampling | None = None,
        *,
        logprobs: Logprobs | bool | None = None,
        constraint: Constraint | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **overrides: Any,
    ) -> AsyncStream:
        """Streams deltas as the tokens are generated (see AsyncStream)."""
        req = build_request(
            prompt, sampling, overrides, logprobs=logprobs, constraint=constraint, request_id=request_id
        )
        call = self.stub.GenerateStream(
            req, timeout=self._timeout(timeout), wait_for_ready=self.options.wait_for_ready
        )
        return AsyncStream(call)

    async def json(
        self,
        prompt: Input,
        schema: Mapping[str, Any] | str | None = None,
        sampling: Sampling | None = None,
        **kw: Any,
    ) -> Any:
        """Generates JSON that validates against `schema` (any JSON object when None) and parses it."""
        return (await self.generate(prompt, sampling, constraint=json_constraint(schema), **kw)).json()

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        return (await self._call(self.stub.Abort, pb2.AbortRequest(request_id=request_id), timeout)).found

    # ---- information ---------------------------------------------------------------------------
    async def health(self, service: str = "", timeout: float | None = None) -> str:
        r = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def tokenize(
        self, text: str, add_special_tokens: bool = False, timeout: float | None = None
    ) -> list[int]:
        req = pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._call(self.stub.Tokenize, req, timeout)).token_ids)

    async def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = True, timeout: float | None = None
    ) -> str:
        req = pb2.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self._call(self.stub.Detokenize, req, timeout)).text

    async def model_info(self, timeout: float | None = None):
        return await self._call(self.stub.GetModelInfo, pb2.GetModelInfoRequest(), timeout)

    async def server_info(self, timeout: float | None = None):
        return await self._call(self.stub.GetServerInfo, pb2.GetServerInfoRequest(), timeout)

    async def feature_matrix(self, timeout: float | None = None):
        return await self._call(self.stub.GetFeatureMatrix, pb2.GetFeatureMatrixRequest(), timeout)
