"""The scheduler: the two event loops, over small managers with one job each.

`event_loop_normal` runs a batch and processes its result before forming the next.
`event_loop_overlap` launches batch N on the forward thread, then processes batch N-1's result and
forms N+1 while N computes; tokens not yet sampled stand in the next batch's inputs as future
placeholders. The two loops differ only in when a batch's result is processed.

    prefill.py    PrefillManager    admission order, whole prompts or chunks (and mixed decodes)
    decode.py     DecodeManager     one token for every running request
    admission.py  AdmissionPolicy   KV set aside per request, and whom a shortage should retract
    retraction.py Retraction        under memory pressure: evict cached prefixes, then retract victims
    cache.py      CacheManager      reservations and a request's rows, through the (null) prefix cache
    output.py     OutputManager     stop checks, deltas, a request's one finish
    in_flight.py  InFlight          launched batches whose results are not processed yet
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from features.registry import FeatureRegistry, support_of
from service.core.feature import OverlapSupport
from service.core.forward_batch import BatchResult
from service.core.omp import serial_cpu_ops_on_this_thread
from service.core.request import FinishReason, OutputSink, Req, RequestError
from service.engine.cache_manager import PrefixCacheManager
from service.engine.chunking import PrefillChunker, run_chunk_hooks
from service.engine.future_map import FutureMap, FutureMapFull
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.model_worker import ModelWorker
from service.engine.overlap_worker import OverlapWorker
from service.engine.schedule_batch import ScheduleBatch
from service.engine.scheduler.admission import AdmissionPolicy, RetractionConfig
from service.engine.scheduler.cache import CacheManager, NullPrefixCache
from service.engine.scheduler.decode import DecodeManager
from service.engine.scheduler.in_flight import InFlight, Outcome, run_after_launch
from service.engine.scheduler.output import OutputManager
from service.engine.scheduler.pacing import LaunchPacer
from service.engine.scheduler.prefill import PrefillLimits, PrefillManager
from service.engine.scheduler.retraction import Retraction
from service.engine.timeline import SCHEDULER_TID, Timeline

log = logging.getLogger("zerogap.scheduler")


class Scheduler:
    """Owns the requests and the loop. Runs on its own thread."""

    def __init__(
        self,
        worker: ModelWorker,
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        vocab_size: int,
        limits: PrefillLimits,
        timeline: Timeline,
        output_sink: OutputSink,
        overlap: bool,
        features: FeatureRegistry,
        future_map_size: int | None = None,
        chunker: PrefillChunker | None = None,
        prefix_cache: PrefixCacheManager | None = None,
        admission: AdmissionPolicy | None = None,
        pace_launches: bool = True,
    ):
        self.worker, self.device, self.timeline, self.overlap, self.features = (
            worker,
            worker.device,
            timeline,
            overlap,
            features,
        )
        self.overlap_worker = self._overlap_worker(future_map_size, limits.max_running) if overlap else None
        # The scheduler thread's device work (metadata copies, table writes, KV-index gathers) runs on
        # this stream; each batch's `ready` event marks its end.
        self.schedule_stream = self.device.new_stream()
        self.inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._inbox_requests = 0  # requests in the inbox's commands not taken yet (not the aborts, ...)
        self._inbox_lock = threading.Lock()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # edited in place: the managers share it
        self.reqs: dict[str, Req] = {}
        self._stop = False
        self.last_error: str | None = None
        self.broken: str | None = None  # a failure recovery could not undo: the engine is unhealthy
        self.sync_points = 0  # overlap loop: launches that had to wait for an older result
        self.chunker = chunker
        self.prefix_cache = prefix_cache or NullPrefixCache(req_pool, kv_pool)
        self.admission = admission or AdmissionPolicy(RetractionConfig(policy="reserve"))
        self.cache = CacheManager(self.prefix_cache, req_pool, kv_pool, features.max_cached_prefix)
        self.output = OutputManager(output_sink, features, self.cache, self.waiting, self.reqs)
        # CPU: the next batch is formed shortly before the running step ends (pacing.py).
        self.pacer = LaunchPacer() if overlap and pace_launches and not self.device.is_cuda else None
        self.in_flight = InFlight(self.overlap_worker, self.process_batch_result, self.pacer)
        self.retraction = Retraction(
            self.admission,
            self.running,
            self.waiting,
            self.cache,
            kv_pool,
            self.in_flight,
            self.output,
            features,
            timeline,
        )
        self.prefill = PrefillManager(
            limits,
            self.waiting,
            self.running,
            chunker,
            self.admission,
            self.retraction,
            self.cache,
            self.output,
            features,
            req_pool,
            kv_pool,
            vocab_size,
            self.device,
        )
        self.decode = DecodeManager(
            self.running, self.admission, self.retraction, req_pool, kv_pool, vocab_size, self.device
        )

    def _overlap_worker(self, size: int | None, max_running: int) -> OverlapWorker:
        size = size or 3 * max_running + 1
        if size < max_running:
            raise ValueError(
                f"future map size {size} < max_running_requests {max_running}: a batch could never launch"
            )
        return OverlapWorker(self.worker, FutureMap(size, self.worker.device))

    @property
    def reserved_tokens(self) -> int:
        return self.cache.reserved_tokens

    # ---- thread-safe entry points -------------------------------------------------
    def add_requests(self, reqs: list[Req]) -> None:
        """Several requests in one command: admitted in the same scheduler step."""
        with self._inbox_lock:
            self._inbox_requests += len(reqs)
            self.inbox.put(("add_all", reqs))

    @property
    def queued_requests(self) -> int:
        """Requests sent that have no slot yet: waiting, or still in the inbox (any thread)."""
        return len(self.waiting) + self._inbox_requests

    def abort_request(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def flush_prefix_cache(self) -> Future[int]:
        """Evict every unlocked cached prefix (all of them when nothing runs); the future gives the rows freed."""
        fut: Future[int] = Future()
        self.inbox.put(("flush", fut))
        return fut

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(("wake", None))

    # ---- the loops -----------------------------------------------------------------
    def run(self) -> None:
        if self.device.is_cuda:
            torch.cuda.set_device(self.device.device)
        elif self.overlap:  # the forward thread runs the model: it keeps the only OpenMP team
            serial_cpu_ops_on_this_thread()
        with self.device.use_stream(self.schedule_stream):
            loop = self.event_loop_overlap if self.overlap else self.event_loop_normal
            while not self._stop:
                try:
                    loop()
                except Exception as e:  # a scheduler bug: fail what is live, keep serving
                    log.exception("scheduler loop failed")
                    try:
                        self.recover(f"scheduler failure: {e!r}")
                    except Exception:
                        log.exception("recovery failed")
                        self.last_error = self.broken = f"recovery failed after: {e!r}"
        if self.overlap_worker is not None:
            self.overlap_worker.shutdown()

    def event_loop_normal(self) -> None:
        """Form a batch, run it, process its result; repeat."""
        batch = None
        while not self._stop:
            self.process_input_requests(self.recv_requests(block=batch is None))
            batch = self.get_next_batch_to_run()
            if batch:
                self.process_batch_result(batch, self.run_batch(batch))
            self.output.flush()

    def event_loop_overlap(self) -> None:
        """Launch batch N, then process batch N-1's result while N computes."""
        batch = None
        while not self._stop:
            idle = batch is None and not self.in_flight
            self.process_input_requests(self.recv_requests(block=idle, until=self.in_flight.form_next_at()))
            batch = self.get_next_batch_to_run()
            if batch and batch.support is not OverlapSupport.FULL:
                self.run_batch_fallback(batch)
            elif batch:
                self.launch_batch(batch)
            if self.in_flight and (batch is None or len(self.in_flight) > 1):
                self.in_flight.process_oldest()
            self.output.flush()

    def run_batch_fallback(self, batch: ScheduleBatch) -> None:
        """Per-batch fallback for a batch carrying a feature that cannot fully overlap: resolve the
        pending results first; a "sync point" batch then overlaps as usual, a "none" batch runs the
        normal way (launch, wait, process)."""
        start = time.perf_counter()
        self.in_flight.drain()
        names = ",".join(f.name for f, _ in batch.plan if f.support is not OverlapSupport.FULL)
        self.timeline.add(SCHEDULER_TID, f"sync point [{names}]", start, time.perf_counter())
        self.launch_batch(batch, fallback=names)
        if batch.support is OverlapSupport.NONE:
            self.in_flight.process_newest()

    # ---- loop steps ----------------------------------------------------------------
    def recv_requests(self, block: bool, until: float | None = None) -> list[tuple[str, object]]:
        """New commands; when nothing could be scheduled, wait briefly for one instead of spinning;
        with `until` (a perf_counter time), wait for one until then."""
        cmds = []
        if block:
            self.timeline.mark_idle()
        timeout = (0.05 if not self.waiting else 0.01) if block else (until or 0.0) - time.perf_counter()
        if timeout > 0:
            try:
                cmds.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self.inbox.get_nowait())
            except queue.Empty:
                return cmds

    def process_input_requests(self, cmds: list[tuple[str, object]]) -> None:
        for kind, arg in cmds:
            if kind == "add_all":
                assert isinstance(arg, list)
                try:
                    for req in arg:
                        self.reqs[req.rid] = req
                        self.waiting.append(req)
                        self.features.on_admit(req)
                finally:
                    with self._inbox_lock:  # in the waiting queue now, counted there
                        self._inbox_requests -= len(arg)
            elif kind == "abort":
                req = self.reqs.get(arg)  # type: ignore[arg-type]
                if req is not None:
                    self.output.finish(req, FinishReason.ABORT)
            elif kind == "flush":
                assert isinstance(arg, Future)
                arg.set_result(self.prefix_cache.flush())

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """A prefill batch when new requests can be admitted, else a decode batch."""
        start = time.perf_counter()
        self.running[:] = [r for r in self.running if not r.finished]
        batch = self.prefill.form() or self.decode.form()
        if batch is not None:
            batch.number, batch.fb.state_copies = self.prefix_cache.formed()
            self.prefix_cache.prompt_snapshots(batch)  # (copied by the next batch's forward)
            batch.plan = batch.fb.features = (
                self.features.plan(batch.reqs, batch.partial_rows) + batch.own_plan
            )
            batch.support = support_of(batch.plan)
            for feature, rows in batch.plan:
                feature.on_batch_formed(batch, rows)
            end = time.perf_counter()
            self.timeline.add(SCHEDULER_TID, f"form {batch.mode.value}", start, end, {"bs": len(batch.reqs)})
            if self.pacer is not None:
                self.pacer.observe_form(end - start)
        return batch

    def run_batch(self, batch: ScheduleBatch) -> Outcome:
        """Normal loop: forward on this thread (on the forward stream) and wait for the tokens."""
        self.features.count(batch.plan, "normal_loop")
        try:
            batch.fb.ready = self.device.record_event()
            run_after_launch(batch)
            result = self.worker.step(batch.fb)
            result.synchronize()
            return result
        except Exception as e:
            return e

    def launch_batch(self, batch: ScheduleBatch, fallback: str = "") -> None:
        """Overlap loop: hand the batch to the forward thread; inputs of later batches use the
        returned placeholders until the result is processed."""
        assert self.overlap_worker is not None
        label = f"forward [fallback: {fallback}]" if fallback else "forward"
        while True:
            try:
                handle = self.overlap_worker.launch(batch.fb, label)
                break
            except FutureMapFull:
                if not self.in_flight:
                    raise
                self.sync_points += 1  # sync point: finishing an older batch frees its future slots
                self.in_flight.process_oldest()
        self.in_flight.add(batch, handle)
        batch.placeholders = handle.placeholders
        for req, placeholder in zip(batch.reqs, handle.placeholders):
            req.next_input = placeholder
        self.features.count(batch.plan, "fallback" if fallback else "overlapped")
        self.in_flight.start_hooks(batch)

    def process_batch_result(self, batch: ScheduleBatch, result: Outcome) -> None:
        start = time.perf_counter()
        if self.overlap:
            self.features.count_waits(batch, batch.plan)  # a "full" feature that waited anyway
        if batch.hook_error is not None and not isinstance(result, BaseException):
            result = batch.hook_error
        failed = isinstance(result, BaseException)
        for req in self.prefix_cache.batch_done(batch.number, not failed, self.reqs.values()):
            self.output.finish(
                req, FinishReason.ERROR, error=f"a cached state it started from was spoiled: {result!r}"
            )
        if isinstance(result, BaseException):
            log.error("forward failed for a batch of %d: %r", len(batch.reqs), result)
            for req in batch.reqs:
                self.output.finish(req, FinishReason.ERROR, error=f"forward failed: {result!r}")
            self.prefix_cache.prune()  # (once its requests let go of their paths)
            return
        feature_rows = {f.name: set(rows) for f, rows in batch.plan}
        for i, (req, token) in enumerate(zip(batch.reqs, result.tokens)):
            if not req.finished:  # else finished or aborted while this batch was in flight
                self.process_row(batch, i, req, token, result, feature_rows)
        self.cache.prefilled(batch)
        self.timeline.add(
            SCHEDULER_TID, f"process {batch.mode.value}", start, time.perf_counter(), {"bs": len(batch.reqs)}
        )

    def process_row(
        self,
        batch: ScheduleBatch,
        i: int,
        req: Req,
        token: int,
        result: BatchResult,
        feature_rows: dict[str, set[int]],
    ) -> None:
        """One request's token: its features' fields, then stop checks and the delta; a fault is its own."""
        if i in batch.partial_rows:  # chunked prefill: a non-final chunk's token is not the request's
            try:
                run_chunk_hooks(batch, i, req, result.extras)
            except Exception as e:
                log.exception("request %s failed", req.rid)
                self.output.finish(req, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
            return
        if batch.placeholders is None or req.next_input == batch.placeholders[i]:
            req.next_input = token
        try:
            self.output.accept(req, token)
            extras = {}
            for feature, _ in batch.plan:
                if i in feature_rows[feature.name]:
                    fields = feature.on_result(batch, i, req, result.extras.get(feature.name))
                    if fields:
                        extras[feature.name] = fields
            self.output.check_finished_and_emit(req, token, extras)
        except RequestError as e:  # the request's own fault, found while serving it
            self.output.finish(req, FinishReason.ERROR, error=e.message, error_code=e.code)
        except Exception as e:
            log.exception("request %s failed", req.rid)
            self.output.finish(req, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")

    # ---- recovery ------------------------------------------------------------------
    def recover(self, error: str) -> None:
        """After a loop failure: drain the forward thread, fail every live request."""
        self.in_flight.abandon()
        self.last_error = error
        for req in list(self.reqs.values()):
            self.output.finish(req, FinishReason.ERROR, error=error)
        self.running.clear()
        self.waiting.clear()
        self.prefix_cache.after_failure()
        self.output.flush()
