"""Retraction: frees KV for the next decode step, evicting cached prefixes first, then victims.

Whom to retract is the admission policy's choice (admission.py); this manager settles the results
in flight first, frees the victims' rows through the cache manager and puts them back at the head
of the queue with the `retraction` feature attached (features/retraction.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from features.registry import FeatureRegistry
from features.retraction import Retracted
from service.core.request import FinishReason, Req
from service.engine.kv_cache import TokenToKVPool
from service.engine.scheduler.admission import AdmissionPolicy
from service.engine.scheduler.cache import CacheManager
from service.engine.scheduler.in_flight import InFlight
from service.engine.scheduler.output import OutputManager
from service.engine.timeline import SCHEDULER_TID, Timeline

log = logging.getLogger("zerogap.scheduler")


class Retraction:
    """Frees KV for the next decode step: evicts cached prefixes, then retracts victims."""

    def __init__(
        self,
        policy: AdmissionPolicy,
        running: list[Req],
        waiting: deque[Req],
        cache: CacheManager,
        kv_pool: TokenToKVPool,
        in_flight: InFlight,
        output: OutputManager,
        features: FeatureRegistry,
        timeline: Timeline,
    ):
        self.policy = policy
        self.running = running
        self.waiting = waiting
        self.cache = cache
        self.kv_pool = kv_pool
        self.in_flight = in_flight
        self.output = output
        self.features = features
        self.timeline = timeline

    def make_room_for_decode(self) -> None:
        """Before a decode batch: each running request that launches a token needs a KV row. When the
        pool is short, unreferenced cached prefixes are evicted first; if that is not enough, every
        result in flight is processed (a counted sync point: victims then have no batch on the forward
        thread, their last token was appended exactly once, no placeholder of theirs is read again and
        no in-flight batch can write their KV rows), then victims are retracted."""
        decoding = [r for r in self.running if not r.finished and r.launched < r.max_new_tokens]
        if self.cache.free_rows(len(decoding)) >= len(decoding):
            return
        start = time.perf_counter()
        synced = bool(self.in_flight)
        self.in_flight.drain()
        self.running[:] = [r for r in self.running if not r.finished]
        victims: list[Req] = []
        while True:  # a victim's rows may stay in use (a cached prefix others share): then one more
            decoding = [r for r in self.running if r.launched < r.max_new_tokens]
            more = self.policy.victims(decoding, self.cache.free_rows(len(decoding)))
            if not more:
                break
            for req in sorted(
                more, key=lambda r: r.arrival, reverse=True
            ):  # the oldest ends up first in the queue
                self.retract(req)
            victims += more
        stats = self.policy.stats
        stats.sync_points += synced
        if synced:
            self.features.count_event_sync("retraction")  # its declared sync event
        stats.events += bool(victims)
        if victims:
            self.policy.after_retraction([r for r in self.running if r.launched < r.max_new_tokens])
        self.timeline.add(
            SCHEDULER_TID,
            "retract" if victims else "retract check",
            start,
            time.perf_counter(),
            {"retracted": len(victims), "synced": synced, "free": self.kv_pool.free_count},
        )

    def retract(self, req: Req) -> None:
        """Free a settled running request's KV and slot; it waits at the head of the queue to be
        re-prefilled from prompt + kept output tokens (its features rebuild their state from those).
        With the prefix cache its written KV goes into the tree, so the re-prefill mostly hits it."""
        self.cache.free_slot(req)
        req.next_input, req.skipped_by = -1, 0
        req.launched = len(req.output_ids)
        self.running.remove(req)
        state = req.features.get("retraction")
        state = state if isinstance(state, Retracted) else Retracted()
        state.count += 1
        self.features.attach(req, "retraction", state)
        self.policy.stats.retractions += 1
        self.policy.stats.reprefill_tokens += len(req.prompt_ids) + len(req.output_ids)
        self.waiting.appendleft(req)
        try:
            self.features.on_retract(req)
        except Exception as e:
            log.exception("on_retract failed for %s", req.rid)
            self.output.finish(
                req, FinishReason.ERROR, error=f"rebuilding state after a retraction failed: {e!r}"
            )
