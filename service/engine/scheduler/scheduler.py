"""The scheduler: admission, batch formation, and the two event loops.

`event_loop_normal` runs a batch and processes its result before forming the
next. `event_loop_overlap` launches batch N on the forward thread, then
processes batch N-1's result and forms N+1 while N computes; tokens not yet
sampled stand in the next batch's inputs as future placeholders. The two loops
differ only in when a batch's result is processed.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from concurrent.futures import Future

import torch

from service.core.feature import OverlapSupport
from features.registry import FeatureRegistry, support_of
from features.retraction import AdmissionPolicy, RetractionConfig, Retracted
from service.engine.cache_manager import PrefixCacheManager
from service.engine.chunking import PrefillChunker, run_chunk_hooks
from service.engine.cpu_threads import serial_cpu_ops_on_this_thread
from service.core.forward_batch import BatchResult, ForwardMode
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.model_worker import ModelWorker
from service.engine.future_map import FutureMap, FutureMapFull
from service.engine.overlap_worker import LaunchedBatch, OverlapWorker
from service.core.request import FinishReason, OutputSink, Req, RequestError, RequestOutput
from service.engine.schedule_batch import ExtendRow, ScheduleBatch, build_decode_batch, build_extend_batch
from service.engine.timeline import SCHEDULER_TID, Timeline

log = logging.getLogger("zerogap.scheduler")


class Scheduler:
    """Owns the requests, the KV tables and the loop. Runs on its own thread."""

    def __init__(
        self,
        worker: ModelWorker,
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        vocab_size: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        timeline: Timeline,
        output_sink: OutputSink,
        overlap: bool,
        features: FeatureRegistry,
        future_map_size: int | None = None,
        max_skip_ahead: int = 32,
        chunked_prefill_size: int = 0,
        enable_mixed_chunk: bool = False,
        prefix_cache: PrefixCacheManager | None = None,
        admission: AdmissionPolicy | None = None,
    ):
        self.worker = worker
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.vocab_size = vocab_size
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_skip_ahead = max_skip_ahead  # requests admitted past one that waits for KV, at most
        self.timeline = timeline
        self.output_sink = output_sink
        self.overlap = overlap
        self.features = features
        self.overlap_worker: OverlapWorker | None = None
        if overlap:
            size = future_map_size or 3 * max_running_requests + 1
            if size < max_running_requests:
                raise ValueError(f"future map size {size} < max_running_requests {max_running_requests}: a batch could never launch")
            self.overlap_worker = OverlapWorker(worker, FutureMap(size, worker.device))
        self.device = worker.device
        # The scheduler thread's device work (metadata copies, table writes, KV-index
        # gathers) runs on this stream; each batch's `ready` event marks its end.
        self.schedule_stream = self.device.new_stream()
        self.inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.reserved_tokens = 0  # KV rows promised to admitted requests
        # Overlap loop: launched batches whose results are not processed yet (oldest first).
        self.in_flight: deque[tuple[ScheduleBatch, LaunchedBatch]] = deque()
        self.outbox: list[RequestOutput] = []
        self._stop = False
        self.last_error: str | None = None
        self.sync_points = 0  # overlap loop: launches that had to wait for an older result
        self.fault_hook = None  # test hook: called per request while processing results
        # Chunked prefill and mixed batches (service/engine/chunking.py); None: whole prompts per step.
        self.chunker: PrefillChunker | None = None
        chunk_feature = features.features.get("chunked_prefill")
        if chunked_prefill_size > 0 and chunk_feature is not None and features.enabled[chunk_feature.name]:
            self.chunker = PrefillChunker(chunked_prefill_size, enable_mixed_chunk, chunk_feature)  # type: ignore[arg-type]
        self.prefix_cache = prefix_cache  # None: --disable-prefix-cache
        # Retraction (features/retraction.py): KV set aside at admission, victims under memory pressure.
        self.admission = admission or AdmissionPolicy(RetractionConfig(policy="reserve"))

    # ---- thread-safe entry points -------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.inbox.put(("add", req))

    def add_requests(self, reqs: list[Req]) -> None:
        """Several requests in one command: admitted in the same scheduler step."""
        self.inbox.put(("add_all", reqs))

    def abort_request(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def flush_prefix_cache(self) -> "Future[int]":
        """Evict every unlocked cached prefix (all of them when nothing runs); the future
        gives the rows freed."""
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
            self._run()

    def _run(self) -> None:
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
                    self.last_error = f"recovery failed after: {e!r}"
        if self.overlap_worker is not None:
            self.overlap_worker.shutdown()

    def event_loop_normal(self) -> None:
        """Form a batch, run it, process its result; repeat."""
        batch = None
        while not self._stop:
            self.process_input_requests(self.recv_requests(block=batch is None))
            batch = self.get_next_batch_to_run()
            if batch:
                result = self.run_batch(batch)
                self.process_batch_result(batch, result)
            self.flush_outputs()

    def event_loop_overlap(self) -> None:
        """Launch batch N, then process batch N-1's result while N computes."""
        batch = None
        while not self._stop:
            self.process_input_requests(self.recv_requests(block=batch is None and not self.in_flight))
            batch = self.get_next_batch_to_run()
            if batch and batch.support is not OverlapSupport.FULL:
                self.run_batch_fallback(batch)
            elif batch:
                self.launch_batch(batch)
            if self.in_flight and (batch is None or len(self.in_flight) > 1):
                self.process_batch_result(*self.wait_result(self.in_flight.popleft()))
                self.run_deferred_after_launch()
            self.flush_outputs()

    def run_deferred_after_launch(self) -> None:
        """A batch's after_launch hooks run once every earlier result is processed
        (e.g. grammar masks need the previous tokens accepted), while it computes."""
        if self.in_flight and self.in_flight[0][0].after_launch_pending:
            self.run_after_launch(self.in_flight[0][0])

    def run_after_launch(self, batch: ScheduleBatch) -> None:
        """Each hook on its own: a failing hook fails this batch's requests, nobody else's."""
        batch.after_launch_pending = False
        for feature, rows in batch.plan:
            try:
                feature.after_launch(batch, rows)
            except Exception as e:
                log.exception("after_launch of %s failed", feature.name)
                batch.hook_error = e

    def run_batch_fallback(self, batch: ScheduleBatch) -> None:
        """Per-batch fallback for a batch carrying a feature that cannot fully overlap:
        resolve the pending results first; a "sync point" batch then overlaps as usual,
        a "none" batch runs the normal way (launch, wait, process)."""
        start = time.perf_counter()
        while self.in_flight:
            self.process_batch_result(*self.wait_result(self.in_flight.popleft()))
            self.run_deferred_after_launch()
        names = ",".join(f.name for f, _ in batch.plan if f.support is not OverlapSupport.FULL)
        self.timeline.add(SCHEDULER_TID, f"sync point [{names}]", start, time.perf_counter())
        self.launch_batch(batch, fallback=names)
        if batch.support is OverlapSupport.NONE:
            self.process_batch_result(*self.wait_result(self.in_flight.pop()))

    # ---- loop steps ----------------------------------------------------------------
    def recv_requests(self, block: bool) -> list[tuple[str, object]]:
        """New commands; when nothing could be scheduled, wait briefly for one instead of spinning."""
        cmds = []
        if block:
            self.timeline.mark_idle()
            try:
                cmds.append(self.inbox.get(timeout=0.05 if not self.waiting else 0.01))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self.inbox.get_nowait())
            except queue.Empty:
                return cmds

    def process_input_requests(self, cmds: list[tuple[str, object]]) -> None:
        for kind, arg in cmds:
            if kind in ("add", "add_all"):
                for req in arg if kind == "add_all" else [arg]:  # type: ignore[union-attr]
                    assert isinstance(req, Req)
                    self.reqs[req.rid] = req
                    self.waiting.append(req)
                    self.features.on_admit(req)
            elif kind == "abort":
                req = self.reqs.get(arg)  # type: ignore[arg-type]
                if req is not None:
                    self.finish(req, FinishReason.ABORT)
            elif kind == "flush":
                assert isinstance(arg, Future)
                arg.set_result(self.prefix_cache.flush() if self.prefix_cache is not None else 0)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """A prefill batch when new requests can be admitted, else a decode batch."""
        start = time.perf_counter()
        self.running = [r for r in self.running if not r.finished]
        batch = self.form_prefill_batch() or self.form_decode_batch()
        if batch is not None:
            batch.plan = batch.fb.features = self.features.plan(batch.reqs, batch.partial_rows) + batch.own_plan
            batch.support = support_of(batch.plan)
            for feature, rows in batch.plan:
                feature.on_batch_formed(batch, rows)
            self.timeline.add(SCHEDULER_TID, f"form {batch.mode.value}", start, time.perf_counter(), {"bs": len(batch.reqs)})
        return batch

    def form_prefill_batch(self) -> ScheduleBatch | None:
        """Admit waiting requests in order. One that does not fit the KV pool yet does not block the
        smaller ones behind it, but only `max_skip_ahead` of them may pass it: then it gets the room."""
        step = None
        if self.chunker is not None:  # chunked prefill: a budget the free KV rows can hold
            if self.chunker.mixed:
                self.make_room_for_decode()  # the decodes ride in this step: their rows first
            step = self.chunker.begin_step(self.running, self.free_rows(self.chunker.size))
        held = self.chunker.holding if self.chunker is not None else 0
        admitted: list[Req] = []
        tokens = 0
        blocked: Req | None = None  # the oldest waiting request that does not fit yet
        # KV rows the admission policy leaves for new requests (summed over running requests: only when some wait)
        room = self.admission.room(self.running, self.kv_pool.free_count, self.reserved_tokens, self.kv_pool.size) if self.waiting else 0
        for req in list(self.waiting):
            if step is not None and not step.room():
                break
            if len(self.running) + len(admitted) + held >= self.max_running:
                break
            if req.features:
                try:
                    if not self.features.ready(req):
                        continue  # e.g. its grammar still compiles: others go ahead
                except RequestError as e:
                    self.finish(req, FinishReason.ERROR, error=e.message, error_code=e.code)
                    continue
            n = len(req.prefill_ids)  # a retracted request re-prefills its kept tokens
            if step is None and admitted and tokens + n > self.max_prefill_tokens:
                break
            if self.prefix_cache is not None and self.prefix_cache.should_wait(req, self.cache_limit(req)):
                continue  # a running request's prefill will cache much of its prompt: next step
            need = self.reserve_kv(req, room)
            if need is None:
                blocked = blocked or req
                continue  # it waits until running requests free KV; smaller ones may fit meanwhile
            if blocked is not None:
                if blocked.skipped_by >= self.max_skip_ahead:
                    self.unreserve_kv(req)
                    break  # it waited long enough: what frees up is kept for it
                blocked.skipped_by += 1
            self.waiting.remove(req)
            room -= need
            req.slot = self.req_pool.alloc()
            admitted.append(req)
            tokens += n
            if step is not None:
                if self.prefix_cache is not None:
                    self.prefix_cache.start(req)  # its cached prefix goes into the table first
                step.add(req, req.cache_owned, fresh=True)
        if step is not None:  # chunked prefill: the step's rows (chunks, new prompts, mixed decodes)
            batch, done = self.chunker.build(step, self.req_pool, self.kv_pool, self.vocab_size, self.device)  # type: ignore[union-attr]
            self.running.extend(done)
            return batch
        if not admitted:
            return None
        self.running.extend(admitted)
        self.admission.admitted(len(self.running))
        rows = self.cached_prefix_rows(admitted)
        return build_extend_batch(admitted, self.req_pool, self.kv_pool, self.vocab_size, self.device, rows=rows)

    # ---- prefix cache (service/engine/cache_manager.py) ------------------------------
    def reserve_kv(self, req: Req, room: int) -> int | None:
        """Set aside the request's KV rows as the admission policy costs them (`reserve`: its whole
        budget; `optimistic`: an estimate), less a cached prefix (matched and locked here), evicting
        unlocked cached prefixes first. `room`: the policy's rows left for admissions this step.
        Returns the rows taken from `room`, or None when it does not fit yet."""
        cost = self.admission.cost(req)
        if self.prefix_cache is None:
            if cost > room:
                return None
        else:
            # The tree's rows count as room: unlocked ones are evicted when the request needs them.
            tree_room = room if not self.admission.optimistic else room + self.prefix_cache.tree.total_tokens
            if self.prefix_cache.admit(req, self.cache_limit(req), tree_room, cost) is None:
                return None
        self.reserved_tokens += req.budget_tokens - req.cache_owned
        return cost - req.cache_owned

    def cache_limit(self, req: Req) -> int:
        """The most prompt tokens the request may take from the cache (its features may cap it)."""
        assert self.prefix_cache is not None
        return self.prefix_cache.match_limit(req, self.features.max_cached_prefix(req))

    def unreserve_kv(self, req: Req) -> None:
        """Undo reserve_kv for a request that is not admitted after all."""
        self.reserved_tokens -= req.budget_tokens - req.cache_owned
        if self.prefix_cache is not None:
            self.prefix_cache.cancel(req)

    def cached_prefix_rows(self, admitted: list[Req]) -> list[ExtendRow]:
        """Slotted requests: their cached rows go into the request-to-token table, the rest of each
        prompt (and a retracted request's kept output tokens) is extended on top of them."""
        if self.prefix_cache is not None:
            for req in admitted:
                self.prefix_cache.start(req)
        return [ExtendRow(r, r.prefill_ids[r.cache_owned:], prefix_len=r.cache_owned) for r in admitted]

    def cache_prefilled(self, batch: ScheduleBatch) -> None:
        """An extend batch's result was processed: its prompts' KV is written and may be shared."""
        if self.prefix_cache is None or batch.mode is not ForwardMode.EXTEND:
            return
        for req in batch.reqs:
            self.reserved_tokens -= self.prefix_cache.prefilled(req)

    def form_decode_batch(self) -> ScheduleBatch | None:
        self.make_room_for_decode()  # retraction: every request below gets a KV row
        reqs = [r for r in self.running if r.launched < r.max_new_tokens]
        if not reqs:
            return None
        self.admission.on_decode_step()
        return build_decode_batch(reqs, self.req_pool, self.kv_pool, self.vocab_size, self.device)

    # ---- retraction (features/retraction.py) ------------------------------------------
    def make_room_for_decode(self) -> None:
        """Before a decode batch: each running request that launches a token needs a KV row. When the
        pool is short, unreferenced cached prefixes are evicted first; if that is not enough, every
        result in flight is processed (a counted sync point: victims then have no batch on the forward
        thread, their last token was appended exactly once, no placeholder of theirs is read again and
        no in-flight batch can write their KV rows), then victims are retracted."""
        decoding = [r for r in self.running if not r.finished and r.launched < r.max_new_tokens]
        if self.free_rows(len(decoding)) >= len(decoding):
            return
        start = time.perf_counter()
        synced = bool(self.in_flight)
        while self.in_flight:
            self.process_batch_result(*self.wait_result(self.in_flight.popleft()))
            self.run_deferred_after_launch()
        self.running = [r for r in self.running if not r.finished]
        victims: list[Req] = []
        while True:  # a victim's rows may stay in use (a cached prefix others share): then one more
            decoding = [r for r in self.running if r.launched < r.max_new_tokens]
            more = self.admission.victims(decoding, self.free_rows(len(decoding)))
            if not more:
                break
            for req in sorted(more, key=lambda r: r.arrival, reverse=True):  # the oldest ends up first in the queue
                self.retract(req)
            victims += more
        stats = self.admission.stats
        stats.sync_points += synced
        stats.events += bool(victims)
        if victims:
            self.admission.after_retraction([r for r in self.running if r.launched < r.max_new_tokens])
        self.timeline.add(SCHEDULER_TID, "retract" if victims else "retract check", start, time.perf_counter(),
                          {"retracted": len(victims), "synced": synced, "free": self.kv_pool.free_count})

    def free_rows(self, want: int) -> int:
        """Free KV rows, after evicting unreferenced cached prefixes to reach `want` if needed."""
        short = want - self.kv_pool.free_count
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.tree.evict(short)
        return self.kv_pool.free_count

    def retract(self, req: Req) -> None:
        """Free a settled running request's KV and slot; it waits at the head of the queue to be
        re-prefilled from prompt + kept output tokens (its features rebuild their state from those).
        With the prefix cache its written KV goes into the tree, so the re-prefill mostly hits it."""
        self.free_slot(req)
        req.next_input, req.skipped_by = -1, 0
        req.launched = len(req.output_ids)
        self.running.remove(req)
        state = req.features.get("retraction")
        state = state if isinstance(state, Retracted) else Retracted()
        state.count += 1
        self.features.attach(req, "retraction", state)
        self.admission.stats.retractions += 1
        self.admission.stats.reprefill_tokens += len(req.prompt_ids) + len(req.output_ids)
        self.waiting.appendleft(req)
        try:
            self.features.on_retract(req)
        except Exception as e:
            log.exception("on_retract failed for %s", req.rid)
            self.finish(req, FinishReason.ERROR, error=f"rebuilding state after a retraction failed: {e!r}")

    def run_batch(self, batch: ScheduleBatch) -> BatchResult | BaseException:
        """Normal loop: forward on this thread (on the forward stream) and wait for the tokens."""
        self.features.count(batch.plan, "normal_loop")
        try:
            batch.fb.ready = self.device.record_event()
            self.run_after_launch(batch)
            result = self.worker.step(batch.fb)
            result.synchronize()
            return result
        except Exception as e:
            return e

    def launch_batch(self, batch: ScheduleBatch, fallback: str = "") -> None:
        """Overlap loop: hand the batch to the forward thread; inputs of later
        batches use the returned placeholders until the result is processed."""
        assert self.overlap_worker is not None
        label = f"forward [fallback: {fallback}]" if fallback else "forward"
        while True:
            try:
                handle = self.overlap_worker.launch(batch.fb, label)
                break
            except FutureMapFull:
                if not self.in_flight:
                    raise
                # Sync point: finishing an older batch frees its future slots.
                self.sync_points += 1
                self.process_batch_result(*self.wait_result(self.in_flight.popleft()))
                self.run_deferred_after_launch()
        # In flight from here on, whatever happens next: its future slots are released with it.
        self.in_flight.append((batch, handle))
        batch.placeholders = handle.placeholders
        for req, placeholder in zip(batch.reqs, handle.placeholders):
            req.next_input = placeholder
        self.features.count(batch.plan, "fallback" if fallback else "overlapped")
        if len(self.in_flight) > 1:
            batch.after_launch_pending = True  # after the older batches' results
        else:
            self.run_after_launch(batch)  # runs while the forward computes

    def wait_result(self, item: tuple[ScheduleBatch, LaunchedBatch]) -> tuple[ScheduleBatch, BatchResult | BaseException]:
        batch, handle = item
        try:
            result: BatchResult | BaseException = handle.wait()
        except Exception as e:
            result = e
        assert self.overlap_worker is not None
        # Every batch that could read these placeholders was launched before now.
        self.overlap_worker.future_map.release(handle.slots)
        return batch, result

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult | BaseException) -> None:
        start = time.perf_counter()
        if batch.hook_error is not None and not isinstance(result, BaseException):
            result = batch.hook_error
        if isinstance(result, BaseException):
            log.error("forward failed for a batch of %d: %r", len(batch.reqs), result)
            for req in batch.reqs:
                self.finish(req, FinishReason.ERROR, error=f"forward failed: {result!r}")
            return
        tokens = result.tokens
        feature_rows = {f.name: set(rows) for f, rows in batch.plan}
        for i, req in enumerate(batch.reqs):
            if req.finished:  # finished or aborted while this batch was in flight
                continue
            if i in batch.partial_rows:  # chunked prefill: a non-final chunk's token is not the request's
                try:
                    run_chunk_hooks(batch, i, req, result.extras)
                except Exception as e:
                    log.exception("request %s failed", req.rid)
                    self.finish(req, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
                continue
            token = tokens[i]
            if batch.placeholders is None or req.next_input == batch.placeholders[i]:
                req.next_input = token
            try:
                if self.fault_hook is not None:
                    self.fault_hook(req)
                req.output_ids.append(token)
                extras = {}
                for feature, _ in batch.plan:
                    if i in feature_rows[feature.name]:
                        fields = feature.on_result(batch, i, req, result.extras.get(feature.name))
                        if fields:
                            extras[feature.name] = fields
                self.check_finished_and_emit(req, token, extras)
            except RequestError as e:  # the request's own fault, found while serving it
                self.finish(req, FinishReason.ERROR, error=e.message, error_code=e.code)
            except Exception as e:
                log.exception("request %s failed", req.rid)
                self.finish(req, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
        self.cache_prefilled(batch)
        self.timeline.add(SCHEDULER_TID, f"process {batch.mode.value}", start, time.perf_counter(), {"bs": len(batch.reqs)})

    # ---- per-request results -------------------------------------------------------
    def check_finished_and_emit(self, req: Req, token: int, extras: dict | None = None) -> None:
        """After `token` was appended: stop checks, then the delta for the client."""
        n = len(req.output_ids)
        active = n > req.params.min_new_tokens  # the first min_new_tokens never stop
        match = req.stops.feed(req.detok.add([token]), active)
        if match.matched is not None:
            self.finish(req, FinishReason.STOP, match.matched, match.text, [token], extras=extras)
        elif active and token in req.stop_ids:
            self.finish(req, FinishReason.STOP, token, match.text, [token], extras=extras)
        elif req.feature_stop:
            self.finish(req, FinishReason.STOP, None, match.text, [token], extras=extras)
        elif n >= req.max_new_tokens:
            self.finish(req, FinishReason.LENGTH, None, match.text, [token], extras=extras)
        else:
            self.emit(req, [token], match.text, extras=extras)

    def finish(
        self,
        req: Req,
        reason: FinishReason,
        matched: str | int | None = None,
        text: str = "",
        token_ids: list[int] | None = None,
        error: str | None = None,
        extras: dict | None = None,
        error_code: str = "INTERNAL",
    ) -> None:
        """End a request exactly once: free its KV and request slot, tell the client."""
        if req.finished is not None:
            return
        if reason is FinishReason.LENGTH or (reason is FinishReason.STOP and not isinstance(matched, str)):
            tail = req.stops.feed(req.detok.flush(), len(req.output_ids) > req.params.min_new_tokens)
            text += tail.text
            if tail.matched is not None and matched is None:
                reason, matched = FinishReason.STOP, tail.matched
            elif tail.matched is None:
                text += req.stops.flush()
        req.finished = reason
        self.release(req)
        final: dict = {}
        try:
            final = self.features.on_finish(req)
        finally:
            if final:
                extras = {**(extras or {}), **final}
            self.emit(req, token_ids or [], text, reason, matched, error, extras, error_code)

    def release(self, req: Req) -> None:
        if req.slot >= 0:
            self.free_slot(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.reqs.pop(req.rid, None)

    def free_slot(self, req: Req) -> None:
        """The request's KV rows (into the prefix cache what its processed batches wrote, the rest to
        the pool), its reservation and its request slot."""
        self.reserved_tokens -= req.budget_tokens - req.cache_owned
        if self.prefix_cache is not None:
            self.prefix_cache.release(req)
        else:
            self.kv_pool.free(self.req_pool.rows(req.slot, req.kv_len))
        self.req_pool.free(req.slot)
        req.slot, req.kv_len = -1, 0

    def emit(
        self,
        req: Req,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None = None,
        matched: str | int | None = None,
        error: str | None = None,
        extras: dict | None = None,
        error_code: str = "INTERNAL",
    ) -> None:
        self.outbox.append(
            RequestOutput(req.rid, token_ids, text, len(req.prompt_ids), len(req.output_ids), reason, matched, error,
                          extras or {}, error_code, cached_tokens=req.cached_tokens)
        )

    def flush_outputs(self) -> None:
        if self.outbox:
            out, self.outbox = self.outbox, []
            self.output_sink(out)

    # ---- recovery ------------------------------------------------------------------
    def recover(self, error: str) -> None:
        """After a loop failure: drain the forward thread, fail every live request."""
        for batch, handle in self.in_flight:
            if batch.after_launch_pending:  # the forward may wait on what these hooks provide
                self.run_after_launch(batch)
            try:
                handle.wait()
            except Exception:
                pass
            assert self.overlap_worker is not None
            self.overlap_worker.future_map.release(handle.slots)
        self.in_flight.clear()
        self.last_error = error
        for req in list(self.reqs.values()):
            self.finish(req, FinishReason.ERROR, error=error)
        self.running = []
        self.waiting.clear()
        self.flush_outputs()
