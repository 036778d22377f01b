"""The prefix cache's changes as SMG's KV events, in the gateway's block terms.

The gateway (SMG, `SubscribeKvEvents` of smg-grpc-proto's `smg.grpc.common`) indexes what each
worker holds as chains of fixed-size blocks: block k of a sequence is its tokens
[k*B, (k+1)*B), named by a hash of the whole prefix up to its end (`block_hash`) and linked to
block k-1 (`parent_block_hash`); it hashes each block's `token_ids` itself and matches a request's
full blocks position by position. The radix tree (service/engine/prefix_cache.py) holds token
runs of any length, so the projection is: the worker holds block k of a path exactly when the tree
holds the path's first (k+1)*B tokens. A node added under a parent path of length d, ending at n,
adds the blocks that end in (d, n]; a leaf evicted removes the same blocks: no other node covers a
prefix longer than d of that path. Partial blocks are never published (the gateway ignores them).

`KvEventPublisher` hears the tree on the scheduler thread (an observer: it only queues the
event), and turns the queue into one numbered `KvEventBatch` per turn of the event loop. It keeps
the live blocks (a subscriber starting at 0 gets them first, after a `cleared`) and a bounded
history (a subscriber resuming at sequence s gets the batches after s; one whose cursor the
history no longer reaches, or one from before a restart, gets OUT_OF_RANGE, and the gateway then
clears this worker and subscribes from 0). A subscriber that falls far behind gets DATA_LOSS, with
the same recovery.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from smg_grpc_proto.generated import common_pb2

from service.engine.prefix_cache import CacheEvent

BLOCK_SIZE = 16  # tokens per published block (vLLM's default block size)
HISTORY_BATCHES = 4096  # batches kept for subscribers that resume
MAX_BEHIND = 8192  # batches queued for one subscriber before it is cut off (DATA_LOSS)
_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Block:
    """One published block: its hash, its parent's (None at position 0) and its tokens."""

    hash: int
    parent: int | None
    tokens: tuple[int, ...]


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """A signed int64 naming the prefix that ends with `tokens` after the block `parent`."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"-" if parent is None else parent.to_bytes(8, "little", signed=True))
    h.update(b"".join((t & _U32).to_bytes(4, "little") for t in tokens))
    return int.from_bytes(h.digest(), "little", signed=True)


def blocks_of(event: CacheEvent, block_size: int = BLOCK_SIZE) -> list[Block]:
    """The blocks the event adds or removes: those of its path that end after `event.start`."""
    tokens, out, parent = event.tokens, [], None
    for k in range(len(tokens) // block_size):
        chunk = tuple(t & _U32 for t in tokens[k * block_size : (k + 1) * block_size])
        h = block_hash(parent, chunk)
        if (k + 1) * block_size > event.start:
            out.append(Block(h, parent, chunk))
        parent = h
    return out


class Unavailable(Exception):
    """A subscription that cannot be served: (gRPC status code name, message)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class KvEventPublisher:
    """The tree's events, numbered and fanned out to subscribers (event loop), fed from the scheduler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, block_size: int = BLOCK_SIZE):
        self.loop = loop
        self.block_size = block_size
        self.sequence = 0  # of the last batch sent
        self.live: dict[int, Block] = {}  # insertion order: parents before children
        self.history: deque[common_pb2.KvEventBatch] = deque(maxlen=HISTORY_BATCHES)
        self._subscribers: set[asyncio.Queue[common_pb2.KvEventBatch | None]] = set()
        self._pending: list[CacheEvent] = []
        self._lock = threading.Lock()  # _pending is shared with the scheduler thread
        self._next_event_id = 0

    # ---- scheduler thread ----------------------------------------------------------
    def observe(self, event: CacheEvent) -> None:
        """A prefix cache observer: queue the event; the event loop publishes it."""
        with self._lock:
            first = not self._pending
            self._pending.append(event)
        if first:
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed (shutting down): nobody is listening any more
                pass

    # ---- event loop ----------------------------------------------------------------
    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        events = [e for event in pending for e in self._convert(event)]
        if not events:
            return
        self.sequence += 1
        batch = common_pb2.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(), events=events)
        self.history.append(batch)
        for queue in list(self._subscribers):
            if queue.qsize() >= MAX_BEHIND:
                self._subscribers.discard(queue)
                queue.put_nowait(None)  # the subscriber ends with DATA_LOSS
            else:
                queue.put_nowait(batch)

    def _event_id(self) -> int:
        self._next_event_id += 1
        return self._next_event_id

    def _convert(self, event: CacheEvent) -> list[common_pb2.KvCacheEvent]:
        blocks = blocks_of(event, self.block_size)
        if event.kind == "stored":
            new = [b for b in blocks if b.hash not in self.live]
            if not new:
                return []
            for b in new:
                self.live[b.hash] = b
            return [self._stored(new)]
        gone = [b.hash for b in blocks if self.live.pop(b.hash, None) is not None]
        if not gone:
            return []
        return [
            common_pb2.KvCacheEvent(
                event_id=self._event_id(), removed=common_pb2.KvBlocksRemoved(block_hashes=gone)
            )
        ]

    def _stored(self, blocks: list[Block]) -> common_pb2.KvCacheEvent:
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(block_hash=b.hash, token_ids=b.tokens, block_size=self.block_size)
                for b in blocks
            ]
        )
        if blocks[0].parent is not None:
            stored.parent_block_hash = blocks[0].parent
        return common_pb2.KvCacheEvent(event_id=self._event_id(), stored=stored)

    def _snapshot(self) -> common_pb2.KvEventBatch:
        """The live blocks as one batch numbered like the last one sent: cleared, then every block."""
        events = [common_pb2.KvCacheEvent(event_id=0, cleared=common_pb2.KvCacheCleared())]
        events += [self._stored([b]) for b in self.live.values()]
        return common_pb2.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(), events=events)

    async def subscribe(self, start_sequence: int) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches after `start_sequence` (0: the live blocks first), then each new one as it is sent.
        Raises Unavailable(OUT_OF_RANGE) when those batches are gone, (DATA_LOSS) when it falls behind."""
        queue: asyncio.Queue[common_pb2.KvEventBatch | None] = asyncio.Queue()
        if start_sequence == 0:
            first = [self._snapshot()] if self.sequence else []
        elif start_sequence > self.sequence:
            raise Unavailable(
                "OUT_OF_RANGE",
                f"sequence {start_sequence} is ahead of this worker's {self.sequence} (it restarted)",
            )
        elif start_sequence < self.sequence and (
            not self.history or self.history[0].sequence_number > start_sequence + 1
        ):
            raise Unavailable("OUT_OF_RANGE", f"sequence {start_sequence} is older than the history kept")
        else:
            first = [b for b in self.history if b.sequence_number > start_sequence]
        self._subscribers.add(queue)  # no await since the first batches were taken: no gap
        try:
            for batch in first:
                yield batch
            while True:
                batch = await queue.get()
                if batch is None:
                    raise Unavailable("DATA_LOSS", "subscriber fell behind; subscribe again from 0")
                yield batch
        finally:
            self._subscribers.discard(queue)
