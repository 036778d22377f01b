"""The prefix cache: a radix tree from token-id sequences to KV pool rows.

Each edge holds a run of token ids and the KV rows that hold their keys and
values (same length). A request that starts with a cached sequence copies those
rows into its request-to-token row and prefills only the rest. Nodes on a
running request's matched path are *locked* (reference counts up to the root),
so nothing in use is evicted; unlocked leaves are evicted least recently used
first when the pool needs room.

The tree is the scheduler thread's alone (no locks). It never touches the
device: rows are host int64 tensors, and the pool's free list is host-side.
Overlap safety is the caller's contract (docs/architecture.md, "Prefix cache"):
only rows whose KV was written by batches whose results were processed are
inserted, and evicted rows are reused only by batches launched later, which the
forward thread runs after every batch that could still read them.

For a model with recurrent layers a node may also hold a state snapshot (`Node.snapshot`,
service/engine/state_snapshots.py): those layers' states after its last token. Such a model's
requests match only up to a node holding one (`snapshot_node`); a snapshot goes with its node.

Observers (`RadixCache.observers`, plain callables) hear every change of what the
tree holds: a node added by `insert` and a leaf removed by `evict` (`flush` too),
each as a `CacheEvent` with the node's whole path from the root. Splits and
locks change no content and are not told. The SMG worker's KV event stream is
built on it (service/kv_events.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.engine.kv_cache import TokenToKVPool
from service.engine.state_snapshots import Snapshot, StateSnapshots


@dataclass(eq=False)
class Node:
    """One edge of the tree: `key` token ids whose KV lives in `rows`."""

    key: list[int]
    rows: torch.Tensor
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    lock_ref: int = 0  # running requests whose matched path goes through this node
    last_access: int = 0  # logical clock: LRU order
    snapshot: Snapshot | None = None  # recurrent layers' states after its last token

    def __lt__(self, other: "Node") -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


@dataclass
class Match:
    """The longest cached prefix of a sequence: its length, rows and deepest node."""

    length: int
    rows: torch.Tensor
    node: Node


@dataclass
class CacheStats:
    """Counters since start (or the last reset of counters; flush keeps them)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of those, served from the cache
    hit_requests: int = 0  # admitted requests with a hit
    requests: int = 0  # admitted requests
    evicted_tokens: int = 0
    inserted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class CacheEvent:
    """The tree now holds (`stored`) or no longer holds (`removed`) tokens[start:] after tokens[:start]."""

    kind: str  # "stored" | "removed"
    tokens: tuple[int, ...]  # the node's path from the root, its own tokens last
    start: int  # where the node's own tokens begin


CacheObserver = Callable[[CacheEvent], None]


def _common_len(key: list[int], tokens: list[int], start: int, end: int) -> int:
    """How many leading tokens of an edge's `key` equal `tokens[start:end]`."""
    n = min(len(key), end - start)
    if n == len(key) and tokens[start : start + n] == key:  # the usual case, compared in C
        return n
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    """Token ids -> KV rows, with lock counts and LRU eviction of unlocked leaves."""

    def __init__(self, kv_pool: TokenToKVPool, states: StateSnapshots | None = None):
        self.kv_pool = kv_pool
        self.states = states  # a recurrent model's snapshots (None: K/V rows are the whole story)
        self.root = Node([], torch.empty(0, dtype=torch.int64))
        self.root.lock_ref = 1  # never evicted
        self.total_tokens = 0  # rows the tree holds
        self.locked_tokens = 0  # of those, on some running request's path
        self.stats = CacheStats()
        self._clock = 0
        self.observers: list[CacheObserver] = []  # called on the scheduler thread, in order

    def path(self, node: Node) -> tuple[int, ...]:
        """The token ids from the root to the end of `node`."""
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return tuple(t for key in reversed(parts) for t in key)

    def _tell(self, kind: str, node: Node) -> None:
        if self.observers:
            tokens = self.path(node)
            event = CacheEvent(kind, tokens, len(tokens) - len(node.key))
            for observer in self.observers:
                observer(event)

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.locked_tokens

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookups -------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int | None = None) -> Match:
        """The longest cached prefix of `tokens[:limit]`. A match that ends inside an edge
        splits it, so that the returned node covers exactly the matched tokens."""
        end = len(tokens) if limit is None else max(min(limit, len(tokens)), 0)
        node, pos, parts = self.root, 0, []
        now = self._tick()
        node.last_access = now
        while pos < end:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.rows)
            node, pos = child, pos + n
        rows = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return Match(pos, rows, node)

    def match_len(self, tokens: list[int], limit: int | None = None) -> int:
        """How many leading tokens of `tokens[:limit]` are cached (no split, no LRU touch, no copy)."""
        return self._walk(tokens, limit)[0]

    def snapshot_len(self, tokens: list[int], limit: int | None = None) -> int:
        """How many leading tokens of `tokens[:limit]` end at a node holding a snapshot, at most (no
        split, no LRU touch)."""
        return self._walk(tokens, limit)[1]

    def _walk(self, tokens: list[int], limit: int | None) -> tuple[int, int]:
        """(cached leading tokens of `tokens[:limit]`, of those the most that end at a node holding a
        snapshot), without splitting or touching anything."""
        end = len(tokens) if limit is None else max(min(limit, len(tokens)), 0)
        node, pos, at_snapshot = self.root, 0, 0
        while pos < end:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos, end)
            pos += n
            if n < len(child.key):
                break
            node = child
            if node.snapshot is not None:
                at_snapshot = pos
        return pos, at_snapshot

    def depth(self, node: Node) -> int:
        """How many tokens lie from the root to the end of `node`."""
        n = 0
        while node is not self.root:
            n += len(node.key)
            node = node.parent  # type: ignore[assignment]
        return n

    def snapshot_node(self, node: Node) -> Node:
        """The deepest node at or above `node` that holds a state snapshot (else the root)."""
        while node is not self.root and node.snapshot is None:
            node = node.parent  # type: ignore[assignment]
        return node

    def _split(self, child: Node, n: int) -> Node:
        """child (key k) -> parent part (k[:n]) above child (k[n:]); returns the parent part."""
        assert child.parent is not None and 0 < n < len(child.key)
        top = Node(child.key[:n], child.rows[:n], child.parent, {}, child.lock_ref, child.last_access)
        child.parent.children[top.key[0]] = top
        child.key, child.rows = child.key[n:], child.rows[n:]
        child.parent = top
        top.children[child.key[0]] = child
        return top

    # ---- insert ---------------------------------------------------------------------
    def insert(self, tokens: list[int], rows: torch.Tensor) -> int:
        """Adopt `rows` (the KV of `tokens`) into the tree. Returns how many leading tokens
        were cached already: the caller's rows for those are duplicates (or the tree's own,
        when they came from a match) and stay the caller's; the tree now owns rows[that:]."""
        assert len(tokens) == rows.numel()
        node, pos = self.root, 0
        now = self._tick()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(list(tokens[pos:]), rows[pos:].clone(), node, {}, 0, now)
                node.children[tokens[pos]] = new
                self.total_tokens += len(new.key)
                self.stats.inserted_tokens += len(new.key)
                self._tell("stored", new)
                return pos
            n = _common_len(child.key, tokens, pos, len(tokens))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    # ---- references -----------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "prefix cache: unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_tokens -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction -------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` rows from unlocked leaves, least recently used first
        (fewer when not enough are evictable). Returns the rows freed."""
        if num_tokens <= 0:
            return 0
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            freed += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _remove_leaf(self, leaf: Node) -> Node:
        """An unlocked leaf goes: its rows (and snapshot) freed; returns its parent."""
        self._tell("removed", leaf)
        self.kv_pool.free(leaf.rows)
        if leaf.snapshot is not None:
            assert self.states is not None
            self.states.discard(leaf.snapshot)
            leaf.snapshot = None
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[0]]
        self.total_tokens -= len(leaf.key)
        self.stats.evicted_tokens += len(leaf.key)
        return parent

    def drop_snapshot(self, node: Node) -> None:
        """Let `node`'s snapshot go; then the unlocked leaves without one that this leaves useless to
        a recurrent model (nothing can be matched up to them) go too, up the path."""
        assert node.snapshot is not None and self.states is not None
        self.states.discard(node.snapshot)
        node.snapshot = None
        while node is not self.root and not node.children and node.lock_ref == 0 and node.snapshot is None:
            node = self._remove_leaf(node)

    def prune(self) -> int:
        """A recurrent model's tree: remove every unlocked leaf without a snapshot, repeatedly (rows
        nothing can be matched up to). Returns the rows freed."""
        freed = 0
        stack = [n for n in self._leaves() if n.lock_ref == 0 and n.snapshot is None]
        while stack:
            leaf = stack.pop()
            freed += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if (
                parent is not self.root
                and not parent.children
                and parent.lock_ref == 0
                and parent.snapshot is None
            ):
                stack.append(parent)
        return freed

    def flush(self) -> int:
        """Evict everything unlocked (with nothing running: the whole tree)."""
        return self.evict(self.evictable_tokens)

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    # ---- checks (tests) -------------------------------------------------------------
    def check(self) -> None:
        """Assert the counters match the tree (tests)."""
        total = locked = snapshots = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert len(node.key) == node.rows.numel() > 0
            if node.snapshot is not None:
                assert (
                    self.states is not None
                    and node.snapshot.node is node
                    and node.snapshot in self.states.held
                )
                snapshots += 1
            assert node.parent is not None and node.parent.children[node.key[0]] is node
            total += len(node.key)
            locked += len(node.key) if node.lock_ref else 0
            stack.extend(node.children.values())
        counted = (self.total_tokens, self.locked_tokens)
        assert (total, locked) == counted, (
            f"tree holds {(total, locked)} (total, locked), counters say {counted}"
        )
        if self.states is not None:
            held = len(self.states.held)
            assert snapshots == held == self.states.count - self.states.free_count, (snapshots, held)
