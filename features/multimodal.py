"""Multimodal (image) input for LLaVA and Qwen2-VL / Qwen2.5-VL models — overlapped.

A request carries images as raw bytes (PNG / JPEG / WebP): in chat content parts, or beside
`text` / `token_ids` with one image placeholder (the model's image token) per image. Each
placeholder is expanded into the image's run of image tokens (`expand_prompt`, caller thread):
a fixed `tokens_per_image` for LLaVA; for Qwen-VL as many as the image's size needs (its patch
grid within the processor's min/max pixels, read from the header). A content hash (sha256 of
the bytes) is kept beside each run (`ImageRequest.image_hashes` / `spans`): two different
images never look alike to any cache keyed by it, and the same bytes always do.

Decoding, checks and preprocessing (features/images.py) run on a thread pool, the vision tower
and projector on an encoder thread (service/models/llava.py) — never on the scheduler thread.
A request waits for its image embeddings without holding others up (`admission_ready`); the
gRPC handler awaits only the decode + checks (`pending`), so a bad image is refused with
INVALID_ARGUMENT naming its index before the request is queued. Encoder outputs are kept in a
bounded LRU cache keyed by the hash, and concurrent requests with the same image share one
encode: a repeated image costs nothing.

Qwen-VL's M-RoPE positions are computed at validation from the grids (`ImageRequest.rope`) and
carried with the request; `on_batch_formed` hands each batch the (packed row, offset) pairs of
its image requests' tokens, prompt chunks and decodes alike (a decode sits at its index + the
request's delta), and `rope_positions` adds them on the forward thread.

The vision thread encodes every image that is ready when it gets to work in one call (a step's
images together), each image's output cached under its own hash.

On the forward thread, `modify_embeddings` writes each image's embeddings over its placeholder
rows. Which rows is worked out per extend row from its positions (`extend_prefix_lens_cpu`,
`extend_lens`), so an extend that covers only part of an image span (a chunk of a chunked
prefill, a cached prefix ending inside it) gets exactly that part.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from features.images import (
    DynamicPreprocessor,
    ImageError,
    ImageLimits,
    Patches,
    Preprocessor,
    check_size,
    decode,
    upright_size,
)
from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch, ForwardMode
from service.core.omp import on_passing_thread
from service.core.request import Req, RequestError
from service.models.qwen_vl import mrope_positions

if TYPE_CHECKING:
    from service.core.device import Device

log = logging.getLogger("zerogap.multimodal")


@dataclass(frozen=True)
class ImageInputs:
    """A request's images as sent (from_proto)."""

    images: tuple[bytes, ...]


@dataclass(frozen=True)
class MropePositions:
    """A Qwen-VL request's M-RoPE positions as offsets from each token's index: `offsets` [3, prompt
    length] (int64, host) for the prompt, `delta` for every token after it (decodes, kept output)."""

    offsets: torch.Tensor
    delta: int

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Offsets [3, hi - lo] of tokens lo..hi."""
        n = self.offsets.shape[1]
        inside = self.offsets[:, lo : min(hi, n)]
        if hi <= n:
            return inside
        return torch.cat([inside, torch.full((3, hi - max(lo, n)), self.delta, dtype=torch.int64)], 1)


@dataclass(frozen=True)
class ImageRequest:
    """A validated request's images: where each sits in the prompt, its hash, and its embeddings.

    `spans[i]` = (first prompt position, length) of image i's image-token run; `image_hashes[i]`
    its content hash (hex sha256 of the bytes). A prefix cache must key a span's tokens by the
    hash, never by the (identical) placeholder ids alone."""

    image_hashes: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    encoded: tuple[Future, ...]  # per image: its embeddings [tokens, hidden] (model dtype, device)
    prepared: Future  # all images decoded and checked (the first error names its image)
    rope: MropePositions | None = None  # Qwen-VL: M-RoPE positions (None: plain RoPE)


def image_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_cache_key(prompt_ids: list[int], images: "ImageRequest") -> list[int]:
    """The prompt with each image's span replaced by a negative id drawn from its hash (no token id is
    negative): equal images at equal places match in a prefix cache, different images never do."""
    key = list(prompt_ids)
    for (start, n), digest in zip(images.spans, images.image_hashes):
        key[start : start + n] = [-1 - int(digest[:15], 16)] * n
    return key


def image_spans(prompt_ids: list[int], image_token: int, counts: list[int]) -> list[tuple[int, int]] | None:
    """(start, length) of each image's run in an expanded prompt, image i taking counts[i] tokens
    (adjacent runs are split in order); None when the runs do not add up to the counts."""
    spans = []
    i, n, k = 0, len(prompt_ids), 0
    while i < n:
        if prompt_ids[i] != image_token:
            i += 1
            continue
        j = i
        while j < n and prompt_ids[j] == image_token:
            j += 1
        while i < j and k < len(counts):
            spans.append((i, counts[k]))
            i += counts[k]
            k += 1
        if i != j:
            return None
    return spans if k == len(counts) else None


def expand_image_tokens(prompt_ids: list[int], counts: list[int], image_token: int) -> list[int]:
    """One placeholder per image -> image i's run of counts[i] tokens. A prompt that holds the runs
    already (e.g. Tokenize's output) is kept as it is; anything else is refused."""
    at = [i for i, t in enumerate(prompt_ids) if t == image_token]
    if len(at) == len(counts):
        out: list[int] = []
        last = 0
        for i, n in zip(at, counts):
            out.extend(prompt_ids[last:i])
            out.extend([image_token] * n)
            last = i + 1
        out.extend(prompt_ids[last:])
        return out
    if counts and image_spans(prompt_ids, image_token, counts) is not None:
        return list(prompt_ids)
    n_images = len(counts)
    runs = " (or each image's run of image tokens)" if any(n > 1 for n in counts) else ""
    raise RequestError(
        "INVALID_ARGUMENT",
        f"input: {len(at)} image placeholder token(s) for {n_images} image(s): "
        f"the prompt needs one placeholder per image{runs}, in order",
    )


class EncoderCache:
    """Image embeddings by content hash: LRU, bounded in bytes (thread-safe)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            t = self._items.get(key)
            if t is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return t

    def peek(self, key: str) -> torch.Tensor | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        with self._lock:
            if key in self._items or size > self.max_bytes:
                return
            self._items[key] = t
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._items)


def _done(value: Any = None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _image_failure(i: int, e: BaseException) -> RequestError:
    if isinstance(e, RequestError):
        return e
    if isinstance(e, ImageError):
        return RequestError("INVALID_ARGUMENT", f"images[{i}]: {e}")
    return RequestError("INTERNAL", f"images[{i}]: encoding failed: {type(e).__name__}: {e}")


def _all_of(futures: list[Future]) -> Future:
    """Done when every future is; fails with the first (by index) failure, named by its image."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        failed = next(
            ((i, f) for i, f in enumerate(futures) if f.cancelled() or f.exception() is not None), None
        )
        try:
            if failed is not None:
                out.set_exception(
                    _image_failure(failed[0], failed[1].exception() or RuntimeError("cancelled"))
                )
            else:
                out.set_result(None)
        except InvalidStateError:  # cancelled: nobody waits any more (e.g. the RPC was cancelled)
            pass

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(one_done)
    return out


@dataclass(frozen=True)
class ImageSplice:
    """One run of image rows in a batch: the packed row it starts at, the image's embeddings
    [tokens, hidden], the first of them it takes and how many."""

    dst: int
    embeddings: torch.Tensor
    src: int
    n: int


@dataclass
class ImageSplices:
    """A batch's image embeddings to splice (`fb.feature_data[ImageSplices]`), built on the scheduler
    thread; the batch keeps the embeddings referenced until its result is processed. On Qwen-VL also
    the packed rows whose M-RoPE positions move, with their offsets [3, rows] (device)."""

    splices: list[ImageSplice]
    rope_rows: torch.Tensor | None = None
    rope_offsets: torch.Tensor | None = None


class MultimodalFeature(Feature):
    name = "multimodal"
    support = OverlapSupport.FULL
    reads_raw_logits = False
    reads_prompt_chunks = True  # every prompt chunk that covers an image span needs its embeddings spliced
    reason = (
        "images are decoded and encoded on worker threads before admission; the forward thread only "
        "copies the ready embeddings over the image tokens"
    )

    def __init__(self) -> None:
        self.encoder: Any = None  # the model's vision side (service/models/llava.py or qwen_vl.py)
        self.family: str | None = None  # "llava" or "qwen_vl" once bound to such a model
        self.image_token = -1
        self.tokens_per_image = 0  # LLaVA: every image's run (Qwen-VL: by its size)
        self.merge = 1  # Qwen-VL: patches merged merge x merge into one token
        self.limits = ImageLimits()
        self.cache = EncoderCache(256 << 20)
        self._preprocess: Preprocessor | DynamicPreprocessor | None = None
        self._prep_pool: ThreadPoolExecutor | None = None
        self._encode_pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future, Future]] = {}  # hash -> (prepared, encoded) of a running job
        self._queue: list[tuple[str, Any, Future]] = []  # prepared images waiting for the vision thread
        self._lock = threading.Lock()
        self._device: Device | None = None
        self._stream: Any = None  # the encoder's device stream
        self._dtype = torch.float32
        self.encoder_runs = 0  # images run through the vision tower
        self.encoder_calls = 0  # calls of the vision tower (several images each when they are ready together)
        self.worker_s: deque[float] = deque(
            maxlen=100_000
        )  # decode+preprocess and encode times (worker threads)
        self.scheduler_s = 0.0  # time the scheduler thread spent in this feature's hooks

    # ---- declaration -----------------------------------------------------------------
    def unavailable_reason(self, model: FeatureContext | None) -> str | None:
        from service.models.vision import family

        hf_config = model.hf_config if model is not None else None
        if family(hf_config) is not None:
            return None
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        what = (
            f"{arch}'s vision tower is not served here (its language model is, for text)"
            if getattr(hf_config, "vision_config", None) is not None
            else f"{arch} is a text-only model (no vision tower)"
        )
        return f"{what}; image input needs a LLaVA or Qwen2-VL family model"

    def bind(self, ctx: FeatureContext) -> None:
        from service.models.vision import family, load_vision_encoder

        a = ctx.args
        self.limits = ImageLimits.from_args(a)
        self.cache = EncoderCache(a.image_encoder_cache_mb << 20)
        self.family = family(ctx.hf_config)
        if self.family is None:
            return
        cfg = ctx.hf_config
        self._dtype = ctx.dtype
        self._device = ctx.device
        self.encoder = load_vision_encoder(ctx.model_dir, cfg, ctx.dtype, ctx.device.device)
        self.image_token = int(cfg.image_token_id)
        ctx.tokenizer.image_token = ctx.tokenizer.hf.convert_ids_to_tokens(self.image_token)
        if self.family == "llava":
            self.tokens_per_image = self.encoder.tokens_per_image
            self._preprocess = Preprocessor(ctx.model_dir, self.encoder.image_size)
        else:
            self.merge = self.encoder.merge
            self._preprocess = DynamicPreprocessor(ctx.model_dir, self.encoder.patch_size, self.merge)
        self._prep_pool = ThreadPoolExecutor(
            max_workers=max(1, a.image_workers), thread_name_prefix="zerogap-image"
        )
        self._encode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerogap-vision")
        self._stream = ctx.device.new_stream()

    def shutdown(self) -> None:
        for pool in (self._prep_pool, self._encode_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # ---- caller thread -------------------------------------------------------------------
    def from_proto(self, request: Any) -> ImageInputs | None:
        images = list(request.images)
        if request.WhichOneof("input") == "chat":
            parts = [
                p.image for m in request.chat.messages for p in m.parts if p.WhichOneof("part") == "image"
            ]
            if parts and images:
                raise RequestError(
                    "INVALID_ARGUMENT", "images: chat input carries its images in chat.messages[].parts"
                )
            images = images or parts
        if not images:
            return None
        if len(images) > self.limits.max_images:
            raise RequestError(
                "INVALID_ARGUMENT",
                f"images: {len(images)} images exceed the limit of "
                f"{self.limits.max_images} (--max-images-per-request)",
            )
        return ImageInputs(tuple(images))

    def _grids(self, images: tuple[bytes, ...]) -> list[tuple[int, int, int]]:
        """Qwen-VL: each image's patch grid, from its header (refused here when the header is bad)."""
        assert isinstance(self._preprocess, DynamicPreprocessor)
        grids = []
        for i, data in enumerate(images):
            try:
                grids.append(self._preprocess.grid(*upright_size(data, self.limits)))
            except ImageError as e:
                raise _image_failure(i, e) from None
        return grids

    def _counts(self, images: tuple[bytes, ...]) -> tuple[list[int], list[tuple[int, int, int]] | None]:
        """Each image's run of image tokens (and its grid on Qwen-VL)."""
        if self.family != "qwen_vl":
            return [self.tokens_per_image] * len(images), None
        grids = self._grids(images)
        return [t * h * w // (self.merge * self.merge) for t, h, w in grids], grids

    def expand_prompt(self, payload: ImageInputs | None, prompt_ids: list[int]) -> list[int]:
        if self.encoder is None:
            return prompt_ids
        images = payload.images if payload is not None else ()
        if not images and self.image_token not in prompt_ids:
            return prompt_ids
        counts, _ = self._counts(images)
        return expand_image_tokens(prompt_ids, counts, self.image_token)

    def validate(self, payload: ImageInputs, ctx: FeatureContext, prompt_ids: list[int]) -> ImageRequest:
        for i, data in enumerate(payload.images):
            try:
                check_size(data, self.limits)
            except ImageError as e:
                raise _image_failure(i, e) from None
        counts, grids = self._counts(payload.images)
        spans = image_spans(prompt_ids, self.image_token, counts)
        if spans is None:  # expand_prompt ran first: a bug if this happens
            raise RequestError(
                "INVALID_ARGUMENT", f"input: the image spans do not fit {len(payload.images)} images"
            )
        rope = None
        if grids is not None:
            pos, delta = mrope_positions(len(prompt_ids), spans, grids, self.merge)
            rope = MropePositions(pos - torch.arange(len(prompt_ids)), delta)
        hashes = tuple(image_hash(d) for d in payload.images)
        jobs = [self._start(h, d) for h, d in zip(hashes, payload.images)]
        return ImageRequest(
            hashes, tuple(spans), tuple(enc for _, enc in jobs), _all_of([prep for prep, _ in jobs]), rope
        )

    def pending(self, payload: ImageRequest) -> Future:
        return payload.prepared

    # ---- worker threads ------------------------------------------------------------------
    def _start(self, key: str, data: bytes) -> tuple[Future, Future]:
        """(prepared, encoded) futures of one image: from the cache, a running job, or a new one."""
        cached = self.cache.get(key)
        if cached is not None:
            return _done(), _done(cached)
        with self._lock:
            job = self._inflight.get(key)
            if job is not None:
                return job
            if (cached := self.cache.peek(key)) is not None:  # finished since the lookup above
                return _done(), _done(cached)
            assert self._prep_pool is not None
            encoded: Future = Future()
            prepared = self._prep_pool.submit(self._prepare, data)
            self._inflight[key] = job = (prepared, encoded)
        prepared.add_done_callback(lambda f: self._after_prepare(key, f, encoded))
        return job

    def _prepare(self, data: bytes) -> torch.Tensor | Patches:
        t0 = time.perf_counter()
        try:
            assert self._preprocess is not None
            return self._preprocess(decode(data, self.limits))
        finally:
            self.worker_s.append(time.perf_counter() - t0)

    def _after_prepare(self, key: str, prepared: Future, encoded: Future) -> None:
        err = RuntimeError("cancelled") if prepared.cancelled() else prepared.exception()
        if err is None:
            try:
                assert self._encode_pool is not None
                with self._lock:
                    self._queue.append((key, prepared.result(), encoded))
                self._encode_pool.submit(self._encode_ready)
                return
            except RuntimeError as e:  # shutting down
                err = e
        with self._lock:
            self._inflight.pop(key, None)
        encoded.set_exception(err)

    def _run_encoder(self, items: list[Any]) -> list[torch.Tensor]:
        """One vision-tower call for several prepared images -> each one's embeddings."""
        assert self._device is not None
        dev, dtype = self._device.device, self._dtype
        if self.family == "qwen_vl":
            patches = torch.cat([p.pixels for p in items]).to(device=dev, dtype=dtype)
            return self.encoder(patches, [p.grid for p in items])
        return list(self.encoder(torch.stack(items).to(device=dev, dtype=dtype)))

    def _encode_inference(self, items: list[Any]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return self._run_encoder(items)

    def _encode_ready(self) -> None:
        """Vision thread: every image prepared by now, in one call (none: an earlier call took them)."""
        with self._lock:
            batch, self._queue = self._queue, []
        if not batch:
            return
        t0 = time.perf_counter()
        try:
            dev = self._device
            assert dev is not None
            items = [item for _, item, _ in batch]
            if dev.is_cuda:
                with dev.use_stream(self._stream), torch.inference_mode():
                    outs = self._run_encoder(items)
            else:  # a thread that exits: its OpenMP team goes with it (service/core/omp.py)
                outs = on_passing_thread(lambda: self._encode_inference(items), "zerogap-vision-call")
            dev.record_event(self._stream).synchronize()  # ready before any forward reads it (any stream)
            self.encoder_runs += len(batch)
            self.encoder_calls += 1
            for (key, _, _), out in zip(batch, outs):
                self.cache.put(key, out)
        except BaseException as e:  # noqa: BLE001 (handed to the requests)
            log.exception("vision encoder failed")
            with self._lock:
                for key, _, _ in batch:
                    self._inflight.pop(key, None)
            for _, _, encoded in batch:
                encoded.set_exception(e)
            return
        finally:
            self.worker_s.append(time.perf_counter() - t0)
        with self._lock:
            for key, _, _ in batch:
                self._inflight.pop(key, None)
        for (_, _, encoded), out in zip(batch, outs):
            encoded.set_result(out)

    # ---- scheduler thread ------------------------------------------------------------------
    def on_admit(self, req: Req) -> None:
        """A prefix cache matches image spans by their image's hash, never by the placeholder ids."""
        req.prompt_key = image_cache_key(req.prompt_ids, req.features[self.name])

    def admission_ready(self, req: Req) -> bool:
        t0 = time.perf_counter()
        try:
            payload: ImageRequest = req.features[self.name]
            if not all(f.done() for f in payload.encoded):
                return False
            for i, f in enumerate(payload.encoded):
                if f.cancelled() or f.exception() is not None:
                    raise _image_failure(i, f.exception() or RuntimeError("cancelled"))
            req.feature_state[self.name] = [f.result() for f in payload.encoded]
            return True
        finally:
            self.scheduler_s += time.perf_counter() - t0

    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        """Which packed rows of this extend get which image rows, from each row's positions; and on
        Qwen-VL the M-RoPE offsets of every token of an image request (prompt chunks and decodes)."""
        fb = batch.fb
        extend = (
            fb.mode is ForwardMode.EXTEND
            and fb.extend_prefix_lens_cpu is not None
            and fb.extend_start_loc_cpu is not None
            and fb.extend_lens is not None
        )
        if not extend and self.family != "qwen_vl":
            return
        t0 = time.perf_counter()
        splices = []
        rope_rows: list[torch.Tensor] = []
        rope_offsets: list[torch.Tensor] = []
        for i in rows:
            req = batch.reqs[i]
            payload: ImageRequest = req.features[self.name]
            if not extend:  # a decode row: one token at its index + delta
                if payload.rope is not None and payload.rope.delta:
                    rope_rows.append(torch.tensor([i]))
                    rope_offsets.append(torch.full((3, 1), payload.rope.delta, dtype=torch.int64))
                continue
            lo, start = fb.extend_prefix_lens_cpu[i], fb.extend_start_loc_cpu[i]
            hi = lo + fb.extend_lens[i]
            if payload.rope is not None:
                rope_rows.append(torch.arange(start, start + hi - lo))
                rope_offsets.append(payload.rope.rows(lo, hi))
            embeds: list[torch.Tensor] | None = req.feature_state.get(self.name)
            if embeds is None:
                continue
            for (s, n), emb in zip(payload.spans, embeds):
                a, b = max(s, lo), min(s + n, hi)
                if a < b:
                    splices.append(ImageSplice(start + a - lo, emb, a - s, b - a))
        rows_t = offsets_t = None
        if rope_rows:  # to the device here, in the scheduler stream's order (before the batch's `ready`)
            assert self._device is not None
            rows_t, offsets_t = self._device.to_device(torch.cat(rope_rows), torch.cat(rope_offsets, 1))
        if splices or rows_t is not None:
            fb.feature_data.put(ImageSplices(splices, rows_t, offsets_t))
        self.scheduler_s += time.perf_counter() - t0

    def on_finish(self, req: Req) -> None:
        req.feature_state.pop(self.name, None)
        return None

    # ---- forward thread ------------------------------------------------------------------
    def changes_embeddings(self, fb: ForwardBatch) -> bool:
        """Only batches with image rows to splice (prefill chunks): its decode batches can replay a graph."""
        return fb.feature_data.get(ImageSplices) is not None

    def modify_embeddings(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        data = fb.feature_data.get(ImageSplices)
        for sp in data.splices if data is not None else ():
            hidden[sp.dst : sp.dst + sp.n] = sp.embeddings[sp.src : sp.src + sp.n]
        return hidden

    def rope_positions(self, fb: ForwardBatch, positions: torch.Tensor) -> torch.Tensor:
        data = fb.feature_data.get(ImageSplices)
        if data is None or data.rope_rows is None or data.rope_offsets is None:
            return positions
        positions = positions.clone()
        positions[:, data.rope_rows] += data.rope_offsets
        return positions

    def stats(self) -> dict[str, float]:
        return {
            "encoder_runs": self.encoder_runs,
            "encoder_calls": self.encoder_calls,
            "cache_hits": self.cache.hits,
            "cache_entries": len(self.cache),
            "scheduler_s": self.scheduler_s,
            "worker_s": sum(self.worker_s),
        }
