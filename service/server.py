"""The gRPC front end: validation, status codes, streaming, health, shutdown.

One process: an asyncio gRPC server on the main thread (or a background
thread in tests), the scheduler thread and, in overlap mode, the forward
thread. The scheduler's outputs reach request handlers through OutputRouter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import __version__
from service.config import ServerArgs
from service.core.omp import serial_cpu_ops_on_this_thread
from service.core.request import FinishReason, Req, RequestError, RequestOutput, SamplingParams
from service.engine.engine import Engine
from service.interceptors import AuthConfig, DecodeErrors, TokenAuth, load_tokens, open_service_names
from service.limits import InputLimits
from service.metrics import start_metrics_server
from service.model_prep import resolve_model_path
from service.models.layers import UnsupportedModel
from service.smg_worker import SERVICE_NAME as SMG_WORKER_SERVICE
from service.smg_worker import SmgWorkerServicer, add_smg_worker
from service.tokenizer import InputTooLong
from zerogap.client.types import QUEUED_METADATA_KEY
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

log = logging.getLogger("zerogap.server")

SERVICE_NAME = "zerogap.v1.Generation"
HEALTH_WATCH_S = 1.0  # how often the engine's fault is looked for (watch_engine_health)
HEALTH_NAMES = ("", SERVICE_NAME, SMG_WORKER_SERVICE)  # the services grpc.health.v1 reports on
FINISH_REASONS = {
    FinishReason.STOP: pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb2.FINISH_REASON_ABORT,
}


class OutputRouter:
    """Delivers the scheduler's per-step outputs to each request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.engine: Engine | None = None
        self.finished_by_reason: dict[str, int] = {}
        self.completion_tokens = 0
        # requests with no output yet: their prompts are the engine's queued work
        self.unstarted: dict[str, Req] = {}

    def sink(self, outputs: list[RequestOutput]) -> None:
        """Scheduler thread: one hop into the event loop per step."""
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self.completion_tokens += len(o.token_ids)
            self.unstarted.pop(o.rid, None)
            q = self.queues.get(o.rid)
            if q is not None:
                q.put_nowait(o)
            if o.finish_reason is not None:
                key = o.finish_reason.value
                self.finished_by_reason[key] = self.finished_by_reason.get(key, 0) + 1
                self.queues.pop(o.rid, None)
                assert self.engine is not None
                self.engine.on_finished(o.rid)

    def open(
        self, rid: str, queue: asyncio.Queue[RequestOutput] | None = None, prefill: Req | None = None
    ) -> asyncio.Queue[RequestOutput]:
        """The queue `rid`'s outputs go to: a new one, or `queue` (shared by the samples of one call).
        `prefill`: the submitted request whose prompt counts as queued work until its first output
        (None for a sample of n whose prompt another sample prefills: the prefix cache shares it)."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue() if queue is None else queue
        self.queues[rid] = q
        if prefill is not None:
            self.unstarted[rid] = prefill
        return q

    def forget(self, rid: str) -> None:
        """The request's RPC ended: its prompt is nobody's queued work any more (normally its first
        output already took it off; an abort's output may come later, or never for a request lost
        to a scheduler failure)."""
        self.unstarted.pop(rid, None)

    def queued_prompt_tokens(self) -> int:
        """What the prompts of the requests with no output yet leave to compute: the whole prompt
        while one waits, what lies past its KV rows (a cached prefix, launched chunks) once admitted
        (read off the scheduler's requests: an estimate). SGLang's waiting tokens less their matched
        prefix, plus the rest of a chunked prompt."""
        return sum(
            max(0, len(r.prompt_ids) - r.kv_len) for r in self.unstarted.values() if r.finished is None
        )


def _code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name)


def sampling_from_proto(sp, defaults: SamplingParams | None = None) -> SamplingParams:
    """Proto SamplingParams -> ours; unset optional fields (and top_k, min_p 0) take `defaults`
    (the engine's: the model's generation_config.json values, `--sampling-defaults`)."""
    p = dataclasses.replace(defaults) if defaults is not None else SamplingParams()
    for name in (
        "max_new_tokens",
        "temperature",
        "top_p",
        "repetition_penalty",
        "seed",
        "skip_special_tokens",
    ):
        if sp.HasField(name):
            setattr(p, name, getattr(sp, name))
    p.min_new_tokens = sp.min_new_tokens
    if sp.top_k:
        p.top_k = sp.top_k
    if sp.min_p:
        p.min_p = sp.min_p
    p.frequency_penalty = sp.frequency_penalty
    p.presence_penalty = sp.presence_penalty
    p.stop = list(sp.stop)
    p.stop_token_ids = list(sp.stop_token_ids)
    p.ignore_eos = sp.ignore_eos
    p.logit_bias = {t: float(f"{v:.7g}") for t, v in sp.logit_bias.items()}
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        v = getattr(p, name)
        if isinstance(v, float) and math.isfinite(v):
            setattr(p, name, float(f"{v:.7g}"))  # float32 wire values, e.g. 0.9 not 0.899999976
    return p


def chat_messages(chat) -> list[dict]:
    """Messages for the chat template; a message with `parts` gets a list of text / image parts."""
    out: list[dict] = []
    for i, m in enumerate(chat.messages):
        if not m.parts:
            out.append({"role": m.role, "content": m.content})
            continue
        if m.content:
            raise ValueError(f"chat.messages[{i}]: set content or parts, not both")
        parts = []
        for j, p in enumerate(m.parts):
            kind = p.WhichOneof("part")
            if kind is None:
                raise ValueError(f"chat.messages[{i}].parts[{j}]: empty part (set text or image)")
            parts.append({"type": "text", "text": p.text} if kind == "text" else {"type": "image"})
        out.append({"role": m.role, "content": parts})
    return out


def chat_flags(chat) -> dict[str, bool]:
    """The template flags of a ChatInput: add_generation_prompt defaults to true, or to false when
    the final message is continued."""
    cont = chat.continue_final_message
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not cont
    return {"add_generation_prompt": add, "continue_final_message": cont}


class GenerationServicer(pb2_grpc.GenerationServicer):
    """zerogap.v1.Generation over the engine."""

    def __init__(self, engine: Engine, router: OutputRouter, model_path: str):
        self.engine = engine
        self.router = router
        self.model_path = model_path
        self.draining = False
        # Their torch ops (if any: a processor's, a feature's payload) run serially: a worker with a team
        # of its own would slow every forward (service/core/omp.py).
        self.executor = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="zerogap-input", initializer=serial_cpu_ops_on_this_thread
        )
        self.limits = InputLimits.from_args(engine.args)

    # ---- helpers ---------------------------------------------------------------------
    def _prompt_ids(self, request) -> list[int]:
        """Worker thread (never the event loop): the prompt's token ids, refusing cheaply what cannot fit."""
        tok = self.engine.tokenizer
        which = request.WhichOneof("input")
        limit = self.engine.context_length - 1
        if which == "text":
            if not request.text:
                raise RequestError("INVALID_ARGUMENT", "input.text: empty")
            try:
                return tok.encode_bounded(request.text, limit)
            except InputTooLong as e:
                raise RequestError(
                    "OUT_OF_RANGE",
                    f"input.text: does not fit the context length {self.engine.context_length}: {e}",
                ) from None
        if which == "token_ids":
            if not request.token_ids.ids:
                raise RequestError("INVALID_ARGUMENT", "input.token_ids: empty")
            return list(request.token_ids.ids)
        if which == "chat":
            if not request.chat.messages:
                raise RequestError("INVALID_ARGUMENT", "input.chat.messages: empty")
            try:
                return tok.encode_chat(
                    chat_messages(request.chat), max_tokens=limit, **chat_flags(request.chat)
                )[1]
            except InputTooLong as e:
                raise RequestError(
                    "OUT_OF_RANGE",
                    f"input.chat: does not fit the context length {self.engine.context_length}: {e}",
                ) from None
            except ValueError as e:
                raise RequestError("INVALID_ARGUMENT", f"input.{e}") from None
        raise RequestError("INVALID_ARGUMENT", "input: set one of text, token_ids or chat")

    async def _start(self, request, context):
        """Validate and submit; returns (rid, output queue) or aborts the RPC."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        try:
            self.limits.check(
                request.request_id, request.sampling
            )  # cheap bounds first, before any work is done for it
            features = {}
            for name, feature in self.engine.features.features.items():
                payload = feature.from_proto(request)
                if payload is not None:
                    features[name] = payload
            req = await self._off_loop(
                lambda: self.engine.build_request(
                    rid,
                    self._prompt_ids(request),
                    sampling_from_proto(request.sampling, self.engine.sampling_defaults),
                    features,
                )
            )
            for fut in self.engine.features.pending(req):  # e.g. its grammar: errors found before admission
                await asyncio.wrap_future(fut)  # cancelled with the RPC: the work stops when nobody waits
            if self.draining:
                raise RequestError("UNAVAILABLE", "server is shutting down")
            self.engine.submit(req)  # raises ALREADY_EXISTS for a live id: its queue stays untouched
            # No await since submit: outputs reach the router through this loop, after the queue exists.
            queue = self.router.open(rid, prefill=req)
        except RequestError as e:
            await context.abort(_code(e.code), e.message)
        return rid, queue

    async def _off_loop(self, fn):
        """Tokenizing, chat templates, validation: on a worker thread, so no RPC waits for another's input."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def _response(self, rid: str, outs: list[RequestOutput]):
        last = outs[-1]
        resp = pb2.GenerateResponse(
            request_id=rid,
            token_ids=[t for o in outs for t in o.token_ids],
            text="".join(o.text for o in outs),
            usage=pb2.Usage(
                prompt_tokens=last.prompt_tokens,
                completion_tokens=last.completion_tokens,
                cached_tokens=last.cached_tokens,
            ),
        )
        if last.finish_reason is not None:
            resp.finish_reason = FINISH_REASONS[last.finish_reason]
            if isinstance(last.matched_stop, str):
                resp.matched_stop_str = last.matched_stop
            elif isinstance(last.matched_stop, int):
                resp.matched_stop_token_id = last.matched_stop
        for name, feature in self.engine.features.features.items():
            fields = [o.extras[name] for o in outs if name in o.extras]
            if fields:
                feature.to_proto(resp, fields)
        return resp

    async def _fail_if_error(self, last: RequestOutput, context) -> None:
        if last.finish_reason is FinishReason.ERROR:
            await context.abort(_code(last.error_code), last.error or "internal error")

    # ---- RPCs ----------------------------------------------------------------------
    async def Generate(self, request, context):
        rid, queue = await self._start(request, context)
        outs: list[RequestOutput] = []
        try:
            while not outs or outs[-1].finish_reason is None:
                outs.append(await queue.get())
        finally:
            if not outs or outs[-1].finish_reason is None:  # cancelled or deadline
                self.engine.abort(rid)
            self.router.forget(rid)
        await self._fail_if_error(outs[-1], context)
        return self._response(rid, outs)

    async def GenerateStream(self, request, context):
        rid, queue = await self._start(request, context)
        done = False
        try:  # from here on, however the RPC ends, the request does not outlive it
            # queued: the client knows now, its first token may wait for a slot (AsyncStream.queued)
            await context.send_initial_metadata(((QUEUED_METADATA_KEY, "1"),))
            while not done:
                outs = [await queue.get()]
                while not queue.empty():  # a slow reader gets merged deltas
                    outs.append(queue.get_nowait())
                done = outs[-1].finish_reason is not None
                if done:
                    await self._fail_if_error(outs[-1], context)
                yield self._response(rid, outs)
        finally:
            if not done:
                self.engine.abort(rid)
            self.router.forget(rid)

    async def Abort(self, request, context):
        return pb2.AbortResponse(found=self.engine.abort(request.request_id))

    async def Tokenize(self, request, context):
        tok = self.engine.tokenizer
        which = request.WhichOneof("input")

        def encode() -> tuple[str, list[int]]:
            if which == "chat":
                return tok.encode_chat(chat_messages(request.chat), **chat_flags(request.chat))
            if which == "text":
                return request.text, tok.encode(request.text, add_special_tokens=request.add_special_tokens)
            raise ValueError("input: set text or chat")

        def encode_expanded() -> tuple[
            str, list[int]
        ]:  # images: placeholders -> each image's run, as Generate does
            text, ids = encode()
            mm = self.engine.features.features.get("multimodal")
            payload = mm.from_proto(request) if mm is not None else None
            return text, self.engine.features.expand_prompt(
                {"multimodal": payload}, ids
            ) if payload is not None else ids

        try:
            text, ids = await self._off_loop(encode_expanded)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestError as e:
            await context.abort(_code(e.code), e.message)
        return pb2.TokenizeResponse(token_ids=ids, text=text)

    async def Detokenize(self, request, context):
        bad = next((t for t in request.token_ids if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: {bad} outside the vocabulary")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self._off_loop(lambda: self.engine.tokenizer.decode(list(request.token_ids), skip))
        return pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request, context):
        e = self.engine
        return pb2.ModelInfo(
            model_path=self.model_path,
            model_name=e.model_dir.name,
            architecture=(getattr(e.hf_config, "architectures", None) or [e.model.shape.architecture])[0],
            vocab_size=e.vocab_size,
            context_length=e.context_length,
            dtype=str(e.dtype).removeprefix("torch."),
            eos_token_ids=sorted(e.eos_ids),
            has_chat_template=e.tokenizer.has_chat_template,
        )

    async def GetServerInfo(self, request, context):
        s = self.engine.stats()
        return pb2.ServerInfo(
            scheduler_mode=s.scheduler_mode,
            max_running_requests=self.engine.args.max_running_requests,
            max_queued_requests=self.engine.args.max_queued_requests,
            kv_pool_total_tokens=s.kv_pool_total_tokens,
            kv_pool_free_tokens=s.kv_pool_free_tokens + s.prefix_cache.evictable_tokens,
            running_requests=s.running_requests,
            queued_requests=s.queued_requests,
            version=__version__,
            context_length=self.engine.context_length,
            forward_busy_fraction=s.forward_busy_fraction,
            median_forward_gap_s=s.median_forward_gap_s,
            forward_steps=s.forward_steps,
            prefix_cache_enabled=s.prefix_cache.enabled,
            prefix_cache_tokens=s.prefix_cache.cached_tokens,
            prefix_cache_prompt_tokens=s.prefix_cache.prompt_tokens,
            prefix_cache_hit_tokens=s.prefix_cache.hit_tokens,
            prefix_cache_hit_rate=s.prefix_cache.hit_rate,
            prefix_cache_evicted_tokens=s.prefix_cache.evicted_tokens,
            admission_policy=s.admission_policy,
            retractions=s.retractions,
            retraction_sync_points=s.retraction_sync_points,
            new_token_ratio=s.new_token_ratio,
        )

    async def GetFeatureMatrix(self, request, context):
        rows = [pb2.FeatureRow(**vars(r)) for r in self.engine.features.matrix()]
        return pb2.FeatureMatrix(
            rows=rows, overlap_policy=self.engine.features.policy, scheduler_mode=self.engine.mode
        )


@dataclass
class RunningServer:
    """An engine and its started gRPC server on an event loop."""

    args: ServerArgs
    engine: Engine
    server: grpc.aio.Server
    servicer: GenerationServicer
    health: health.aio.HealthServicer
    router: OutputRouter
    port: int
    metrics_http: object | None = None  # (HTTP server, thread) from prometheus_client
    smg_worker: SmgWorkerServicer | None = None  # vLLM's worker contract for SMG (service/smg_worker.py)
    health_watch: asyncio.Task | None = None  # watch_engine_health

    async def drain_and_stop(self, grace_s: float) -> None:
        """Stop admitting, let in-flight requests finish within grace_s, then stop."""
        self.servicer.draining = True
        if self.health_watch is not None:
            self.health_watch.cancel()
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.engine.num_live() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.router.queues):
            self.engine.abort(rid)
        await self.server.stop(grace=1.0)
        self.servicer.executor.shutdown(wait=False, cancel_futures=True)
        if self.metrics_http is not None:
            self.metrics_http[0].shutdown()
        self.engine.shutdown()


class StartupError(RuntimeError):
    """A setting that keeps the server from starting, said plainly (no traceback)."""


class AddressInUse(StartupError):
    """The listen address is taken (or cannot be bound): the server refuses to start."""


def check_address_free(host: str, port: int) -> None:
    """Fail fast, before the model loads, when host:port is already bound (port 0 = any is always free)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise AddressInUse(f"cannot listen on {host}:{port}: {e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does; never SO_REUSEPORT
        try:
            s.bind(addr)
        except OSError as e:
            raise AddressInUse(
                f"cannot listen on {host}:{port}: {e.strerror} (is another server running?)"
            ) from None


def server_credentials(args: ServerArgs) -> grpc.ServerCredentials | None:
    """TLS from --tls-cert/--tls-key (None: plaintext); --tls-client-ca requires verified client certificates."""
    if not args.tls_cert and not args.tls_key:
        if args.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (args.tls_cert and args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(args.tls_client_ca) if args.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(args.tls_key), read(args.tls_cert))], root_certificates=ca, require_client_auth=ca is not None
    )


def interceptors(args: ServerArgs) -> list[grpc.aio.ServerInterceptor]:
    """Token auth when any token is configured (file or $ZEROGAP_AUTH_TOKENS), then decode errors."""
    tokens = load_tokens(args.auth_token_file, os.environ)
    opened = open_service_names([s.strip() for s in args.auth_open.split(",") if s.strip()])
    auth = [TokenAuth(AuthConfig(tokens, opened))] if tokens else []
    return [*auth, DecodeErrors()]


def bind_port(
    server: grpc.aio.Server, host: str, port: int, creds: grpc.ServerCredentials | None = None
) -> int:
    """Bind exclusively: gRPC's default SO_REUSEPORT would let a second server share the port silently."""
    try:
        address = f"{host}:{port}"
        bound = (
            server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise AddressInUse(
            f"cannot listen on {host}:{port}: the address is in use or not available (is another server running?)"
        )
    return bound


async def start_server(args: ServerArgs, features: list | None = None) -> RunningServer:
    """Load the model, start the engine and a gRPC server on args.host:args.port (0 = any).
    `features`: extra feature modules beside the built-in ones (tests)."""
    check_address_free(args.host, args.port)
    try:  # bad TLS / auth settings fail before the model loads
        creds, intercept = server_credentials(args), interceptors(args)
    except (ValueError, OSError) as e:
        raise StartupError(str(e)) from None
    try:
        model_dir = resolve_model_path(args.model)
    except ValueError as e:  # not a directory, no config.json
        raise StartupError(str(e)) from None
    loop = asyncio.get_running_loop()
    router = OutputRouter(loop)
    try:
        engine = await loop.run_in_executor(None, lambda: Engine(args, model_dir, router.sink, features))
    except UnsupportedModel as e:
        raise StartupError(str(e)) from None
    router.engine = engine
    server = grpc.aio.server(
        interceptors=intercept,
        options=[
            ("grpc.max_receive_message_length", args.max_message_bytes),
            ("grpc.so_reuseport", 0),  # exclusive: a second server on the port must fail, not share it
            # Accept client keepalive pings every 10 s even on a call with no data yet (a long
            # unary Generate): the default 5 min policy would answer them with GOAWAY.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    servicer = GenerationServicer(engine, router, str(model_dir))
    pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    smg_worker = add_smg_worker(server, engine, router, str(model_dir), lambda: servicer.draining)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
        SMG_WORKER_SERVICE,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    try:
        port = bind_port(server, args.host, args.port, creds)
    except AddressInUse:
        engine.shutdown()
        raise
    await server.start()
    for name in HEALTH_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics_http = None
    if args.metrics_port is not None:
        metrics_http = start_metrics_server(args.metrics_port, args.host, engine, router)
    health_watch = asyncio.get_running_loop().create_task(watch_engine_health(engine, health_servicer))
    log.info(
        "serving %s on %s:%d (%s, %s%s)",
        model_dir.name,
        args.host,
        port,
        engine.mode,
        "mutual TLS" if args.tls_client_ca else "TLS" if creds else "plaintext",
        ", token auth" if len(intercept) > 1 else "",
    )
    return RunningServer(
        args, engine, server, servicer, health_servicer, router, port, metrics_http, smg_worker, health_watch
    )


async def watch_engine_health(engine: Engine, health_servicer: health.aio.HealthServicer) -> None:
    """grpc.health.v1 answers NOT_SERVING for good once the engine reports a fault (its scheduler
    thread gone, a failure it could not recover from): a liveness probe then restarts the replica."""
    while engine.fault() is None:
        await asyncio.sleep(HEALTH_WATCH_S)
    log.error("engine fault: %s; health is NOT_SERVING", engine.fault())
    for name in HEALTH_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def serve(args: ServerArgs) -> int:
    """Run until SIGTERM/SIGINT; then drain within the grace period and exit 0."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def main() -> None:
        running = await start_server(args)
        print(f"zerogap listening on {args.host}:{running.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down: draining for up to %.0fs", args.grace_period_s)
        await running.drain_and_stop(args.grace_period_s)

    try:
        asyncio.run(main())
    except StartupError as e:  # a taken port, bad TLS / auth settings, an unsupported architecture
        print(f"zerogap: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


class BackgroundServer:
    """A real server on its own event-loop thread (tests, benchmarks)."""

    def __init__(self, args: ServerArgs, features: list | None = None):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="zerogap-grpc", daemon=True)
        self._thread.start()
        try:
            self.running: RunningServer = asyncio.run_coroutine_threadsafe(
                start_server(args, features), self.loop
            ).result()
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            raise
        self.port = self.running.port
        self.engine = self.running.engine
        self.address = f"{args.host}:{self.port}"

    def stop(self, grace_s: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.running.drain_and_stop(grace_s), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
