"""The blocking client.

with Client("localhost:50051") as c:
    print(c.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=32, temperature=0).text)
    with c.stream("Once upon a time", max_new_tokens=64) as s:
        for d in s:
            print(d.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerogap.client.channel import ChannelOptions
from zerogap.client.types import (
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


class Stream:
    """A running GenerateStream: iterate for Deltas. Leaving a `with` block, breaking
    out of a `for` loop over it (once it is dropped) or calling cancel() cancels the
    call, and the server aborts the request and frees its KV cache at once."""

    def __init__(self, call):
        self._call = call
        self.deltas: list[Delta] = []

    def __iter__(self) -> Iterator[Delta]:
        try:
            for r in self._call:
                d = Delta.from_proto(r)
                self.deltas.append(d)
                yield d
        except grpc.RpcError as e:
            raise ZerogapError.from_rpc(e) from None
        finally:
            self.cancel()  # no-op once the call has ended

    def collect(self) -> Completion:
        """Reads the rest of the stream; the whole result."""
        for _ in self:
            pass
        return Completion.from_deltas(self.deltas)

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        self.cancel()


class Client:
    """A blocking client for zerogap.v1.Generation.

    `timeout` is the default deadline in seconds of every call (None: none);
    each helper also takes its own `timeout=`."""

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
            self.channel = grpc.insecure_channel(target, options=opts)
        else:
            self.channel = grpc.secure_channel(target, credentials, options=opts)
        self.stub = pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    # ---- plumbing ------------------------------------------------------------------------------
    def _call(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=self._timeout(timeout), wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise ZerogapError.from_rpc(e) from None

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- generation ----------------------------------------------------------------------------
    def generate(
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
        """One request to completion. `prompt`: text, token ids, chat messages or a Chat;
        keyword arguments named like Sampling's fields override `sampling`."""
        req = build_request(
            prompt, sampling, overrides, logprobs=logprobs, constraint=constraint, request_id=request_id
        )
        return Completion.from_proto(self._call(self.stub.Generate, req, timeout))

    def chat(
        self,
        messages: Sequence[Message | Mapping[str, Any] | tuple[str, Content]],
        sampling: Sampling | None = None,
        **kw: Any,
    ) -> Completion:
        """generate() on chat messages (dicts, (role, content) tuples or Messages)."""
        return self.generate(Chat(messages), sampling, **kw)

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
    ) -> Stream:
        """Streams deltas as the tokens are generated (see Stream)."""
        req = build_request(
            prompt, sampling, overrides, logprobs=logprobs, constraint=constraint, request_id=request_id
        )
        call = self.stub.GenerateStream(
            req, timeout=self._timeout(timeout), wait_for_ready=self.options.wait_for_ready
        )
        return Stream(call)

    def json(
        self,
        prompt: Input,
        schema: Mapping[str, Any] | str | None = None,
        sampling: Sampling | None = None,
        **kw: Any,
    ) -> Any:
        """Generates JSON that validates against `schema` (any JSON object when None) and parses it.
        ValueError if the output was cut short (raise max_new_tokens)."""
        return self.generate(prompt, sampling, constraint=json_constraint(schema), **kw).json()

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Aborts a live request by id; False when none had it."""
        return self._call(self.stub.Abort, pb2.AbortRequest(request_id=request_id), timeout).found

    # ---- information ---------------------------------------------------------------------------
    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The health status name, e.g. "SERVING"."""
        r = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def tokenize(
        self, text: str, add_special_tokens: bool = False, timeout: float | None = None
    ) -> list[int]:
        req = pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._call(self.stub.Tokenize, req, timeout).token_ids)

    def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = True, timeout: float | None = None
    ) -> str:
        req = pb2.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._call(self.stub.Detokenize, req, timeout).text

    def model_info(self, timeout: float | None = None):
        """The ModelInfo message (model_name, context_length, vocab_size, ...)."""
        return self._call(self.stub.GetModelInfo, pb2.GetModelInfoRequest(), timeout)

    def server_info(self, timeout: float | None = None):
        """The ServerInfo message (KV pool, running/queued requests, forward-busy fraction, ...)."""
        return self._call(self.stub.GetServerInfo, pb2.GetServerInfoRequest(), timeout)

    def feature_matrix(self, timeout: float | None = None):
        return self._call(self.stub.GetFeatureMatrix, pb2.GetFeatureMatrixRequest(), timeout)
