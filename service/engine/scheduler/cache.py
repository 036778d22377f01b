"""The KV cache as the scheduler sees it: reservations, a request's rows, and the prefix cache.

`CacheManager` keeps `reserved_tokens` (the KV rows promised to admitted requests) and is where a
request's rows come from (a cached prefix, then its own) and go back to. The prefix cache is always
there: `NullPrefixCache` (--disable-prefix-cache) matches nothing, holds nothing, and frees a
request's rows straight to the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from service.core.forward_batch import ForwardMode, StateCopies
from service.core.request import Req
from service.engine.cache_manager import PrefixCacheInfo, PrefixCacheManager
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.schedule_batch import ExtendRow, ScheduleBatch


class NullPrefixCache:
    """The prefix cache when it is off: the same calls as PrefixCacheManager, none of the effects."""

    enabled = False
    total_tokens = 0

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        self.req_pool = req_pool
        self.kv_pool = kv_pool

    def match_limit(self, req: Req, feature_limit: int | None) -> int:
        return 0

    def should_wait(self, req: Req, limit: int) -> bool:
        return False

    def cached_len(self, req: Req, limit: int) -> int:
        return 0

    def admit(self, req: Req, limit: int, room: int, cost: int | None = None) -> int | None:
        return None if cost is not None and cost > room else 0

    def cancel(self, req: Req) -> None:
        pass

    def start(self, req: Req) -> None:
        pass

    def prefilled(self, req: Req) -> int:
        return 0

    def release(self, req: Req) -> None:
        self.kv_pool.free(self.req_pool.rows(req.slot, req.kv_len))

    def evict(self, tokens: int) -> int:
        return 0

    def flush(self) -> int:
        return 0

    def formed(self) -> tuple[int, StateCopies | None]:
        return 0, None

    def batch_done(self, number: int, ok: bool, live: Iterable[Req]) -> list[Req]:
        return []

    def prompt_snapshots(self, batch: ScheduleBatch) -> None:
        pass

    def prune(self) -> None:
        pass

    def after_failure(self) -> None:
        pass

    def info(self) -> PrefixCacheInfo:
        return PrefixCacheInfo(False)


PrefixCache = PrefixCacheManager | NullPrefixCache


class CacheManager:
    """Scheduler thread: KV reservations and a request's rows, through the (possibly null) prefix cache."""

    def __init__(
        self,
        prefix: PrefixCache,
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        feature_limit: Callable[[Req], int | None],
    ):
        self.prefix = prefix
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.feature_limit = (
            feature_limit  # the most prompt tokens a request's features let it take from the cache
        )
        self.reserved_tokens = 0  # KV rows promised to admitted requests

    def limit(self, req: Req) -> int:
        """The most prompt tokens the request may take from the cache (its features may cap it)."""
        return self.prefix.match_limit(req, self.feature_limit(req))

    def to_compute(self, req: Req) -> int:
        """The tokens the request's prefill computes if it is admitted now: its prompt (and a retracted
        request's kept tokens) past the prefix the cache holds for it."""
        return len(req.prefill_ids) - self.prefix.cached_len(req, self.limit(req))

    def should_wait(self, req: Req) -> bool:
        """A running request's prefill will cache much of its prompt: admit it next step."""
        return self.prefix.should_wait(req, self.limit(req))

    def reserve(self, req: Req, cost: int, room: int, optimistic: bool) -> int | None:
        """Set aside the request's KV rows as the admission policy costs them (`cost`), less a cached
        prefix (matched and locked here), evicting unlocked cached prefixes first. `room`: the policy's
        rows left for admissions this step. Returns the rows taken from `room`, or None when it does not
        fit yet. The tree's rows count as room when optimistic: unlocked ones are evicted when needed."""
        tree_room = room if not optimistic else room + self.prefix.total_tokens
        if self.prefix.admit(req, self.limit(req), tree_room, cost) is None:
            return None
        self.reserved_tokens += req.budget_tokens - req.cache_owned
        return cost - req.cache_owned

    def unreserve(self, req: Req) -> None:
        """Undo `reserve` for a request that is not admitted after all."""
        self.reserved_tokens -= req.budget_tokens - req.cache_owned
        self.prefix.cancel(req)

    def start(self, req: Req) -> None:
        """A slotted request's cached prefix goes into its row of the request-to-token table."""
        self.prefix.start(req)

    def extend_rows(self, admitted: list[Req]) -> list[ExtendRow]:
        """Slotted requests: their cached rows go into the table, the rest of each prompt (and a
        retracted request's kept output tokens) is extended on top of them."""
        for req in admitted:
            self.prefix.start(req)
        return [ExtendRow(r, r.prefill_ids[r.cache_owned :], prefix_len=r.cache_owned) for r in admitted]

    def prefilled(self, batch: ScheduleBatch) -> None:
        """An extend batch's result was processed: its prompts' KV is written and may be shared.
        Not a non-final chunk's: under overlap the final chunk may be in flight, its rows unwritten
        (and never written, should that batch fail)."""
        if batch.mode is ForwardMode.EXTEND:
            for i, req in enumerate(batch.reqs):
                if i not in batch.partial_rows:
                    self.reserved_tokens -= self.prefix.prefilled(req)

    def free_rows(self, want: int) -> int:
        """Free KV rows, after evicting unreferenced cached prefixes to reach `want` if needed."""
        short = want - self.kv_pool.free_count
        if short > 0:
            self.prefix.evict(short)
        return self.kv_pool.free_count

    def free_slot(self, req: Req) -> None:
        """The request's KV rows (into the prefix cache what its processed batches wrote, the rest to
        the pool), its reservation and its request slot."""
        self.reserved_tokens -= req.budget_tokens - req.cache_owned
        self.prefix.release(req)
        self.req_pool.free(req.slot)
        req.slot, req.kv_len = -1, 0
