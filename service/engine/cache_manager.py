"""The prefix cache as the scheduler uses it: per-request match, insert and release.

Scheduler thread only. Accounting: a request's own KV rows are reserved at
admission (`budget_tokens - cache_owned`); rows the tree holds are counted by
the tree (`RadixCache.total_tokens`). `reserved + tree <= pool size` always
holds, so allocation never fails; rows in the tree that no running request
locks are evictable and are evicted (LRU leaves first) before a request waits.

When rows change hands (docs/architecture.md, "Prefix cache"):
- admission: the matched rows are locked and copied into the request's row of
  the request-to-token table at [0, m); the rest of the prompt is prefilled on
  top of them;
- after its prefill result is processed: the whole prompt's rows (written by
  that processed batch) are adopted by the tree, so requests arriving while it
  decodes share them;
- at finish: prompt + output[:-1] (the KV of the last sampled token is not
  written; under overlap the row the next, in-flight batch writes is not
  inserted either) are inserted, the rest of its rows freed, its lock dropped.

A model with recurrent layers (`states`: service/engine/state_snapshots.py) matches only up to a
node holding a snapshot of those layers' states, and its request's slot starts from a copy of it.
Such a request's prompt is cached when its prefill result is processed, with a snapshot of its
states after it (copied by the next batch's forward, before the request's first decode: so a next
turn whose history differs from the answer as generated, e.g. without its reasoning, still finds the
last prompt), and its tokens when it ends: all its KV rows, with a snapshot after them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from service.core.device import Device
from service.core.feature import Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardMode, StateCopies
from service.core.request import FinishReason, Req
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.prefix_cache import RadixCache
from service.engine.schedule_batch import ScheduleBatch
from service.engine.state_snapshots import Snapshot, StateSnapshots

# A waiting request that shares at least this many more tokens with a request whose
# prefill is under way than the cache holds for it waits for that prefill to be inserted.
SHARE_WAIT_TOKENS = 16
# A recurrent model's prompt that shares at least this many more tokens with a cached one than a
# snapshot covers is cut there (chunked prefill), and a snapshot is kept after the shared part.
BRANCH_SNAPSHOT_TOKENS = 32


def cache_key(req: Req) -> list[int]:
    """The ids the tree matches a request's prompt by (image spans keyed by their images' hashes)."""
    return req.prompt_key if req.prompt_key is not None else req.prompt_ids


def match_key(req: Req) -> list[int]:
    """What admission matches: the prompt's key, and a retracted request's kept output tokens (no
    copy when there are none)."""
    key = cache_key(req)
    return key + req.output_ids if req.output_ids else key


def common_prefix_len(a: list[int], b: list[int], known: int = 0) -> int:
    """How many leading ids `a` and `b` share, given that the first `known` are equal (bisection over
    slice comparisons)."""
    lo, hi = known, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class PrefixCacheInfo:
    """What GetServerInfo and the metrics report."""

    enabled: bool
    cached_tokens: int = 0  # rows the tree holds now
    evictable_tokens: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    hit_requests: int = 0
    requests: int = 0
    evicted_tokens: int = 0
    hit_rate: float = 0.0
    state_snapshots: int = 0  # recurrent layers' snapshots held (of state_snapshot_rows)
    state_snapshot_rows: int = 0


class PrefixCacheManager:
    enabled = True

    def __init__(
        self,
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        device: Device,
        states: StateSnapshots | None = None,
    ):
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.device = device
        self.states = states  # a recurrent model's state snapshots
        self.tree = RadixCache(kv_pool, states)
        self.prefilling: dict[str, Req] = {}  # admitted, prefill result not processed yet

    # ---- admission ------------------------------------------------------------------
    def match_limit(self, req: Req, feature_limit: int | None) -> int:
        """At least one prompt token is left to prefill (its logits are sampled)."""
        limit = len(req.prefill_ids) - 1
        return limit if feature_limit is None else min(limit, feature_limit)

    def should_wait(self, req: Req, limit: int) -> bool:
        """Whether a request whose prefill is under way will cache much more of this prompt (at least
        SHARE_WAIT_TOKENS more than the cache holds now) in about the time this one would take to
        compute that part itself: then it waits for it. The tree takes a prompt whole, after its last
        chunk, so a sharer with more of its prompt left to prefill than this one would gain from it
        (a short chat behind a long document that shares only a system prompt) is not waited for.
        A recurrent model's prompts are not cached after prefill: nothing to wait for."""
        if not self.prefilling or self.states is not None:
            return False
        key = cache_key(req)
        cached = self.tree.match_len(key, limit)
        want = cached + SHARE_WAIT_TOKENS
        if limit < want:
            return False
        head = key[:want]
        for o in self.prefilling.values():
            other = cache_key(o)
            if len(other) < want or other[:want] != head:
                continue
            left = len(other) - max(o.kv_len, o.cache_owned)  # its prompt rows still to prefill
            gain = common_prefix_len(key[:limit], other, want) - cached
            if left <= gain + SHARE_WAIT_TOKENS:
                return True
        return False

    def cached_len(self, req: Req, limit: int) -> int:
        """How many of the tokens `admit` would match are cached now (no split, no lock, no LRU touch)."""
        if self.states is not None:
            return self.tree.snapshot_len(match_key(req), limit)
        return self.tree.match_len(match_key(req), limit)

    def admit(self, req: Req, limit: int, room: int, cost: int | None = None) -> int | None:
        """Match and lock the longest cached prefix, evicting unlocked leaves until the request's
        own rows fit in `room` (pool rows not reserved by running requests). Returns the matched
        length, or None (nothing kept locked) when the request does not fit yet."""
        match = self.tree.match(match_key(req), limit)
        node = match.node
        if self.states is not None:  # as far as a snapshot of the recurrent states goes
            node = self.tree.snapshot_node(node)
        length = self.tree.depth(node)
        self.tree.lock(node)
        need = (req.budget_tokens if cost is None else cost) - length
        short = need - (room - self.tree.total_tokens)
        if short > 0 and self.tree.evict(short) < short:
            self.tree.unlock(node)
            return None
        req.cache_node, req.cache_owned, req.cached_tokens = node, length, length
        if self.states is not None and match.length - length >= BRANCH_SNAPSHOT_TOKENS:
            req.snapshot_at = match.length  # where it parts from a cached prompt
        self.prefilling[req.rid] = req  # siblings admitted after it in this step see it too
        return length

    def cancel(self, req: Req) -> None:
        """Undo `admit` for a request that stays waiting after all."""
        self.prefilling.pop(req.rid, None)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_owned, req.cached_tokens, req.snapshot_at = None, 0, 0, 0

    def start(self, req: Req) -> None:
        """The admitted request has its slot: count the hit and copy the matched rows into the
        request-to-token table, [0, m) (host mirror and device table; the device write runs on
        the scheduler stream, before the batch's own table writes and KV-index gather)."""
        s = self.tree.stats
        m = req.cache_owned
        s.requests += 1
        s.prompt_tokens += len(req.prompt_ids)
        s.hit_tokens += m
        s.hit_requests += m > 0
        if m == 0:
            return
        self._point_table(req, 0, self._path_rows(req))
        if self.states is not None:  # its slot's states start from the node's snapshot
            self.states.restore(req.cache_node.snapshot, req.slot)

    def _path_rows(self, req: Req) -> torch.Tensor:
        parts = []
        node = req.cache_node
        while node is not None and node is not self.tree.root:
            parts.append(node.rows)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else torch.empty(0, dtype=torch.int64)

    # ---- after prefill --------------------------------------------------------------
    def prefilled(self, req: Req) -> int:
        """The request's prefill result was processed: its prompt's KV is written. The tree
        adopts those rows unless another request cached more of the prompt meanwhile (then its
        own rows stay its own until it finishes). Returns the rows the tree adopted (the
        caller's reservation for the request shrinks by that much). A chunk of a longer prompt
        leaves the request prefilling: requests that share its prompt keep waiting for all of it."""
        prompt = cache_key(req)
        if req.finished is None and req.slot >= 0 and req.kv_len < len(prompt):
            return 0
        self.prefilling.pop(req.rid, None)
        if req.finished is not None or req.slot < 0 or req.cache_node is None:
            return 0
        if self.states is not None:
            return self._adopt_with_snapshot(req)
        owned = req.cache_owned
        if len(prompt) <= owned or self.tree.match_len(prompt) != owned:
            return 0
        rows = self.req_pool.rows(req.slot, len(prompt))
        assert self.tree.insert(prompt, rows) == owned
        match = self.tree.match(prompt)
        self.tree.lock(match.node)
        self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_owned = match.node, len(prompt)
        return len(prompt) - owned

    # ---- finish ---------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """The request ends: insert what its processed batches wrote, free the rest of its own
        rows, drop its lock. Called once, while its slot is still held."""
        self.prefilling.pop(req.rid, None)
        if req.prompt_snapshot is not None:  # ended before the tree took its prompt
            self.states.discard(req.prompt_snapshot)  # type: ignore[union-attr]
            req.prompt_snapshot = None
        rows = self.req_pool.rows(req.slot, req.kv_len)
        owned = req.cache_owned
        valid = self._valid_len(req) if self.states is None else self._with_state_len(req)
        keep = owned
        if valid > owned:
            tokens = (cache_key(req) + req.output_ids)[:valid]
            cached = self.tree.insert(tokens, rows[:valid])
            assert cached >= owned, "prefix cache: a locked path was evicted"
            self.kv_pool.free(rows[owned:cached])  # duplicates of rows the tree already had
            keep = valid
            if self.states is not None:
                self._save_states(req, tokens)
        self.kv_pool.free(rows[keep:])
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_owned = None, 0

    def _with_state_len(self, req: Req) -> int:
        """A recurrent model's request: the tokens its slot's states follow once every launched batch
        has run (all its KV rows': under overlap that may include one a batch in flight writes), when
        they are all known and a snapshot row can be had (the least recently used unlocked snapshot
        goes if none is free); else none. An error: none."""
        assert self.states is not None
        known = len(cache_key(req)) + len(req.output_ids)
        if req.finished is FinishReason.ERROR or req.kv_len > known or req.kv_len <= req.cache_owned:
            return 0
        tokens = (cache_key(req) + req.output_ids)[: req.kv_len]
        if self.tree.snapshot_len(tokens) == req.kv_len:  # cached with its states already
            return req.kv_len
        return req.kv_len if self._snapshot_row() else 0

    def _snapshot_row(self) -> bool:
        """Whether a snapshot row is free, after letting the least recently used snapshot go that no
        running request's match holds (with what only it made useful) if none was."""
        assert self.states is not None
        if self.states.free_count:
            return True
        unlocked = [s for s in self.states.held if s.node is not None and s.node.lock_ref == 0]
        if not unlocked:
            return False
        self.tree.drop_snapshot(min(unlocked, key=lambda s: s.node.last_access).node)
        return True

    def prompt_snapshots(self, batch: ScheduleBatch) -> None:
        """A recurrent model's batch was formed: each request whose prompt's last tokens it runs (not a
        retracted one's re-prefill) keeps a snapshot of its states after them, which the next batch's
        forward copies before anything else touches the slot; the tree takes it with the prompt's rows
        once this batch's result is processed (`prefilled`). A chunk that ends where its prompt parts
        from a cached one (`snapshot_at`) leaves a snapshot on the cached node there (its rows are the
        other prompt's, written by processed batches)."""
        if self.states is None or batch.mode is not ForwardMode.EXTEND:
            return
        for i, req in enumerate(batch.reqs):
            if req.snapshot_at and req.kv_len >= req.snapshot_at:
                self._branch_snapshot(req)
            final = i not in batch.partial_rows and req.kv_len == len(cache_key(req)) > req.cache_owned
            if final and not req.output_ids and req.prompt_snapshot is None and self._snapshot_row():
                req.prompt_snapshot = self.states.save(req.slot, None)

    def _branch_snapshot(self, req: Req) -> None:
        assert self.states is not None
        at, req.snapshot_at = req.snapshot_at, 0
        key = match_key(req)
        if req.kv_len != at or self.tree.match_len(key, at) != at or self.tree.snapshot_len(key, at) == at:
            return  # the prompt went whole (no chunking), or the other prompt is gone, or a snapshot is there
        if self._snapshot_row():
            match = self.tree.match(key, at)
            if match.length == at:  # (still: making room may have let it go)
                match.node.snapshot = self.states.save(req.slot, match.node)

    def _adopt_with_snapshot(self, req: Req) -> int:
        """The tree takes a recurrent model's prompt rows with the snapshot of its states after them.
        Where another request cached more of the prompt than this one matched (a next turn whose match
        stopped inside the last answer), the tree's rows stand in for this one's own from then on (its
        table points at them; its own, which only batches launched before now read, are freed)."""
        assert self.states is not None
        snap, req.prompt_snapshot = req.prompt_snapshot, None
        if snap is None or snap not in self.states.held:  # none taken, or a failed step spoiled it
            return 0
        prompt, owned = cache_key(req), req.cache_owned
        rows = self.req_pool.rows(req.slot, len(prompt))
        cached = self.tree.match_len(prompt)
        if cached > owned:
            theirs = self.tree.match(prompt, cached).rows[owned:cached]
            self.kv_pool.free(rows[owned:cached])
            rows[owned:cached] = theirs
            self._point_table(req, owned, theirs)
        assert self.tree.insert(prompt, rows) == cached
        node = self.tree.match(prompt).node
        if node.snapshot is None:
            node.snapshot, snap.node = snap, node
        else:
            self.states.discard(snap)
        self.tree.lock(node)
        self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_owned = node, len(prompt)
        return len(prompt) - owned

    def _point_table(self, req: Req, start: int, rows: torch.Tensor) -> None:
        """The request's table row from `start` on points at `rows` (host mirror, and the device table on
        the scheduler stream, before any later batch's gather)."""
        slots = torch.full((rows.numel(),), req.slot, dtype=torch.int64)
        positions = torch.arange(start, start + rows.numel(), dtype=torch.int64)
        self.req_pool.write_host(slots, positions, rows)
        d = self.device.to_device(slots, positions, rows)
        self.req_pool.write_device(d[0], d[1], d[2])

    def _save_states(self, req: Req, tokens: list[int]) -> None:
        """The tree now holds `tokens`: the node ending there keeps a snapshot of the request's slot
        states (copied by the next batch's forward, before anyone reuses the slot)."""
        assert self.states is not None
        node = self.tree.match(tokens).node
        if node.snapshot is None:
            node.snapshot = self.states.save(req.slot, node)

    # ---- state snapshots: a batch's copies, and what a failed step spoils ----------------
    def formed(self) -> tuple[int, StateCopies | None]:
        """A batch was formed: its number, and the state copies its forward makes first."""
        return (0, None) if self.states is None else self.states.formed()

    def batch_done(self, number: int, ok: bool, live: Iterable[Req]) -> list[Req]:
        """Batch `number`'s result was processed. A failed one may have left slots' states half
        updated (and a late row unwritten): the snapshots copied by it or after it go, and of the `live`
        requests those whose cached path runs through one's node are returned (they started from it,
        or their table points at rows only it vouched for: to be failed; then `prune`)."""
        if self.states is None:
            return []
        spoiled = self.states.batch_done(number, ok)
        if not spoiled:  # (every batch but a failed one: `live` is not looked at)
            return []
        nodes = {id(s.node) for s in spoiled if s.node is not None}
        hit = [r for r in live if r.finished is None and self._through(r.cache_node, nodes)]
        for snap in spoiled:
            self._drop(snap)
        return hit

    def _through(self, node, nodes: set[int]) -> bool:
        while node is not None and node is not self.tree.root:
            if id(node) in nodes:
                return True
            node = node.parent
        return False

    def _drop(self, snap: Snapshot) -> None:
        if snap.node is None:  # a prompt's, the tree has not taken yet
            self.states.discard(snap)  # type: ignore[union-attr]
        else:
            self.tree.drop_snapshot(snap.node)

    def prune(self) -> None:
        """Rows no snapshot follows any more (a recurrent model's, after a failed step) go."""
        if self.states is not None:
            self.tree.prune()

    def after_failure(self) -> None:
        """The scheduler failed and abandoned its batches unprocessed (every request failed): the
        snapshots not settled go, with what only they made useful."""
        if self.states is None:
            return
        self.states.forget_restores()
        for snap in self.states.unsettled():
            self._drop(snap)
        self.tree.prune()

    @staticmethod
    def _valid_len(req: Req) -> int:
        """Leading tokens whose KV rows were written by batches whose results were processed:
        the prompt and every output token but the last (its KV is written, if at all, by a
        batch not processed yet). An error or a request without a processed result: none."""
        if req.finished is FinishReason.ERROR or not req.output_ids:
            return 0
        return min(req.kv_len, len(req.prompt_ids) + len(req.output_ids) - 1)

    # ---- admin ----------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        """Rows the tree holds."""
        return self.tree.total_tokens

    def evict(self, tokens: int) -> int:
        """Evict unlocked leaves (LRU) until `tokens` rows are freed or none is left; the rows freed."""
        return self.tree.evict(tokens)

    def flush(self) -> int:
        return self.tree.flush()

    def info(self) -> PrefixCacheInfo:
        s, t = self.tree.stats, self.tree
        return PrefixCacheInfo(
            True,
            t.total_tokens,
            t.evictable_tokens,
            s.hit_tokens,
            s.prompt_tokens,
            s.hit_requests,
            s.requests,
            s.evicted_tokens,
            s.hit_rate,
            len(self.states.held) if self.states is not None else 0,
            self.states.count if self.states is not None else 0,
        )


# ---- the prefix cache's entry in the feature matrix ---------------------------------------
# Engine machinery, not a per-request feature: this declares its overlap support and makes
# `--disable-feature prefix_cache` (= `--disable-prefix-cache`) work. It is active for no request, so
# it never joins a batch's plan and its batch counters stay at zero; the cache's own counters (hits,
# cached tokens) are in GetServerInfo and the metrics.
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

    def unavailable_reason(self, model: FeatureContext | None) -> str | None:
        """A model with recurrent layers (Qwen3.5's Gated DeltaNet, Mamba, LFM2's conv) is cached with
        snapshots of those layers' states: none when --state-snapshots is 0."""
        if model is None or getattr(model.args, "state_snapshots", None) != 0:
            return None
        from service.models.families import model_shape
        from service.models.vision import text_config

        shape = model_shape(text_config(model.hf_config))
        if shape.recurrent is None:
            return None
        return (
            f"{shape.architecture}'s recurrent layers keep a state per request, not per token, and "
            "--state-snapshots 0 keeps no snapshot of it"
        )
