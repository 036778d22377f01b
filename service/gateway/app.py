"""The OpenAI-compatible HTTP gateway: a Starlette app over zerogap.client.AsyncClient.

Every HTTP request becomes one gRPC call to the generation service (directly or
through the load balancer). When the HTTP client goes away -- a closed stream, an
SDK timeout, a cancelled request -- the gRPC call is cancelled, and the service
aborts the request and frees its KV cache at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service.gateway import protocol as p
from service.gateway.errors import APIError, invalid
from service.gateway.images import FetchError, fetch_image
from zerogap.client import AsyncClient, AsyncStream, ChannelOptions, Chat, Completion, Delta, ZerogapError

if TYPE_CHECKING:
    import grpc

T = TypeVar("T")
STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request"; never reaches the (gone) client
ECHO_HEAD_CHARS = 4096  # an echoed text prompt's first token is found in this much of it


@dataclass(frozen=True)
class GatewayConfig:
    grpc_target: str
    served_model_name: str | None = None  # default: the service's ModelInfo.model_name
    default_max_tokens: int | None = None  # chat completions without max_tokens (None: the service's default)
    timeout_s: float | None = 600.0  # gRPC deadline of one generation
    channel: ChannelOptions = ChannelOptions()
    credentials: grpc.ChannelCredentials | None = None  # TLS to grpc_target (None: plaintext)
    image_hosts: frozenset[str] = (
        frozenset()
    )  # hosts whose http(s) image URLs are fetched (--allow-image-urls)
    image_max_bytes: int = 10 << 20  # a fetched image's limit (the service's --max-image-bytes default)
    image_timeout_s: float = 10.0  # a fetch's time limit


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Awaits `aw`, cancelling it (and so its gRPC call) if the HTTP client disconnects first."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone
    finally:
        work.cancel()
        watch.cancel()


async def all_or_none(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every call's result, in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()  # no-op for the finished ones


Reads = dict[asyncio.Future[Delta], int]  # a stream's next read -> the stream's (sample's) index


async def opened(streams: list[AsyncStream]) -> Reads:
    """Once every stream is queued and one has its first delta: each stream's first read (one at
    least done). A refusal of any stream is raised (the others cancelled by the caller)."""
    await all_or_none(s.queued() for s in streams)
    reads = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            fut.result()  # raises a stream's error
    except BaseException:
        for fut in reads:
            fut.cancel()
        raise
    return reads


async def interleave(streams: list[AsyncStream], reads: Reads) -> AsyncIterator[tuple[int, Delta]]:
    """(sample index, delta) as each stream delivers, from `reads` (a read per stream, in flight or
    done) on; a stream is followed until its delta with a finish reason."""
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=reads.__getitem__):
                i = reads.pop(fut)
                delta = fut.result()
                yield i, delta
                if delta.finish_reason is None:
                    reads[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for fut in reads:
            fut.cancel()


class Gateway:
    """Route handlers and the state they share: the gRPC client, the model name, token texts."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client: AsyncClient | None = None
        self.started = int(time.time())
        self._model: str | None = config.served_model_name
        self._texts: dict[int, str] = {}  # token id -> its text alone (bounded by the vocabulary)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.client = AsyncClient(
            self.config.grpc_target,
            self.config.channel,
            timeout=self.config.timeout_s,
            credentials=self.config.credentials,
        )
        try:
            yield
        finally:
            await self.client.close()

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        handlers = {HTTPException: _http_error, ZerogapError: _grpc_error, APIError: _api_error}
        return Starlette(
            routes=routes,
            lifespan=self.lifespan,
            exception_handlers=handlers,  # type: ignore[arg-type]
        )

    @property
    def grpc(self) -> AsyncClient:
        assert self.client is not None, "the app's lifespan has not started"
        return self.client

    # ---- models and health ------------------------------------------------------------------
    async def model_name(self) -> str:
        if self._model is None:
            self._model = (await self.grpc.model_info()).model_name
        return self._model

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "zerogap"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card(await self.model_name())]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        await self._check_model(name)
        return JSONResponse(self._model_card(name))

    async def _check_model(self, name: str) -> None:
        served = await self.model_name()
        if name != served:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{served}'",
                param="model",
                code="model_not_found",
            )

    async def health(self, request: Request) -> Response:
        try:
            status = await self.grpc.health(timeout=5.0)
        except ZerogapError as e:
            status = e.code().name
        return JSONResponse({"status": status}, status_code=200 if status == "SERVING" else 503)

    # ---- generation ------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        cfg = self.config
        call = p.parse_chat(await _json(request), cfg.default_max_tokens, cfg.image_hosts)
        if remote := p.remote_images(call):
            call = p.with_images(call, dict(zip([r.param for r in remote], await self._fetch(remote))))
        return await self._generate(request, call, "chatcmpl")

    async def _fetch(self, remote: list[p.RemoteImage]) -> list[bytes]:
        """Allowed remote images, fetched in worker threads (never on the event loop)."""
        cfg = self.config

        async def one(r: p.RemoteImage) -> bytes:
            try:
                return await asyncio.to_thread(fetch_image, r.url, cfg.image_max_bytes, cfg.image_timeout_s)
            except FetchError as e:
                raise invalid(r.param, f"{r.url}: {e}") from None

        return list(await asyncio.gather(*(one(r) for r in remote)))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, p.parse_completion(await _json(request)), "cmpl")

    async def _generate(self, request: Request, call: p.Call, prefix: str) -> Response:
        await self._check_model(call.model)
        rid = f"{prefix}-{uuid.uuid4().hex}"
        # a gRPC call per choice: prompt k's sample i is choice k * n + i
        work = [(prompt, sampling) for prompt in call.prompts for sampling in p.samplings(call)]
        ids = [rid] if len(work) == 1 else [f"{rid}/{c}" for c in range(len(work))]
        kw = dict(logprobs=call.logprobs, constraint=call.constraint)
        try:
            if call.stream:
                streams = [self.grpc.stream(pr, s, request_id=i, **kw) for i, (pr, s) in zip(ids, work)]
                return await self._stream(request, call, rid, streams)
            done = await until_disconnected(
                request,
                all_or_none(self.grpc.generate(pr, s, request_id=i, **kw) for i, (pr, s) in zip(ids, work)),
            )
            echoes = await self._echoes(request, call)  # the prompts were accepted
        except ClientGone:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        except ZerogapError as e:
            err = APIError.from_grpc(e)
            err.param = p.openai_param(err.param, call.kind)
            raise err from None
        body = p.envelope(call, rid, p.now(), chunk=False)
        body["choices"] = [
            p.choice(
                call,
                p.choice_text(call, d.text, echoes[c]),
                d.finish_reason,
                await self._logprobs(call, d, echo=echoes[c]),
                False,
                index=c,
            )
            for c, d in enumerate(done)
        ]
        body["usage"] = self._usage(call, done)
        return JSONResponse(body)

    @staticmethod
    def _usage(call: p.Call, ends: Sequence[Completion | Delta]) -> dict[str, Any]:
        """Each prompt counted once (its first sample's figures), the output of every choice."""
        firsts = ends[:: call.n]
        tokens = 0 if call.prompt_only else sum(d.completion_tokens for d in ends)
        return p.usage(sum(d.prompt_tokens for d in firsts), tokens, sum(d.cached_tokens for d in firsts))

    async def _echoes(self, request: Request, call: p.Call) -> list[p.Echo | None]:
        """Each choice's `echo` (None without it), worked out once per prompt; called once the
        service has accepted the prompts (so an over-long one is refused before any work here)."""
        if not call.echo:
            return [None] * (len(call.prompts) * call.n)
        work = asyncio.gather(*(self._echo(call, prompt) for prompt in call.prompts))
        per_prompt = await until_disconnected(request, work)
        return [echo for echo in per_prompt for _ in range(call.n)]

    async def _echo(self, call: p.Call, prompt: str | list[int] | Chat) -> p.Echo:
        """The prompt's text and (for logprobs) its first token id."""
        if isinstance(prompt, str):
            if call.logprobs is None:
                return p.Echo(prompt)
            # The first token as the service tokenizes the text (special tokens too); its head is
            # enough: no token spans thousands of characters.
            ids = await self.grpc.tokenize(prompt[:ECHO_HEAD_CHARS], add_special_tokens=True)
            return p.Echo(prompt, ids[0] if ids else None)
        assert isinstance(prompt, list)  # token ids (parse_completion: a chat is never echoed)
        return p.Echo(await self.grpc.detokenize(prompt, skip_special_tokens=False), prompt[0])

    async def _stream(
        self,
        request: Request,
        call: p.Call,
        rid: str,
        streams: list[AsyncStream],
    ) -> Response:
        # Every sample's place in the queue, and one sample's first delta, are awaited before
        # answering, so that a request the service refuses (any of its samples: the queue may take
        # some and not all) gets its HTTP error status rather than a 200 stream carrying an error.
        # The other samples' first tokens are not awaited: they may wait for a free slot. One that
        # fails later ends the stream with an error event.
        reads: Reads = {}
        try:
            reads = await until_disconnected(request, opened(streams))
            echoes = await self._echoes(request, call)  # the prompts were accepted
        except BaseException:
            for fut in reads:
                fut.cancel()
            for s in streams:
                s.cancel()
            raise
        return StreamingResponse(
            self._events(call, rid, streams, reads, echoes),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self,
        call: p.Call,
        rid: str,
        streams: list[AsyncStream],
        reads: Reads,
        echoes: Sequence[p.Echo | None],
    ) -> AsyncIterator[bytes]:
        created, offsets = p.now(), [0] * len(streams)
        ends: dict[int, Delta] = {}  # each sample's last delta
        head = p.envelope(call, rid, created, chunk=True)
        if call.include_usage:
            head["usage"] = None
        try:
            async with contextlib.aclosing(interleave(streams, reads)) as deltas:
                async for i, delta in deltas:
                    first_echo = echoes[i] if i not in ends else None  # leads a choice's first delta
                    lp = await self._logprobs(call, delta, offsets[i], first_echo)
                    text = p.choice_text(call, delta.text, first_echo)
                    offsets[i] += len(text)
                    out = p.choice(call, text, delta.finish_reason, lp, True, i not in ends, index=i)
                    yield p.sse(dict(head, choices=[out]))
                    ends[i] = delta
            if call.include_usage:
                usage = self._usage(call, [ends[c] for c in range(len(streams))])
                yield p.sse(dict(head, choices=[], usage=usage))
            yield p.sse("[DONE]")
        except ZerogapError as e:  # after the 200 went out: an error event, as OpenAI's servers send
            yield p.sse(APIError.from_grpc(e).body())
        finally:
            for s in streams:
                s.cancel()  # the HTTP client went away (or the streams ended): no-op once done

    async def _logprobs(
        self, call: p.Call, part: Completion | Delta, offset: int = 0, echo: p.Echo | None = None
    ) -> dict | None:
        """The choice's logprobs in `part` (a completion or a delta), after the prompt's with `echo`
        (a choice's first)."""
        if call.logprobs is None:
            return None
        entries = list(part.input_logprobs) if echo is not None else []
        if call.echo:  # every generated token, a stop token too: lm-eval reads them by position
            entries += [] if call.prompt_only else part.logprobs
        else:
            entries += p.content_logprobs(part.logprobs, part.finish_reason, part.matched_stop)
        first = echo.first_token if echo is not None else None
        wanted = p.missing_texts(entries) | ({first} if first is not None else set())
        missing = sorted(wanted - self._texts.keys())
        if missing:
            found = await asyncio.gather(
                *(self.grpc.detokenize([t], skip_special_tokens=False) for t in missing)
            )
            self._texts.update(zip(missing, found, strict=True))
        if call.kind == "chat":
            return p.chat_logprobs(entries, self._texts)
        return p.completion_logprobs(entries, self._texts, offset, first)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"body: not valid JSON ({e})", param="body") from None


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _grpc_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ZerogapError)
    return APIError.from_grpc(exc).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()


def create_app(config: GatewayConfig) -> Starlette:
    return Gateway(config).app()
