"""Prefill formation: admit waiting requests in order, whole prompts or chunks of them.

One request that does not fit the KV pool yet does not block the smaller ones behind it, but only
`max_skip_ahead` of them may pass it: then it gets the room. With chunked prefill
(service/engine/chunking.py) a step's token budget is what the free KV rows can hold, and in mixed
mode the running requests' decodes ride in the same batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from features.registry import FeatureRegistry
from service.core.device import Device
from service.core.request import FinishReason, Req, RequestError
from service.engine.chunking import ChunkStep, PrefillChunker
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.schedule_batch import ExtendRow, ScheduleBatch, build_extend_batch
from service.engine.scheduler.admission import AdmissionPolicy
from service.engine.scheduler.cache import CacheManager
from service.engine.scheduler.output import OutputManager
from service.engine.scheduler.retraction import Retraction


@dataclass
class PrefillLimits:
    max_running: int  # requests with a slot, at most
    max_prefill_tokens: int  # prompt tokens computed per unchunked prefill batch (one request may exceed it)
    max_skip_ahead: int = 32  # requests admitted past one that waits for KV, at most


class PrefillManager:
    def __init__(
        self,
        limits: PrefillLimits,
        waiting: deque[Req],
        running: list[Req],
        chunker: PrefillChunker | None,
        policy: AdmissionPolicy,
        retraction: Retraction,
        cache: CacheManager,
        output: OutputManager,
        features: FeatureRegistry,
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        vocab_size: int,
        device: Device,
    ):
        self.limits = limits
        self.waiting, self.running = waiting, running
        self.chunker = chunker  # None: whole prompts per step
        self.policy, self.retraction, self.cache, self.output = policy, retraction, cache, output
        self.features = features
        self.req_pool, self.kv_pool, self.vocab_size, self.device = req_pool, kv_pool, vocab_size, device

    def form(self) -> ScheduleBatch | None:
        lim = self.limits
        step = None
        if self.chunker is not None:  # chunked prefill: a budget the free KV rows can hold
            if self.chunker.mixed:
                self.retraction.make_room_for_decode()  # the decodes ride in this step: their rows first
            step = self.chunker.begin_step(self.running, self.cache.free_rows(self.chunker.size))
        held = self.chunker.holding if self.chunker is not None else 0
        admitted: list[Req] = []
        tokens = 0
        blocked: Req | None = None  # the oldest waiting request that does not fit yet
        # KV rows the admission policy leaves for new requests (summed over running requests: only when some wait)
        room = (
            self.policy.room(
                self.running, self.kv_pool.free_count, self.cache.reserved_tokens, self.kv_pool.size
            )
            if self.waiting
            else 0
        )
        for req in self._order(step):
            if (
                step is not None
                and step.pending is not None
                and not step.overtakes(self.cache.to_compute(req))
            ):
                step.resume()  # the continuing chunk goes before this one
            if step is not None and not step.room():
                break
            if len(self.running) + len(admitted) + held >= lim.max_running:
                break
            if req.features:
                try:
                    if not self.features.ready(req):
                        continue  # e.g. its grammar still compiles: others go ahead
                except RequestError as e:
                    self.output.finish(req, FinishReason.ERROR, error=e.message, error_code=e.code)
                    continue
            if step is None and admitted and tokens + self.cache.to_compute(req) > lim.max_prefill_tokens:
                break
            if self.cache.should_wait(req):
                continue  # a running request's prefill will cache much of its prompt: next step
            need = self.cache.reserve(req, self.policy.cost(req), room, self.policy.optimistic)
            if need is None:
                blocked = blocked or req
                continue  # it waits until running requests free KV; smaller ones may fit meanwhile
            if blocked is not None:
                if blocked.skipped_by >= lim.max_skip_ahead:
                    self.cache.unreserve(req)
                    break  # it waited long enough: what frees up is kept for it
                blocked.skipped_by += 1
            self.waiting.remove(req)
            room -= need
            req.slot = self.req_pool.alloc()
            admitted.append(req)
            tokens += len(req.prefill_ids) - req.cache_owned  # what it computes: its prefix is matched now
            if step is not None:
                self.cache.start(req)  # its cached prefix goes into the table first
                step.add(req, req.cache_owned, fresh=True)
        if step is not None:  # chunked prefill: the step's rows (chunks, new prompts, mixed decodes)
            assert self.chunker is not None
            batch, done = self.chunker.build(step, self.req_pool, self.kv_pool, self.vocab_size, self.device)
            self.running.extend(done)
            self._plan_hits(batch, step.rows)  # the first rows of the batch
            return batch
        if not admitted:
            return None
        self.running.extend(admitted)
        self.policy.admitted(len(self.running))
        rows = self.cache.extend_rows(admitted)
        batch = build_extend_batch(
            admitted, self.req_pool, self.kv_pool, self.vocab_size, self.device, rows=rows
        )
        self._plan_hits(batch, rows)
        return batch

    def _order(self, step: ChunkStep | None) -> list[Req]:
        """Admission order: arrival, except that prompts short enough to overtake the chunk of the one
        part-way through its prompt come first (service/engine/chunking.py). Short is what a prompt
        computes: a long prompt whose prefix is cached (the next turn of a conversation) is short."""
        order = list(self.waiting)
        if step is None or step.pending is None:
            return order
        short = [step.overtakes(self.cache.to_compute(r)) for r in order]
        return [r for r, s in zip(order, short) if s] + [r for r, s in zip(order, short) if not s]

    def _plan_hits(self, batch: ScheduleBatch, rows: list[ExtendRow]) -> None:
        """The prefix cache's matrix row counts the batches whose prefills start from a cached prefix."""
        hits = [i for i, row in enumerate(rows) if row.new_slot and row.prefix_len > 0]
        feature = self.features.enabled_feature("prefix_cache") if hits else None
        if feature is not None:
            batch.own_plan = batch.own_plan + [(feature, hits)]
