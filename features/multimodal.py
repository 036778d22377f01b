"""Multimodal (image) input for LLaVA-family models — overlapped.

A request carries images as raw bytes (PNG / JPEG / WebP): in chat content parts, or beside
`text` / `token_ids` with one image placeholder (the model's image token) per image. Each
placeholder is expanded into the image's run of `tokens_per_image` image tokens
(`expand_prompt`, caller thread), and a content hash (sha256 of the bytes) is kept beside each
run (`ImageRequest.image_hashes` / `spans`): two different images never look alike to any cache
keyed by it, and the same bytes always do.

Decoding, checks and preprocessing (features/images.py) run on a thread pool, the vision tower
and projector on an encoder thread (service/models/llava.py) — never on the scheduler thread.
A request waits for its image embeddings without holding others up (`admission_ready`); the
gRPC handler awaits only the decode + checks (`pending`), so a bad image is refused with
INVALID_ARGUMENT naming its index before the request is queued. Encoder outputs are kept in a
bounded LRU cache keyed by the hash, and concurrent requests with the same image share one
encode: a repeated image costs nothing.

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

from features.images import ImageError, ImageLimits, Preprocessor, check_size, decode
from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch, ForwardMode
from service.core.request import Req, RequestError

if TYPE_CHECKING:
    from service.core.device import Device
    from service.models.llava import VisionEncoder

log = logging.getLogger("zerogap.multimodal")


@dataclass(frozen=True)
class ImageInputs:
    """A request's images as sent (from_proto)."""

    images: tuple[bytes, ...]


@dataclass(frozen=True)
class ImageRequest:
    """A validated request's images: where each sits in the prompt, its hash, and its embeddings.

    `spans[i]` = (first prompt position, length) of image i's image-token run; `image_hashes[i]`
    its content hash (hex sha256 of the bytes). A prefix cache must key a span's tokens by the
    hash, never by the (identical) placeholder ids alone."""

    image_hashes: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    encoded: tuple[Future, ...]  # per image: its embeddings [tokens_per_image, hidden] (model dtype, device)
    prepared: Future  # all images decoded and checked (the first error names its image)


def image_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_cache_key(prompt_ids: list[int], images: "ImageRequest") -> list[int]:
    """The prompt with each image's span replaced by a negative id drawn from its hash (no token id is
    negative): equal images at equal places match in a prefix cache, different images never do."""
    key = list(prompt_ids)
    for (start, n), digest in zip(images.spans, images.image_hashes):
        key[start : start + n] = [-1 - int(digest[:15], 16)] * n
    return key


def image_spans(prompt_ids: list[int], image_token: int, per_image: int) -> list[tuple[int, int]]:
    """(start, length) of each image's run in an expanded prompt (adjacent runs are split every per_image)."""
    spans = []
    i, n = 0, len(prompt_ids)
    while i < n:
        if prompt_ids[i] != image_token:
            i += 1
            continue
        j = i
        while j < n and prompt_ids[j] == image_token:
            j += 1
        spans.extend((s, per_image) for s in range(i, j, per_image))
        i = j
    return spans


def expand_image_tokens(prompt_ids: list[int], n_images: int, image_token: int, per_image: int) -> list[int]:
    """One placeholder per image -> each image's run of `per_image` tokens. A prompt that holds
    the runs already (e.g. Tokenize's output) is kept as it is; anything else is refused."""
    at = [i for i, t in enumerate(prompt_ids) if t == image_token]
    if len(at) == n_images:
        out: list[int] = []
        last = 0
        for i in at:
            out.extend(prompt_ids[last:i])
            out.extend([image_token] * per_image)
            last = i + 1
        out.extend(prompt_ids[last:])
        return out
    spans = image_spans(prompt_ids, image_token, per_image)
    if (
        n_images
        and len(at) == n_images * per_image
        and all(all(prompt_ids[s + k] == image_token for k in range(n)) for s, n in spans)
    ):
        return list(prompt_ids)
    runs = f" (or each image's run of {per_image})" if per_image > 1 else ""
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
    [tokens_per_image, hidden], the first of them it takes and how many."""

    dst: int
    embeddings: torch.Tensor
    src: int
    n: int


@dataclass
class ImageSplices:
    """A batch's image embeddings to splice (`fb.feature_data[ImageSplices]`), built on the scheduler
    thread; the batch keeps the embeddings referenced until its result is processed."""

    splices: list[ImageSplice]


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
        self.encoder: VisionEncoder | None = None  # on a LLaVA model
        self.image_token = -1
        self.tokens_per_image = 0
        self.limits = ImageLimits()
        self.cache = EncoderCache(256 << 20)
        self._preprocess: Preprocessor | None = None
        self._prep_pool: ThreadPoolExecutor | None = None
        self._encode_pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future, Future]] = {}  # hash -> (prepared, encoded) of a running job
        self._lock = threading.Lock()
        self._device: Device | None = None
        self._stream: Any = None  # the encoder's device stream
        self._dtype = torch.float32
        self.encoder_runs = 0  # images run through the vision tower
        self.worker_s: deque[float] = deque(
            maxlen=100_000
        )  # decode+preprocess and encode times (worker threads)
        self.scheduler_s = 0.0  # time the scheduler thread spent in this feature's hooks

    # ---- declaration -----------------------------------------------------------------
    def unavailable_reason(self, model: FeatureContext | None) -> str | None:
        from service.models.llava import is_llava

        hf_config = model.hf_config if model is not None else None
        if is_llava(hf_config):
            return None
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        return f"{arch} is a text-only model (no vision tower); image input needs a LLaVA-family model"

    def bind(self, ctx: FeatureContext) -> None:
        from service.models.llava import is_llava, load_vision_encoder

        a = ctx.args
        self.limits = ImageLimits.from_args(a)
        self.cache = EncoderCache(a.image_encoder_cache_mb << 20)
        if not is_llava(ctx.hf_config):
            return
        cfg = ctx.hf_config
        self._dtype = ctx.dtype
        self._device = ctx.device
        self.encoder = load_vision_encoder(ctx.model_dir, cfg, ctx.dtype, ctx.device.device)
        self.image_token = int(cfg.image_token_id)
        self.tokens_per_image = self.encoder.tokens_per_image
        ctx.tokenizer.image_token = ctx.tokenizer.hf.convert_ids_to_tokens(self.image_token)
        self._preprocess = Preprocessor(ctx.model_dir, self.encoder.image_size)
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

    def expand_prompt(self, payload: ImageInputs | None, prompt_ids: list[int]) -> list[int]:
        if self.encoder is None:
            return prompt_ids
        n = len(payload.images) if payload is not None else 0
        if n == 0 and self.image_token not in prompt_ids:
            return prompt_ids
        return expand_image_tokens(prompt_ids, n, self.image_token, self.tokens_per_image)

    def validate(self, payload: ImageInputs, ctx: FeatureContext, prompt_ids: list[int]) -> ImageRequest:
        for i, data in enumerate(payload.images):
            try:
                check_size(data, self.limits)
            except ImageError as e:
                raise _image_failure(i, e) from None
        spans = image_spans(prompt_ids, self.image_token, self.tokens_per_image)
        if len(spans) != len(payload.images):  # expand_prompt ran first: a bug if this differs
            raise RequestError(
                "INVALID_ARGUMENT", f"input: {len(spans)} image spans for {len(payload.images)} images"
            )
        hashes = tuple(image_hash(d) for d in payload.images)
        jobs = [self._start(h, d) for h, d in zip(hashes, payload.images)]
        return ImageRequest(
            hashes, tuple(spans), tuple(enc for _, enc in jobs), _all_of([prep for prep, _ in jobs])
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

    def _prepare(self, data: bytes) -> torch.Tensor:
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
                self._encode_pool.submit(self._encode, key, prepared.result(), encoded)
                return
            except RuntimeError as e:  # shutting down
                err = e
        with self._lock:
            self._inflight.pop(key, None)
        encoded.set_exception(err)

    def _encode(self, key: str, pixels: torch.Tensor, encoded: Future) -> None:
        t0 = time.perf_counter()
        try:
            dev, encoder = self._device, self.encoder
            assert dev is not None and encoder is not None
            with dev.use_stream(self._stream), torch.inference_mode():
                out = encoder(pixels.unsqueeze(0).to(device=dev.device, dtype=self._dtype))[0]
            dev.record_event(self._stream).synchronize()  # ready before any forward reads it (any stream)
            self.encoder_runs += 1
            self.cache.put(key, out)
        except BaseException as e:  # noqa: BLE001 (handed to the request)
            log.exception("vision encoder failed")
            with self._lock:
                self._inflight.pop(key, None)
            encoded.set_exception(e)
            return
        finally:
            self.worker_s.append(time.perf_counter() - t0)
        with self._lock:
            self._inflight.pop(key, None)
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
        """Which packed rows of this extend get which image rows: from each row's positions."""
        fb = batch.fb
        if (
            fb.mode is not ForwardMode.EXTEND
            or fb.extend_prefix_lens_cpu is None
            or fb.extend_start_loc_cpu is None
            or fb.extend_lens is None
        ):
            return
        t0 = time.perf_counter()
        splices = []
        for i in rows:
            req = batch.reqs[i]
            embeds: list[torch.Tensor] | None = req.feature_state.get(self.name)
            if embeds is None:
                continue
            lo, start = fb.extend_prefix_lens_cpu[i], fb.extend_start_loc_cpu[i]
            hi = lo + fb.extend_lens[i]
            payload: ImageRequest = req.features[self.name]
            for (s, n), emb in zip(payload.spans, embeds):
                a, b = max(s, lo), min(s + n, hi)
                if a < b:
                    splices.append(ImageSplice(start + a - lo, emb, a - s, b - a))
        if splices:
            fb.feature_data.put(ImageSplices(splices))
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

    def stats(self) -> dict[str, float]:
        return {
            "encoder_runs": self.encoder_runs,
            "cache_hits": self.cache.hits,
            "cache_entries": len(self.cache),
            "scheduler_s": self.scheduler_s,
            "worker_s": sum(self.worker_s),
        }
