"""The prefix cache's entry in the feature matrix.

The cache itself is engine machinery, not a per-request feature: the radix tree
is `service/engine/prefix_cache.py`, its use by the scheduler
`service/engine/cache_manager.py`. This module declares its overlap support
and makes `--disable-feature prefix_cache` (= `--disable-prefix-cache`) work.
It is active for no request, so it never joins a batch's plan and its batch
counters stay at zero; the cache's own counters (hits, cached tokens) are in
GetServerInfo and the metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.core.feature import Feature, OverlapSupport

if TYPE_CHECKING:
    from service.core.request import Req


class PrefixCacheFeature(Feature):
    name = "prefix_cache"
    support = OverlapSupport.FULL
    reason = (
        "matched and inserted on the scheduler thread; only KV written by processed batches is inserted, and rows it "
        "evicts are reused only by later launches, which run after every batch that reads them"
    )
    reads_raw_logits = False
    per_request = False  # equivalence (cache on = off, both loops): tests/scheduler/test_prefix_cache.py

    def active_for(self, req: "Req") -> bool:
        return False
