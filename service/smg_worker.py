"""zerogap as an SMG worker: vLLM's worker contract (`vllm.grpc.engine.VllmEngine`) on the same engine.

SMG (Shepherd Model Gateway) serves the OpenAI API, tokenizes and applies the chat template itself,
and drives gRPC workers through one of its runtime contracts, published in `smg-grpc-proto`. This
module serves vLLM's next to `zerogap.v1` on the same server and engine (docs/deployment.md says
why this contract): token ids in and out (`Generate`, streamed as deltas then a `complete`),
sampling and stop fields, seed, constraints, logprobs, `Abort`, health, model and server info,
`GetLoads`, `GetTokenizer`, `FlushCache` and `SubscribeKvEvents` (service/kv_events.py).

`n` > 1 runs n requests on the engine, queued together, their outputs tagged with their `index` (as
vLLM's worker does); with a seed, sample i draws from its own seed derived from it
(`service.core.request.sample_seed`).

What zerogap cannot honour is refused with FAILED_PRECONDITION naming the field (the gateway answers
400): images (mm_inputs, media_refs), PD disaggregation (kv_transfer_params), data-parallel ranks
other than 0, all-vocabulary logprobs (-1). `Embed` and the profiler RPCs
answer UNIMPLEMENTED with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import math
import re
import time
import uuid
import zipfile
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from features.constrained import ConstraintSpec
from features.logprobs import LogprobParams
from service import __version__
from service.core.request import (
    GENERATION_DEFAULTS,
    MAX_SAMPLES,
    FinishReason,
    Req,
    RequestError,
    RequestOutput,
    SamplingParams,
    sample_seed,
)
from service.engine.engine import Engine
from service.kv_events import BLOCK_SIZE, KvEventPublisher, Unavailable
from service.limits import InputLimits
from service.tokenizer import InputTooLong

log = logging.getLogger("zerogap.smg_worker")

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
MAX_TOP_LOGPROBS = 20
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
)
TOKENIZER_CHUNK = 64 * 1024


def _unsupported(field: str, why: str = "not supported by zerogap") -> RequestError:
    return RequestError("FAILED_PRECONDITION", f"{field}: {why}")


def _f32(v: float) -> float:
    """A float32 wire value as the decimal the client wrote (0.9, not 0.899999976)."""
    return float(f"{v:.7g}") if math.isfinite(v) else v


def sampling_from_vllm(sp: Any) -> SamplingParams:
    """vLLM's SamplingParams -> ours, as vLLM's worker reads them: proto3 zeros keep vLLM's meaning
    (top_k 0 = off, top_p 0 = 1) and an unset temperature is 1. The model's defaults reach a request
    through the gateway, which fills the fields a client left unset from GetModelInfo's
    `default_sampling_params_json` (so a client can still turn top_k off with 0). max_tokens unset:
    None here (the worker gives the request the model's max_new_tokens, or the rest of the context)."""
    p = SamplingParams()
    if sp.HasField("temperature"):
        p.temperature = _f32(sp.temperature)
    p.top_p = _f32(sp.top_p) if sp.top_p else 1.0
    p.top_k = sp.top_k if sp.top_k > 0 else -1  # 0: off
    p.min_p = _f32(sp.min_p)
    p.frequency_penalty = _f32(sp.frequency_penalty)
    p.presence_penalty = _f32(sp.presence_penalty)
    p.repetition_penalty = _f32(sp.repetition_penalty) if sp.repetition_penalty else 1.0
    p.max_new_tokens = sp.max_tokens if sp.HasField("max_tokens") else None
    p.min_new_tokens = sp.min_tokens
    p.stop = list(sp.stop)
    p.stop_token_ids = list(sp.stop_token_ids)
    p.ignore_eos = sp.ignore_eos
    p.skip_special_tokens = sp.skip_special_tokens
    p.logit_bias = {t: _f32(v) for t, v in sp.logit_bias.items()}
    if sp.HasField("seed"):
        p.seed = sp.seed % 2**64  # int32 on the wire: its bit pattern, as the engine takes uint64 seeds
    return p


def constraint_from_vllm(sp: Any) -> ConstraintSpec | None:
    """The constraint as features/constrained.py's ConstraintSpec, or None."""
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object") if sp.json_object else None
    if kind == "grammar":
        return ConstraintSpec("ebnf", sp.grammar)
    if kind == "choice":
        if not sp.choice.choices:
            raise RequestError("INVALID_ARGUMENT", "sampling_params.choice: empty")
        # EBNF string literals as JSON writes them, but not \u-escaped: xgrammar reads a surrogate
        # pair ("\ud83d\ude00") as two code points no text can hold
        literals = (json.dumps(c, ensure_ascii=False) for c in sp.choice.choices)
        return ConstraintSpec("ebnf", "root ::= " + " | ".join(literals))
    return ConstraintSpec(kind, getattr(sp, kind))


def logprobs_from_vllm(sp: Any) -> LogprobParams | None:
    """`logprobs` (top-N per output token) and `prompt_logprobs` as features/logprobs.py's LogprobParams."""
    out = sp.logprobs if sp.HasField("logprobs") else None
    prompt = sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None
    for name, n in (("logprobs", out), ("prompt_logprobs", prompt)):
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise RequestError("INVALID_ARGUMENT", f"sampling_params.{name}: must be in [0, 20], got {n}")
    if out is None and prompt is None:
        return None
    top = max(out or 0, prompt or 0)
    return LogprobParams(
        return_logprob=True, top_logprobs_num=top, logprob_start_len=0 if prompt is not None else -1
    )


def check_supported(request: Any) -> None:
    """FAILED_PRECONDITION for what the request asks that zerogap does not do."""
    sp = request.sampling_params
    if sp.n > MAX_SAMPLES:
        raise RequestError(
            "INVALID_ARGUMENT", f"sampling_params.n: must be at most {MAX_SAMPLES}, got {sp.n}"
        )
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        raise _unsupported(
            "mm_inputs", "images are served by zerogap.v1's Generate, not this worker contract"
        )
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise _unsupported("kv_transfer_params", "no prefill/decode disaggregation")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise _unsupported("data_parallel_rank", "one rank (0)")


class OutputLog:
    """A request's logprob entries in vLLM's shape: output rows, and the prompt's once."""

    def __init__(self, top_out: int | None, top_prompt: int | None, prompt_ids: list[int]):
        self.top_out = top_out
        self.top_prompt = top_prompt
        self.prompt_ids = prompt_ids

    @staticmethod
    def _top(entry: Any, n: int) -> vllm_engine_pb2.TopLogProbs:
        top = entry[2][:n]
        return vllm_engine_pb2.TopLogProbs(values=[t[1] for t in top], token_ids=[t[0] for t in top])

    def output(self, outs: list[RequestOutput]) -> vllm_engine_pb2.OutputLogProbs | None:
        if self.top_out is None:
            return None
        lp = vllm_engine_pb2.OutputLogProbs()
        for o in outs:
            fields = o.extras.get("logprobs")
            for e in fields.output if fields is not None else ():
                lp.token_ids.append(e[0])
                lp.token_logprobs.append(e[1])
                lp.top_logprobs.append(self._top(e, self.top_out))
        return lp

    def prompt(self, outs: list[RequestOutput]) -> vllm_engine_pb2.InputLogProbs | None:
        if self.top_prompt is None:
            return None
        found = next(
            (f for f in (o.extras.get("logprobs") for o in outs) if f is not None and f.input is not None),
            None,
        )
        if found is None:
            return None
        lp = vllm_engine_pb2.InputLogProbs(token_ids=self.prompt_ids)
        by_pos = {found.input_start + i: e for i, e in enumerate(found.input)}
        for pos in range(len(self.prompt_ids)):
            e = by_pos.get(pos)
            lp.token_logprobs.append(
                vllm_engine_pb2.InputTokenLogProb(value=e[1]) if e else vllm_engine_pb2.InputTokenLogProb()
            )
            lp.top_logprobs.append(self._top(e, self.top_prompt) if e else vllm_engine_pb2.TopLogProbs())
        return lp


class RateMeter:
    """Tokens per second over about the last `window_s` seconds, from a running total read at each
    poll (GetLoads); 0.0 until two polls lie `min_span_s` apart (the gateway then assumes its default)."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 0.5):
        self.window_s, self.min_span_s = window_s, min_span_s
        self.samples: deque[tuple[float, int]] = deque()

    def rate(self, total: int, now: float) -> float:
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, n0 = self.samples[0]
        return (total - n0) / (now - t0) if now - t0 >= self.min_span_s else 0.0


class SmgWorkerServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """vllm.grpc.engine.VllmEngine over the engine that zerogap.v1 serves."""

    def __init__(
        self,
        engine: Engine,
        router: Any,  # service.server.OutputRouter: open(rid) -> the request's output queue
        model_path: str,
        draining: Callable[[], bool],
        kv_events: KvEventPublisher | None,
    ):
        self.engine = engine
        self.router = router
        self.model_path = str(Path(model_path).absolute())  # the gateway reads it from its own directory
        # the longest sequence a request can have: the context, or the KV pool if that is smaller
        self.max_context = min(engine.context_length, engine.kv_pool.size)
        self.sampling_defaults_json = _defaults_json(engine.sampling_defaults)
        self.primary_eos = engine.tokenizer.hf.eos_token_id  # None: every EOS id is named
        self.draining = draining
        self.kv_events = kv_events
        self.limits = InputLimits.from_args(engine.args)  # the bounds zerogap.v1 keeps, same flags
        self.started = time.time()
        self.last_receive = 0.0
        self._tokenizer_zip: tuple[bytes, str] | None = None
        self.samples: dict[str, list[str]] = {}  # an n > 1 request's id -> its samples' ids (for Abort)
        # request ids being validated (tokenized, grammar compiled) -> whether an Abort came meanwhile
        self.starting: dict[str, bool] = {}
        self.throughput = RateMeter()

    # ---- Generate ------------------------------------------------------------------
    def _build(self, request: Any) -> tuple[str, list[Req], OutputLog]:
        """Worker thread: the request's id, its validated Reqs (one per sample of `n`: "id/i" when
        n > 1) and their logprob shape."""
        sp = request.sampling_params
        self.limits.check(request.request_id, sp, "sampling_params")
        check_supported(request)
        keep = 0  # truncate_prompt_tokens: the last k tokens; -1: as many as fit the context
        if sp.HasField("truncate_prompt_tokens"):
            keep = sp.truncate_prompt_tokens
            if keep < -1:
                raise RequestError("INVALID_ARGUMENT", f"sampling_params.truncate_prompt_tokens: {keep}")
            keep = self.max_context - 1 if keep == -1 else keep
        which = request.WhichOneof("input")
        if which == "tokenized":
            ids = list(request.tokenized.input_ids)
        elif which == "text":
            ids = self._encode(request.text, keep)
        else:
            raise RequestError("INVALID_ARGUMENT", "input: set tokenized or text")
        if keep > 0:
            ids = ids[-keep:]
        features: dict[str, Any] = {}
        constraint = constraint_from_vllm(sp)
        if constraint is not None:
            features["constrained"] = constraint
        logprobs = logprobs_from_vllm(sp)
        if logprobs is not None:
            features["logprobs"] = logprobs
        rid = request.request_id or f"smg-{uuid.uuid4().hex}"
        params = sampling_from_vllm(sp)
        if params.max_new_tokens is None and len(ids) < self.max_context:  # unset: as vLLM's worker
            room = self.max_context - len(ids)  # the model's max_new_tokens, else the rest of the context
            params.max_new_tokens = min(self.engine.model_max_new_tokens or room, room)
        n = max(sp.n, 1)
        if n > self.engine.args.max_queued_requests:  # never fits the queue: not worth a retry
            raise RequestError(
                "INVALID_ARGUMENT",
                f"sampling_params.n: {n} samples exceed the request queue ({self.engine.args.max_queued_requests})",
            )
        reqs = [
            self.engine.build_request(
                rid if n == 1 else f"{rid}/{i}",
                ids,
                replace(params, seed=sample_seed(params.seed, i)),
                features,
            )
            for i in range(n)
        ]
        log_shape = OutputLog(
            sp.logprobs if sp.HasField("logprobs") else None,
            sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            reqs[0].prompt_ids,
        )
        return rid, reqs, log_shape

    def _encode(self, text: str, keep: int) -> list[int]:
        """A text prompt's ids; with truncation (`keep` > 0) only its tail is tokenized: the last `keep`
        tokens lie in its last `keep` x max_token_bytes characters (no token covers more bytes), and a
        margin keeps the tail's first tokens, cut where the text was, out of them."""
        tok = self.engine.tokenizer
        if keep > 0:
            tail = (keep + 16) * tok.max_token_bytes
            return tok.encode(text[-tail:], add_special_tokens=len(text) <= tail)
        try:
            return tok.encode_bounded(text, self.engine.context_length - 1)
        except InputTooLong as e:
            raise RequestError("OUT_OF_RANGE", f"text: does not fit the context length: {e}") from None

    async def _start(
        self, request: Any, context: Any
    ) -> tuple[str, list[Req], asyncio.Queue[RequestOutput], OutputLog]:
        """Submit the request's samples together; their outputs all come through one queue. An
        Abort that comes while it is being validated refuses it (CANCELLED) before it is submitted."""
        self.last_receive = time.time()
        if self.draining():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        key = request.request_id
        if key:  # an empty id cannot be aborted
            self.starting.setdefault(key, False)
        try:
            rid, reqs, log_shape = await asyncio.get_running_loop().run_in_executor(
                None, self._build, request
            )
            for req in reqs:
                for fut in self.engine.features.pending(req):  # a grammar's errors before admission
                    try:
                        await asyncio.wrap_future(fut)
                    except RequestError as e:
                        raise _final(e) from None
            if self.starting.get(key):
                raise RequestError("CANCELLED", f"request {rid!r} was aborted before it started")
            self.engine.submit_all(reqs)
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            shared = self.engine.shares_prompt(reqs[0])  # n samples' prompt: counted once then
            for i, req in enumerate(reqs):
                self.router.open(req.rid, queue, prefill=req if i == 0 or not shared else None)
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), in_vllm_terms(e.message))
        finally:
            self.starting.pop(key, None)
        if len(reqs) > 1:
            self.samples[rid] = [r.rid for r in reqs]
        return rid, reqs, queue, log_shape

    async def Generate(self, request, context):
        rid, reqs, queue, lp = await self._start(request, context)
        stop_ids = frozenset(request.sampling_params.stop_token_ids)  # the client's own
        mine = self.samples.get(rid)
        index = {r.rid: i for i, r in enumerate(reqs)}
        live = set(index)  # the samples not finished yet
        fresh = set(index.values())  # the samples that have sent no chunk yet
        outs: list[list[RequestOutput]] = [[] for _ in reqs]
        try:
            while live:
                batch = [await queue.get()]
                while not queue.empty():  # a slow reader gets merged deltas
                    batch.append(queue.get_nowait())
                for sample, group in _by_request(batch):
                    i, last = index[sample], group[-1]
                    done = last.finish_reason is not None
                    if done:
                        live.discard(sample)
                        if last.finish_reason is FinishReason.ERROR:
                            await context.abort(
                                getattr(grpc.StatusCode, last.error_code), last.error or "internal error"
                            )
                    if not request.stream:
                        outs[i] += group
                        continue
                    tokens = [t for o in group for t in o.token_ids]
                    if tokens or i in fresh:
                        yield vllm_engine_pb2.GenerateResponse(
                            chunk=vllm_engine_pb2.GenerateStreamChunk(
                                token_ids=tokens,
                                prompt_tokens=last.prompt_tokens,
                                completion_tokens=len(tokens),  # a delta: the gateway adds them up
                                cached_tokens=last.cached_tokens,
                                output_logprobs=lp.output(group),
                                input_logprobs=lp.prompt(group) if i in fresh else None,
                                index=i,
                            )
                        )
                        fresh.discard(i)
                    if done:
                        yield self._complete(tokens, group, lp, i, True, stop_ids)
            if not request.stream:
                for i, sample in enumerate(outs):
                    yield self._complete(
                        [t for o in sample for t in o.token_ids], sample, lp, i, False, stop_ids
                    )
        finally:
            for sample in live:  # the gateway went away or sent a deadline: free the samples' KV now
                self.engine.abort(sample)
            for req in reqs:
                self.router.forget(req.rid)
            if len(reqs) > 1 and self.samples.get(rid) is mine:  # not a later call's, same id
                del self.samples[rid]

    def _complete(
        self,
        tokens: list[int],
        outs: list[RequestOutput],
        lp: OutputLog,
        index: int,
        stream: bool,
        stop_ids: frozenset[int],
    ) -> vllm_engine_pb2.GenerateResponse:
        """A sample's final message: all tokens (streamed: the last delta, as vLLM sends it)."""
        last = outs[-1]
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=tokens,
            finish_reason=FINISH[last.finish_reason],
            prompt_tokens=last.prompt_tokens,
            completion_tokens=len(tokens) if stream else last.completion_tokens,
            cached_tokens=last.cached_tokens,
            output_logprobs=None if stream else lp.output(outs),
            input_logprobs=None if stream else lp.prompt(outs),
            index=index,
        )
        if isinstance(last.matched_stop, str):
            complete.matched_stop_str = last.matched_stop
        elif isinstance(last.matched_stop, int) and (
            last.matched_stop in stop_ids or last.matched_stop != self.primary_eos
        ):  # as vLLM's: none for the tokenizer's EOS unless listed, the model's other EOS ids named
            complete.matched_token_id = last.matched_stop
        return vllm_engine_pb2.GenerateResponse(complete=complete)

    async def Abort(self, request, context):
        for rid in request.request_ids:
            samples = self.samples.get(rid)
            if samples is not None:
                for sample in samples:
                    self.engine.abort(sample)
            elif not self.engine.abort(rid) and rid in self.starting:  # not submitted yet
                self.starting[rid] = True
        return vllm_engine_pb2.AbortResponse()

    # ---- what the contract has and zerogap does not offer: UNIMPLEMENTED, saying why ------------
    async def Embed(self, request, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "Embed: zerogap serves generation only (GetModelInfo.is_generation); no embeddings",
        )

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile: profiling is not offered over gRPC")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: profiling is not offered over gRPC")

    # ---- health, info, loads -------------------------------------------------------
    async def HealthCheck(self, request, context):
        if self.draining():
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="shutting down")
        fault = self.engine.fault()
        if fault is not None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=fault)
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request, context):
        e = self.engine
        cfg, tok = e.config, e.tokenizer
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=self.model_path,
            tokenizer_path=self.model_path,
            served_model_name=Path(self.model_path).name,
            is_generation=True,
            max_context_length=self.max_context,
            vocab_size=e.vocab_size,
            supports_vision=False,
            model_type=getattr(e.hf_config, "model_type", "") or "",
            architectures=list(getattr(e.hf_config, "architectures", None) or [e.model.shape.architecture]),
            eos_token_ids=sorted(e.eos_ids),
            pad_token_id=_int(getattr(cfg, "pad_token_id", None), getattr(tok, "pad_token_id", None)),
            bos_token_id=_int(getattr(cfg, "bos_token_id", None)),
            max_req_input_len=self.max_context - 1,
            default_sampling_params_json=self.sampling_defaults_json,
        )

    async def GetServerInfo(self, request, context):
        s = self.engine.stats()
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=s.running_requests + s.queued_requests,
            is_paused=self.draining(),
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started,
            server_type=f"zerogap-grpc {__version__}",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=self.kv_events.block_size if self.kv_events else BLOCK_SIZE,
            model_dtype=str(self.engine.dtype).removeprefix("torch."),
            max_num_seqs=self.engine.args.max_running_requests,
            constrained_decoding_start="first_token",  # a constraint applies from the first output token
        )

    def engine_load(self, full: bool) -> common_pb2.EngineLoad:
        """The engine's load now: what GetLoads answers, and the record the KV event stream carries
        (SMG routes by it between GetLoads polls); `full` adds the telemetry beyond the routing core."""
        o = self.engine.occupancy()
        total = o.kv_pool_total_tokens
        used = total - o.kv_pool_free_tokens - o.evictable_tokens  # cached prefixes nobody uses: free
        usage = used / total if total else 0.0
        record = common_pb2.EngineLoad(
            running_requests=o.running_requests,
            waiting_requests=o.queued_requests,
            waiting_uncached_tokens=self.router.queued_prompt_tokens(),  # both services' requests
            token_usage=usage,
            active_token_usage=usage,  # evictable cached prefixes are not counted as used
            gen_throughput=self.throughput.rate(self.router.completion_tokens, time.monotonic()),
            max_running_requests=self.engine.args.max_running_requests,
        )
        if full:
            record.cache_hit_rate = o.prefix_hit_rate
            record.num_used_tokens = used
            record.max_total_num_tokens = total
            record.queues.waiting = o.queued_requests
        return record

    async def GetLoads(self, request, context):
        loads = []
        if not request.HasField("dp_rank") or request.dp_rank == 0:
            r = self.engine_load(full=True)
            loads.append(
                vllm_engine_pb2.SchedulerLoad(
                    dp_rank=0,
                    num_running_reqs=r.running_requests,
                    num_waiting_reqs=r.waiting_requests,
                    num_total_reqs=r.running_requests + r.waiting_requests,
                    num_used_tokens=r.num_used_tokens,
                    max_total_num_tokens=r.max_total_num_tokens,
                    token_usage=r.token_usage,
                    cache_hit_rate=r.cache_hit_rate,
                    utilization=self.engine.timeline.forward_stats()[0],
                    max_running_requests=r.max_running_requests,
                    gen_throughput=r.gen_throughput,
                    num_waiting_uncached_tokens=r.waiting_uncached_tokens,
                )
            )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=f"zerogap {__version__}",
            dp_rank_count=1,
            loads=loads,
        )

    # ---- tokenizer, cache ----------------------------------------------------------
    def _zip_tokenizer(self) -> tuple[bytes, str]:
        """The model directory's tokenizer files (chat templates and tiktoken files included) as a zip
        and its sha256; RequestError when it holds no tokenizer."""
        if self._tokenizer_zip is None:
            buf, root = io.BytesIO(), Path(self.model_path)
            names = sorted(
                {n for n in TOKENIZER_FILES if (root / n).is_file()}
                | {f.name for pattern in ("*.jinja", "*.tiktoken") for f in root.glob(pattern) if f.is_file()}
            )
            if not names or names == ["config.json"]:
                raise RequestError("FAILED_PRECONDITION", f"no tokenizer files in {root}")
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
                for name in names:
                    zf.write(root / name, name)
            data = buf.getvalue()
            self._tokenizer_zip = data, hashlib.sha256(data).hexdigest()
        return self._tokenizer_zip

    async def GetTokenizer(self, request, context):
        try:
            data, digest = await asyncio.get_running_loop().run_in_executor(None, self._zip_tokenizer)
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        for i in range(0, len(data), TOKENIZER_CHUNK):
            last = i + TOKENIZER_CHUNK >= len(data)
            yield common_pb2.GetTokenizerChunk(
                data=data[i : i + TOKENIZER_CHUNK], sha256=digest if last else ""
            )

    async def FlushCache(self, request, context):
        """Wait up to timeout_s for the engine to go idle, then empty the prefix cache."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(request.timeout_s, 0.0)
        while self.engine.num_live() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.engine.num_live():
            return common_pb2.FlushCacheResponse(
                success=False, message=f"{self.engine.num_live()} requests in flight; nothing flushed"
            )
        freed = await loop.run_in_executor(None, self.engine.flush_prefix_cache)
        return common_pb2.FlushCacheResponse(success=True, message=f"flushed {freed} cached tokens")

    async def SubscribeKvEvents(self, request, context):
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the prefix cache is off: no KV events")
        await context.send_initial_metadata(())  # the gateway's subscribe call returns at once
        try:
            batches = self.kv_events.subscribe(
                request.start_sequence_number, request.load_records_before_first_batch
            )
            async with contextlib.aclosing(batches):  # a cancelled RPC unsubscribes at once
                async for batch in batches:
                    yield batch
        except Unavailable as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)


def _by_request(outputs: list[RequestOutput]) -> list[tuple[str, list[RequestOutput]]]:
    """Outputs grouped by request, in order of each request's first output."""
    groups: dict[str, list[RequestOutput]] = {}
    for o in outputs:
        groups.setdefault(o.rid, []).append(o)
    return list(groups.items())


VLLM_NAMES = {  # the engine's field names (zerogap.v1's) -> this contract's
    "sampling.max_new_tokens": "sampling_params.max_tokens",
    "sampling.min_new_tokens": "sampling_params.min_tokens",
    "max_new_tokens": "max_tokens",
    "sampling.": "sampling_params.",
    "input.token_ids": "tokenized.input_ids",
}
_VLLM_NAME = re.compile("|".join(re.escape(k) for k in VLLM_NAMES))


def in_vllm_terms(message: str) -> str:
    """A refusal's message naming the fields as the client sent them (max_tokens, not zerogap.v1's
    max_new_tokens)."""
    return _VLLM_NAME.sub(lambda m: VLLM_NAMES[m.group(0)], message)


def _final(e: RequestError) -> RequestError:
    """A grammar whose own compile reached a limit (time, memory: GrammarError.heavy) as
    INVALID_ARGUMENT: the gateway retries DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED (five times, each a
    whole compile), and the same schema would fail the same way. One that waited too long for a
    compile worker keeps its status: under less load it compiles."""
    if getattr(e, "heavy", False):
        return RequestError("INVALID_ARGUMENT", f"{e.message} (the constraint is over the compile limits)")
    return e


def _defaults_json(defaults: SamplingParams) -> str:
    """The model's sampling defaults as vLLM's worker publishes them (GetModelInfo): the gateway fills
    a request's unset fields with them. Only the fields that differ from the built-in defaults."""
    built_in = SamplingParams()
    found = {
        name: getattr(defaults, name)
        for name in GENERATION_DEFAULTS
        if getattr(defaults, name) != getattr(built_in, name)
    }
    return json.dumps(found, separators=(",", ":")) if found else ""


def _int(*values: Any) -> int:
    """The first value that is an int (a token id), else 0."""
    for v in values:
        if isinstance(v, int):
            return v
        if isinstance(v, list) and v and isinstance(v[0], int):
            return v[0]
    return 0


def add_smg_worker(
    server: grpc.aio.Server, engine: Engine, router: Any, model_path: str, draining: Callable[[], bool]
) -> SmgWorkerServicer:
    """Serve the vLLM worker contract on `server`, its KV events fed by the engine's prefix cache."""
    publisher = KvEventPublisher(asyncio.get_running_loop())
    if not engine.observe_prefix_cache(publisher.observe):
        publisher = None
    servicer = SmgWorkerServicer(engine, router, model_path, draining, publisher)
    if publisher is not None:
        publisher.report_load(servicer.engine_load)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    return servicer
