"""The engine: model, KV pools, workers and the scheduler thread, behind one API.

`Engine.submit` validates and tokenizes on the caller's thread, then hands a
Req to the scheduler thread; outputs come back through the sink given at
construction (called on the scheduler thread, once per step with all deltas).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from features import Feature, FeatureRegistry
from service.config import ServerArgs, resolve_dtype
from service.core.device import Device
from service.core.feature import FeatureContext
from service.core.omp import on_passing_thread
from service.core.request import (
    DEFAULT_MAX_NEW_TOKENS,
    OutputSink,
    Req,
    RequestError,
    RequestOutput,
    SamplingParams,
    generation_defaults,
)
from service.core.text import IncrementalDetokenizer
from service.engine.cache_manager import PrefixCacheInfo, PrefixCacheManager
from service.engine.chunking import PrefillChunker
from service.engine.cpu_threads import AdaptiveTeam, cpu_grant, granted_memory_bytes
from service.engine.cuda_graph import build_decode_graphs
from service.engine.kv_cache import ReqToTokenPool, SlotStates, TokenToKVPool
from service.engine.model_worker import ModelWorker
from service.engine.modules import builtin_features
from service.engine.prefix_cache import CacheObserver
from service.engine.sampler import Sampler
from service.engine.scheduler import Scheduler
from service.engine.scheduler.admission import AdmissionPolicy, RetractionConfig
from service.engine.scheduler.prefill import PrefillLimits
from service.engine.state_snapshots import StateSnapshots
from service.engine.timeline import Timeline
from service.models.backends import get_attention_backend, resolve_attention_backend
from service.models.cpu_features import cpu_features
from service.models.families import model_shape, refuse_quantized
from service.models.layers import UnsupportedModel
from service.models.loader import load_config, load_generation_config, load_model
from service.models.vision import text_config
from service.tokenizer import Tokenizer

log = logging.getLogger("zerogap.engine")


@dataclass
class EngineStats:
    scheduler_mode: str
    running_requests: int
    queued_requests: int
    kv_pool_total_tokens: int
    kv_pool_free_tokens: int
    forward_busy_fraction: float
    median_forward_gap_s: float
    forward_steps: int
    prefix_cache: PrefixCacheInfo  # kv_pool_free_tokens above counts only rows on the free list
    admission_policy: str = "reserve"
    retractions: int = 0
    retraction_sync_points: int = 0
    new_token_ratio: float = 1.0


@dataclass
class EngineOccupancy:
    """What a router balances by, cheap to read from another thread (an estimate: the scheduler
    thread may be part-way through a step)."""

    running_requests: int  # holding a slot, not finished (a prompt part-way through its chunks too)
    queued_requests: int
    kv_pool_total_tokens: int
    kv_pool_free_tokens: int
    evictable_tokens: int  # rows of cached prefixes no request uses: free for the taking
    prefix_hit_rate: float  # prompt tokens served from the prefix cache, over all prompt tokens


MIN_STATE_SNAPSHOTS = 8  # by default, whatever the KV share (see Engine._state_snapshot_count)


class Engine:
    """Loads a model directory and runs the scheduler thread over it."""

    def __init__(
        self,
        args: ServerArgs,
        model_dir: str | Path,
        output_sink: OutputSink,
        features: list[Feature] | None = None,
    ):
        self.args = args
        self.features = FeatureRegistry(
            builtin_features() + list(features or []), args.disabled_features, args.overlap_policy
        )
        self.model_dir = Path(model_dir)
        self.hf_config = load_config(
            self.model_dir
        )  # the whole model's (a LLaVA's: vision tower, image token)
        refuse_quantized(self.hf_config)  # a vision-language model says so at its top level
        self.config = text_config(self.hf_config)  # the language model's
        shape = model_shape(self.config)  # an unsupported architecture is refused before anything loads
        try:
            self.tokenizer = Tokenizer(self.model_dir)
        except (OSError, ValueError) as e:
            raise UnsupportedModel.because(
                f"{self.model_dir}: no tokenizer transformers can load", e
            ) from None
        self.generation_config = load_generation_config(self.model_dir)  # EOS ids, sampling defaults
        # what a request's unset sampling fields take, and its max_new_tokens (capped by the context):
        # the model's (None: it sets none), else the built-in default
        self.sampling_defaults, self.model_max_new_tokens = (
            generation_defaults(self.generation_config)
            if args.sampling_defaults == "model"
            else (SamplingParams(), None)
        )
        self.default_max_new_tokens = self.model_max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        built_in = SamplingParams()
        changed = {k: v for k, v in vars(self.sampling_defaults).items() if v != getattr(built_in, k)}
        if self.model_max_new_tokens is not None:
            changed["max_new_tokens"] = self.model_max_new_tokens
        if changed:
            log.info("sampling defaults from generation_config.json: %s", changed)
        self.device = Device.of(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device.device.type)
        self.cpu_threads = None if self.device.is_cuda else self._size_cpu_threads(args.num_threads)
        self.overlap = self.features.resolve_overlap(args.use_overlap(self.device.device.type))
        self.context_length = args.context_length or getattr(self.config, "max_position_embeddings", 2048)
        if shape.learned_positions is not None and self.context_length > shape.max_position_embeddings:
            raise UnsupportedModel(
                f"--context-length {self.context_length}: this model learned "
                f"{shape.max_position_embeddings} positions, no more"
            )
        t0 = time.perf_counter()
        # CPU: the one-time parallel work on a thread that exits, so the forward's thread keeps the only
        # OpenMP team (service/core/omp.py); CUDA: here (graph capture and the current device stay on this thread).
        kv_tokens = self._load() if self.device.is_cuda else on_passing_thread(self._load)
        shape = self.model.shape
        self.scheduler = Scheduler(
            self.worker,
            self.req_pool,
            self.kv_pool,
            self.vocab_size,
            PrefillLimits(args.max_running_requests, args.max_prefill_tokens, args.max_skip_ahead),
            self.timeline,
            output_sink,
            overlap=self.overlap,
            features=self.features,
            future_map_size=args.future_map_size,
            chunker=self._chunker(args),
            prefix_cache=self._prefix_cache(),
            admission=self._admission_policy(args),
            pace_launches=args.pace_launches,
        )
        self._live: set[str] = set()
        self._live_lock = threading.Lock()
        if self.device.is_cuda:  # weights and pools were filled on the default stream
            torch.cuda.synchronize(self.device.device)
        self._thread = threading.Thread(target=self.scheduler.run, name="zerogap-scheduler", daemon=True)
        self._thread.start()
        log.info(
            "engine ready in %.1fs: %s, %s on %s, attention=%s, cuda graphs=%s, kv=%d tokens, mode=%s",
            time.perf_counter() - t0,
            shape.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device.device,
            self.attention_backend,
            self.worker.graphs is not None,
            kv_tokens,
            self.mode,
        )

    def _size_cpu_threads(self, asked: int | None) -> int:
        """One CPU-op thread per CPU actually granted (affinity mask, cgroup quota), or --num-threads;
        says what it found, and warns where the dtype asked for is emulated on this CPU."""
        grant, cpu = cpu_grant(), cpu_features()
        threads = asked or grant.threads
        # Always set: besides this thread's team it sets torch's process-wide count, which each new
        # thread (the set-up thread, the forward thread) takes at its first op; another thread's
        # torch.set_num_threads (an adaptive team's, an earlier engine's) may have left it elsewhere.
        torch.set_num_threads(threads)
        log.info(
            "CPU: %s; native kernels: %s; %s",
            cpu.describe(),
            cpu.kernel_variant(),
            f"{threads} threads (--num-threads)" if asked else grant.describe(),
        )
        if self.dtype == torch.bfloat16 and not cpu.native_bf16:
            log.warning(
                "bfloat16 on a CPU without AVX-512 BF16 or AMX runs emulated, several times slower than "
                "float32 (--dtype auto picks float32 here)"
            )
        return threads

    def _load(self) -> int:
        """Weights, pools, sampler and worker (the one-time parallel CPU work); the KV pool's size."""
        args = self.args
        self.model = load_model(
            self.model_dir,
            self.dtype,
            self.context_length,
            self.hf_config,
            self.device.device,
            args.load_format,
        )
        shape = self.model.shape
        self.vocab_size = shape.vocab_size
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids(self.config, self.generation_config))
        self.feature_context = FeatureContext(
            args=args,
            tokenizer=self.tokenizer,
            hf_config=self.hf_config,
            model_dir=self.model_dir,
            device=self.device,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            eos_ids=self.eos_ids,
            count_tokens=lambda slots, tokens: self.worker.sampler.count_tokens(slots, tokens),
        )
        self.features.bind(self.feature_context)
        specs = shape.state_specs(self.dtype)
        self.state_snapshots = self._state_snapshot_count(specs) if any(specs) else 0
        kv_tokens = args.kv_cache_tokens or self._kv_tokens_from_memory()
        dev = self.device.device
        self.kv_pool = TokenToKVPool(
            kv_tokens,
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            self.dtype,
            dev,
            kv_layers=shape.kv_layers,
            states=SlotStates(args.max_running_requests, specs, dev, self.state_snapshots)
            if any(specs)
            else None,
        )
        self.req_pool = ReqToTokenPool(args.max_running_requests, self.context_length, dev)
        self.timeline = Timeline(keep_trace=bool(args.trace_file))
        self.attention_backend = resolve_attention_backend(args.attention_backend, self.device)
        self.worker = ModelWorker(
            self.model,
            self.kv_pool,
            Sampler(args.max_running_requests, self.vocab_size, dev),
            get_attention_backend(self.attention_backend, cpu_team=self.cpu_threads, dtype=self.dtype),
            self.timeline,
            self.device,
            cpu_team=AdaptiveTeam(self.cpu_threads) if self.cpu_threads and args.adapt_cpu_team else None,
        )
        graphs_fit = self.kv_pool.states is None  # recurrent layers' states: no graphs (yet)
        if (
            self.device.is_cuda
            and self.attention_backend == "triton"
            and not args.disable_cuda_graph
            and graphs_fit
        ):
            max_bs = min(args.cuda_graph_max_bs or args.max_running_requests, args.max_running_requests)
            self.worker.graphs = build_decode_graphs(
                self.model, self.kv_pool, self.worker.attention, dev, max_bs, self.context_length
            )
        return kv_tokens

    def _prefix_cache(self) -> PrefixCacheManager | None:
        """On unless --disable-prefix-cache (or --disable-feature prefix_cache)."""
        if self.args.disable_prefix_cache or not self.features.enabled.get("prefix_cache", False):
            return None
        why = self.features.features["prefix_cache"].unavailable_reason(self.feature_context)
        if why is not None:
            log.info("prefix cache off: %s", why)
            return None
        states = None
        if self.kv_pool.states is not None:  # recurrent layers: snapshots of their states
            states = StateSnapshots(self.args.max_running_requests, self.state_snapshots, self.device)
            log.info(
                "prefix cache: %d snapshots of the recurrent layers' states (%.1f MiB each)",
                self.state_snapshots,
                SlotStates.bytes_per_slot(self.model.shape.state_specs(self.dtype)) / 2**20,
            )
        return PrefixCacheManager(self.req_pool, self.kv_pool, self.device, states)

    def _chunker(self, args: ServerArgs) -> PrefillChunker | None:
        """Chunked prefill and mixed batches (chunking.py); None: whole prompts per step."""
        feature = self.features.features.get("chunked_prefill")
        if args.chunked_prefill_size <= 0 or feature is None or not self.features.enabled[feature.name]:
            return None
        return PrefillChunker(args.chunked_prefill_size, args.enable_mixed_chunk, feature)  # type: ignore[arg-type]

    def _admission_policy(self, args: ServerArgs) -> AdmissionPolicy:
        """--admission-policy; a disabled retraction module means `reserve` (nothing is ever retracted)."""
        policy = args.admission_policy if self.features.enabled_feature("retraction") else "reserve"
        return AdmissionPolicy(
            RetractionConfig(
                policy=policy,
                init_ratio=args.init_new_token_ratio,
                min_ratio=args.min_new_token_ratio,
                decay_steps=args.new_token_ratio_decay_steps,
                max_retractions=args.max_retractions,
            )
        )

    @property
    def mode(self) -> str:
        return "overlap" if self.overlap else "normal"

    def _kv_share_bytes(self) -> int:
        """--kv-mem-fraction of the memory granted (the host's, or its cgroup's limit; CUDA: of free GPU
        memory)."""
        if self.device.is_cuda:
            memory = torch.cuda.mem_get_info(self.device.device)[0]
        else:
            memory = granted_memory_bytes()
        return int(memory * self.args.kv_mem_fraction)

    def _state_snapshot_count(self, specs: list) -> int:
        """How many snapshots of the recurrent layers' states the prefix cache keeps (--state-snapshots;
        by default half of the KV share the running requests' states leave, at most one per request slot,
        and at least 8 (or one per slot, if fewer) even where the running requests' states fill the share:
        a few conversations' worth; none without a prefix cache)."""
        args = self.args
        if args.state_snapshots is not None and args.state_snapshots < 0:
            raise ValueError(f"--state-snapshots {args.state_snapshots}: must be 0 or more")
        if args.disable_prefix_cache or not self.features.enabled.get("prefix_cache", False):
            return 0
        if args.state_snapshots is not None:
            return args.state_snapshots
        per_slot = SlotStates.bytes_per_slot(specs)
        left = self._kv_share_bytes() - args.max_running_requests * per_slot
        return min(args.max_running_requests, max(MIN_STATE_SNAPSHOTS, left // 2 // per_slot))

    def _kv_tokens_from_memory(self) -> int:
        s = self.model.shape
        # (a model without attention keeps no K/V rows: its pool holds only token bookkeeping)
        per_token = max(
            1, TokenToKVPool.bytes_per_token(sum(s.kv_layers), s.num_kv_heads, s.head_dim, self.dtype)
        )
        # recurrent layers' states, one set per request slot and per snapshot, come out of the same share
        rows = self.args.max_running_requests + self.state_snapshots
        states = rows * SlotStates.bytes_per_slot(s.state_specs(self.dtype))
        tokens = max(0, self._kv_share_bytes() - states) // per_token
        return max(1, min(tokens, self.args.max_running_requests * self.context_length))

    # ---- requests ------------------------------------------------------------------
    def build_request(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, features: dict[str, Any] | None = None
    ) -> Req:
        """Validate a request against the model, limits and features; raises RequestError."""
        prompt_ids = self.features.expand_prompt(
            features or {}, prompt_ids
        )  # e.g. image placeholders expanded
        if not prompt_ids:
            raise RequestError("INVALID_ARGUMENT", "input: the prompt is empty")
        if len(prompt_ids) >= self.context_length:  # before looking at each id
            raise RequestError(
                "OUT_OF_RANGE",
                f"input: prompt of {len(prompt_ids)} tokens does not fit the context length {self.context_length}",
            )
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                "INVALID_ARGUMENT",
                f"input.token_ids: token id {bad} outside the vocabulary [0, {self.vocab_size})",
            )
        params.validate(self.vocab_size)
        n = len(prompt_ids)
        if n >= self.context_length:
            raise RequestError(
                "OUT_OF_RANGE",
                f"input: prompt of {n} tokens does not fit the context length {self.context_length}",
            )
        if params.max_new_tokens is None:
            params.max_new_tokens = min(self.default_max_new_tokens, self.context_length - n)
            if params.min_new_tokens > params.max_new_tokens:
                raise RequestError(
                    "INVALID_ARGUMENT",
                    "sampling.min_new_tokens: exceeds the default max_new_tokens; set max_new_tokens",
                )
        elif n + params.max_new_tokens > self.context_length:
            raise RequestError(
                "OUT_OF_RANGE",
                f"sampling.max_new_tokens: prompt ({n}) + max_new_tokens ({params.max_new_tokens}) exceeds the context length {self.context_length}",
            )
        if n + params.max_new_tokens > self.kv_pool.size:  # never fits, however long it waits
            raise RequestError(
                "OUT_OF_RANGE",
                f"request needs {n + params.max_new_tokens} KV tokens but the pool holds {self.kv_pool.size}",
            )
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        if seed >= 2**63:  # uint64 seeds as their int64 bit pattern (no collisions, fits a tensor)
            seed -= 2**64
        payloads = self.features.validate_request(features or {}, self.feature_context, prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        return Req(rid, list(prompt_ids), params, seed, detok, stop_ids, payloads)

    def submit(self, req: Req) -> None:
        """Queue a validated request; raises RequestError when the queue is full or the id is live."""
        self.submit_all([req])

    def submit_all(self, reqs: list[Req]) -> None:
        """Queue validated requests so that the scheduler sees them together (all or none)."""
        with self._live_lock:
            rids = [r.rid for r in reqs]
            seen: set[str] = set()
            for rid in rids:
                if rid in self._live or rid in seen:
                    raise RequestError("ALREADY_EXISTS", f"request_id {rid!r} is already running")
                seen.add(rid)
            if self.scheduler.queued_requests + len(reqs) > self.args.max_queued_requests:
                raise RequestError(
                    "RESOURCE_EXHAUSTED", f"the request queue is full ({self.args.max_queued_requests})"
                )
            self._live.update(rids)
        self.scheduler.add_requests(reqs)

    def on_finished(self, rid: str) -> None:
        """Called by the output router when a request's last output was delivered."""
        with self._live_lock:
            self._live.discard(rid)

    def abort(self, rid: str) -> bool:
        with self._live_lock:
            found = rid in self._live
        if found:
            self.scheduler.abort_request(rid)
        return found

    def fault(self) -> str | None:
        """Why the engine cannot serve (its scheduler thread is gone, or a failure it could not recover
        from); None while it can. Health checks report it."""
        if not self._thread.is_alive():
            return "the scheduler thread has stopped"
        return self.scheduler.broken

    def num_live(self) -> int:
        with self._live_lock:
            return len(self._live)

    def occupancy(self) -> EngineOccupancy:
        s = self.scheduler
        cache = s.prefix_cache.info()
        return EngineOccupancy(
            # (finished ones leave the list at the next batch formed: up to an idle wait later)
            running_requests=sum(1 for r in list(s.running) if r.finished is None)
            + (s.chunker.holding if s.chunker is not None else 0),
            queued_requests=s.queued_requests,
            kv_pool_total_tokens=self.kv_pool.size,
            kv_pool_free_tokens=self.kv_pool.free_count,
            evictable_tokens=cache.evictable_tokens,
            prefix_hit_rate=cache.hit_rate,
        )

    def stats(self) -> EngineStats:
        busy, gap = self.timeline.forward_stats()
        s = self.scheduler
        o = self.occupancy()
        return EngineStats(
            scheduler_mode=self.mode,
            running_requests=o.running_requests,
            queued_requests=o.queued_requests,
            kv_pool_total_tokens=o.kv_pool_total_tokens,
            kv_pool_free_tokens=o.kv_pool_free_tokens,
            forward_busy_fraction=busy,
            median_forward_gap_s=gap,
            forward_steps=self.timeline.forward_steps,
            prefix_cache=s.prefix_cache.info(),
            admission_policy=s.admission.config.policy,
            retractions=s.admission.stats.retractions,
            retraction_sync_points=s.admission.stats.sync_points,
            new_token_ratio=s.admission.ratio if s.admission.optimistic else 1.0,
        )

    # ---- prefix cache --------------------------------------------------------------
    def flush_prefix_cache(self, timeout: float = 30.0) -> int:
        """Evict every cached prefix no running request uses (everything when idle); the rows freed."""
        return self.scheduler.flush_prefix_cache().result(timeout)

    def shares_prompt(self, req: Req) -> bool:
        """Whether requests with `req`'s prompt prefill it once between them: the prefix cache is on
        (however it was turned off) and no feature keeps `req` from taking it from there (prompt
        logprobs)."""
        return self.scheduler.prefix_cache.enabled and self.features.max_cached_prefix(req) is None

    def observe_prefix_cache(self, observer: CacheObserver) -> bool:
        """Tell `observer` every change of what the prefix cache holds (on the scheduler thread, from
        now on); False when the cache is off. Register before serving: the tree is not read here."""
        tree = getattr(self.scheduler.prefix_cache, "tree", None)
        if tree is None:
            return False
        tree.observers.append(observer)
        return True

    def kv_all_free(self) -> bool:
        """Leak check: every KV row (and state snapshot row) is free once the prefix cache is flushed."""
        self.flush_prefix_cache()
        held = self.scheduler.prefix_cache.info().state_snapshots
        return self.kv_pool.free_count == self.kv_pool.size and not held

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.features.shutdown()  # e.g. grammar compiles: stopped, never waited for
        self._thread.join(timeout=30)
        if self.args.trace_file:
            self.timeline.write_chrome_trace(self.args.trace_file)


class SyncClient:
    """Blocking in-process client for the engine (tests, benchmarks, scripts)."""

    def __init__(self, args: ServerArgs, model_dir: str | Path, features: list[Feature] | None = None):
        self._cv = threading.Condition()
        self._outputs: dict[str, list[RequestOutput]] = {}
        self.engine = Engine(args, model_dir, self._sink, features)

    def _sink(self, outputs: list[RequestOutput]) -> None:
        with self._cv:
            for o in outputs:
                self._outputs.setdefault(o.rid, []).append(o)
                if o.finish_reason is not None:
                    self.engine.on_finished(o.rid)
            self._cv.notify_all()

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        features: dict[str, Any] | None = None,
    ) -> None:
        self.engine.submit(self.engine.build_request(rid, prompt_ids, params or SamplingParams(), features))

    def wait(self, rid: str, timeout: float = 300.0) -> list[RequestOutput]:
        """All outputs of a request once it finished."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                outs = self._outputs.get(rid, [])
                if outs and outs[-1].finish_reason is not None:
                    return self._outputs.pop(rid)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"request {rid} did not finish in {timeout}s")
                self._cv.wait(left)

    def wait_streaming(self, rids: list[str], timeout: float = 300.0) -> None:
        """Block until each request streamed a token or finished (its outputs stay for `wait`)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not all(
                any(o.token_ids or o.finish_reason is not None for o in self._outputs.get(r, []))
                for r in rids
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"requests did not start streaming in {timeout}s")
                self._cv.wait(left)

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams | None = None,
        features: list[dict[str, Any] | None] | None = None,
    ) -> list[list[RequestOutput]]:
        ps = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        fs = features or [None] * len(prompts)
        rids = [f"req-{secrets.token_hex(6)}" for _ in prompts]
        for rid, p, sp, f in zip(rids, prompts, ps, fs):
            self.submit(rid, p, SamplingParams(**vars(sp)), f)
        return [self.wait(r) for r in rids]

    def close(self) -> None:
        self.engine.shutdown()


def collect(outputs: list[RequestOutput]) -> tuple[list[int], str, RequestOutput]:
    """(all token ids, all text, final output) of one request's deltas."""
    ids = [t for o in outputs for t in o.token_ids]
    return ids, "".join(o.text for o in outputs), outputs[-1]
