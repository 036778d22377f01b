"""Admission and retraction: how much KV a request sets aside, and whom a shortage retracts.

The policy (`reserve` / `optimistic`, the new-token ratio) is documented in features/retraction.py,
the request-level side of the same mechanism (its matrix row, payload and counters).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from features.registry import FeatureRegistry
from features.retraction import Retracted, retractions_of
from service.core.request import FinishReason, Req
from service.engine.kv_cache import TokenToKVPool
from service.engine.scheduler.cache import CacheManager
from service.engine.scheduler.in_flight import InFlight
from service.engine.scheduler.output import OutputManager
from service.engine.timeline import SCHEDULER_TID, Timeline

log = logging.getLogger("zerogap.scheduler")

POLICIES = ("optimistic", "reserve")


@dataclass
class RetractionConfig:
    policy: str = "optimistic"  # optimistic | reserve
    init_ratio: float = 0.7  # share of the remaining max_new_tokens set aside at admission
    min_ratio: float = 0.1
    decay_steps: int = 600  # decode steps without retraction from init_ratio down to min_ratio
    max_retractions: int = 3  # per request; then it runs with its whole budget reserved
    headroom_steps: int = 4  # after a retraction the survivors can run this many steps

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown admission policy {self.policy!r} (one of {', '.join(POLICIES)})")
        if not 0 < self.min_ratio <= self.init_ratio <= 1:
            raise ValueError("new-token ratios: need 0 < min <= init <= 1")
        if self.max_retractions < 0 or self.decay_steps < 1 or self.headroom_steps < 1:
            raise ValueError("max_retractions >= 0, decay_steps >= 1, headroom_steps >= 1")


@dataclass
class RetractionStats:
    retractions: int = 0  # requests retracted (a request retracted twice counts twice)
    events: int = 0  # decode steps that retracted
    sync_points: int = 0  # of those, how many first processed results in flight
    peak_running: int = 0  # most requests admitted at once
    reprefill_tokens: int = 0  # tokens prefilled again


@dataclass
class AdmissionPolicy:
    """How much KV admission sets aside per request, and whom a shortage retracts."""

    config: RetractionConfig = field(default_factory=RetractionConfig)
    stats: RetractionStats = field(default_factory=RetractionStats)

    def __post_init__(self) -> None:
        self.ratio = self.config.init_ratio

    @property
    def optimistic(self) -> bool:
        return self.config.policy == "optimistic"

    def reserved(self, req: Req) -> bool:
        """Runs with its whole budget set aside (never a victim)."""
        return not self.optimistic or retractions_of(req) >= self.config.max_retractions

    # ---- admission -------------------------------------------------------------------
    def room(self, running: list[Req], free_rows: int, reserved_tokens: int, pool_size: int) -> int:
        """KV rows new admissions may take now. `reserve`: the pool less every admitted budget (as
        before this module); `optimistic`: the free rows less what running requests are expected to take."""
        if not self.optimistic:
            return pool_size - reserved_tokens
        return free_rows - sum(self.future_rows(r) for r in running if not r.finished)

    def future_rows(self, req: Req) -> int:
        """Rows a running request is expected to take from now on."""
        if self.reserved(req):
            return max(0, req.budget_tokens - req.kv_len)
        left = req.max_new_tokens - req.launched
        return max(1, math.ceil(self.ratio * left)) if left > 0 else 0

    def cost(self, req: Req) -> int:
        """Rows to set aside to admit a waiting (new or retracted) request."""
        if self.reserved(req):
            return req.budget_tokens
        kept = len(req.output_ids)
        return len(req.prompt_ids) + kept + max(1, math.ceil(self.ratio * (req.max_new_tokens - kept)))

    def admitted(self, running: int) -> None:
        self.stats.peak_running = max(self.stats.peak_running, running)

    # ---- decode ----------------------------------------------------------------------
    def on_decode_step(self) -> None:
        c = self.config
        self.ratio = max(c.min_ratio, self.ratio - (c.init_ratio - c.min_ratio) / c.decay_steps)

    def victims(self, decoding: list[Req], free_rows: int) -> list[Req]:
        """None when each decoding request gets a row now; else whom to retract so that the others each
        get a row for `headroom_steps` steps (fewer victims if the candidates run out: at least one step)."""
        if free_rows >= len(decoding):
            return []
        want = self.config.headroom_steps
        candidates = sorted(
            (r for r in decoding if not self.reserved(r)), key=lambda r: (len(r.output_ids), -r.arrival)
        )
        out: list[Req] = []
        n = len(decoding)
        for r in candidates:
            if free_rows >= n * want or n <= 1:
                break
            out.append(r)
            free_rows += r.kv_len
            n -= 1
        return out

    def after_retraction(self, survivors: list[Req]) -> None:
        """Back off: at least the share of max_new_tokens the survivors used, plus the headroom."""
        if not survivors:
            return
        used = sum(r.launched + self.config.headroom_steps for r in survivors)
        budget = sum(r.max_new_tokens for r in survivors)
        self.ratio = min(1.0, max(self.ratio, used / budget))


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
            self.features.count_synced("retraction")  # declared full: the drain is counted against it
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
