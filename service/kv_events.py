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

With a load reader (`report_load`, the SMG worker's), every batch also carries the engine's load
(`EngineLoad`: running and waiting requests, queued prompt tokens, KV usage, rate), and each stream
gets a `load_only` batch, numbered like the last batch it got, when that load changed without a KV
event (an admission served from cache, a completion) and at least once a second: the gateway then
routes by the load of the last scheduler step instead of its GetLoads poll (every 10 s by default).
Batches replayed from the history carry no load (theirs is old); the stream's first record does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from smg_grpc_proto.generated import common_pb2

from service.engine.prefix_cache import CacheEvent

log = logging.getLogger("zerogap.kv_events")

BLOCK_SIZE = 16  # tokens per published block (vLLM's default block size)
HISTORY_BATCHES = 4096  # batches kept for subscribers that resume
MAX_BEHIND = 8192  # batches queued for one subscriber before it is cut off (DATA_LOSS)
LOAD_CHECK_S = 0.05  # how often the load is read for load-only batches
LOAD_HEARTBEAT_S = 1.0  # a load-only batch at least this often when nothing else went out
_U32 = 0xFFFFFFFF

# The engine's load now: full=True adds the telemetry beyond the routing core (heartbeat cadence).
LoadReader = Callable[[bool], common_pb2.EngineLoad]


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


class _Stream:
    """One subscription: its queue, the last sequence put on it and the load it was last told."""

    def __init__(self, early_loads: bool):
        self.queue: asyncio.Queue[common_pb2.KvEventBatch | None] = asyncio.Queue()
        self.sequence: int | None = None  # of the last batch put on it; None before the first
        self.early_loads = early_loads  # load-only batches numbered 0 before the first batch
        self.told: tuple[object, ...] | None = None  # the routing part of the last load sent
        self.told_at = 0.0

    def put(self, batch: common_pb2.KvEventBatch) -> None:
        self.queue.put_nowait(batch)
        self.sequence = batch.sequence_number
        if batch.HasField("load"):
            self.told, self.told_at = _routing(batch.load), time.monotonic()


@dataclass(eq=False)
class _SnapshotBuild:
    """The live blocks as of batch `sequence`, being built on a worker thread for each subscriber
    from 0 that asks while that is still the last batch sent (a gateway's replicas reconnecting
    at once share one build); `stop` ends it early when all of them have gone."""

    sequence: int
    load: common_pb2.EngineLoad | None  # read when it started: it goes with the snapshot
    task: asyncio.Future[common_pb2.KvEventBatch | None]
    stop: threading.Event
    waiters: int = 0


def _routing(load: common_pb2.EngineLoad) -> tuple[object, ...]:
    """What a gateway routes by: a change sends a load-only batch (the rate alone does not)."""
    return (
        load.running_requests,
        load.waiting_requests,
        load.waiting_uncached_tokens,
        round(load.token_usage, 2),
        load.max_running_requests,
    )


class KvEventPublisher:
    """The tree's events, numbered and fanned out to subscribers (event loop), fed from the scheduler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, block_size: int = BLOCK_SIZE):
        self.loop = loop
        self.block_size = block_size
        self.sequence = 0  # of the last batch sent
        self.live: dict[int, Block] = {}  # insertion order: parents before children
        self.history: deque[common_pb2.KvEventBatch] = deque(maxlen=HISTORY_BATCHES)
        self._subscribers: set[_Stream] = set()
        self._pending: list[CacheEvent] = []
        self._lock = threading.Lock()  # _pending is shared with the scheduler thread
        self._next_event_id = 0
        self._read_load: LoadReader | None = None
        self._load_sample = 0  # numbers the load records, in the order they are made
        self._ticker: asyncio.Task[None] | None = None
        self._load_failing = False
        self._building: _SnapshotBuild | None = None

    def report_load(self, read: LoadReader) -> None:
        """Attach `read`'s record to every batch and send load-only batches when it changes."""
        self._read_load = read

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
        # with the telemetry when it is some stream's first record (one read for all of them)
        load = self._load(full=any(stream.told is None for stream in self._subscribers))
        if load is not None:
            batch.load.CopyFrom(load)
        self.history.append(batch)
        for stream in list(self._subscribers):
            self._put(stream, batch)

    def _put(self, stream: _Stream, batch: common_pb2.KvEventBatch) -> None:
        if stream.queue.qsize() >= MAX_BEHIND:
            self._subscribers.discard(stream)
            stream.queue.put_nowait(None)  # the subscriber ends with DATA_LOSS
        else:
            stream.put(batch)

    def _load(self, full: bool) -> common_pb2.EngineLoad | None:
        """A new load record (numbered), or None without a reader or when it failed (the batch goes
        without: the KV events matter more)."""
        if self._read_load is None:
            return None
        try:
            load = self._read_load(full)
        except Exception:  # noqa: BLE001 - a stats read must not cost the gateway a KV batch
            if not self._load_failing:  # once until a read works again
                log.exception("reading the engine's load failed; batches go without it meanwhile")
            self._load_failing = True
            return None
        self._load_failing = False
        self._load_sample += 1
        load.sample = self._load_sample
        return load

    async def _tick(self) -> None:
        """While anyone listens: a load-only batch to each stream whose load changed, or went untold
        for a heartbeat, unless batches still wait on it (the next check sends the newest load);
        the load is read once per check."""
        while self._subscribers:
            await asyncio.sleep(LOAD_CHECK_S)
            load, now = None, time.monotonic()
            for stream in list(self._subscribers):
                if stream.sequence is None and not stream.early_loads:
                    continue  # an older gateway takes its first record with the first batch
                if not stream.queue.empty():
                    continue  # coalesced: it has not read what it has yet
                load = load or self._load(full=True)
                if load is None:
                    break
                if _routing(load) == stream.told and now - stream.told_at < LOAD_HEARTBEAT_S:
                    continue
                record = common_pb2.EngineLoad()
                record.CopyFrom(load)
                self._load_sample += 1
                record.sample, record.load_only = self._load_sample, True
                only = common_pb2.KvEventBatch(sequence_number=stream.sequence or 0, timestamp=time.time())
                only.load.CopyFrom(record)
                self._put(stream, only)

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

    def _stored(self, blocks: list[Block], event_id: int | None = None) -> common_pb2.KvCacheEvent:
        """One `stored` event of a chain of blocks (each the previous one's child)."""
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(block_hash=b.hash, token_ids=b.tokens, block_size=self.block_size)
                for b in blocks
            ]
        )
        if blocks[0].parent is not None:
            stored.parent_block_hash = blocks[0].parent
        return common_pb2.KvCacheEvent(
            event_id=self._event_id() if event_id is None else event_id, stored=stored
        )

    def _chains(self) -> list[tuple[int, list[Block]]]:
        """The live blocks as runs of parent-to-child chains (insertion order holds parents before
        children), each with the event id it will be sent under. On the loop: it reads `live`."""
        runs: list[list[Block]] = []
        for b in self.live.values():
            if runs and b.parent == runs[-1][-1].hash:
                runs[-1].append(b)
            else:
                runs.append([b])
        return [(self._event_id(), run) for run in runs]

    def _snapshot(
        self,
        chains: list[tuple[int, list[Block]]],
        sequence: int,
        load: common_pb2.EngineLoad | None,
        stop: threading.Event,
    ) -> common_pb2.KvEventBatch | None:
        """The live blocks (`_chains`) as one batch numbered `sequence`, the last one sent when they
        were taken: cleared, then a `stored` event per chain; `load` with it. Reads nothing the loop
        changes, so it is built on a worker thread: a large cache's blocks take a while (300,000:
        about a second) and the loop serves the replica's streams meanwhile. None once `stop` is
        set (nobody waits for it any more)."""
        events = [common_pb2.KvCacheEvent(event_id=0, cleared=common_pb2.KvCacheCleared())]
        for event_id, run in chains:
            if stop.is_set():
                return None
            events.append(self._stored(run, event_id))
        batch = common_pb2.KvEventBatch(sequence_number=sequence, timestamp=time.time(), events=events)
        if load is not None:
            batch.load.CopyFrom(load)
        return batch

    def _snapshot_build(self, sequence: int) -> _SnapshotBuild:
        """The build under way for `sequence`, or a new one: the chains and the load taken now."""
        build = self._building
        if build is None or build.sequence != sequence:
            load = self._load(full=True) if self._read_load is not None else None
            stop = threading.Event()
            task = asyncio.ensure_future(
                asyncio.to_thread(self._snapshot, self._chains(), sequence, load, stop)
            )
            build = self._building = _SnapshotBuild(sequence, load, task, stop)
            task.add_done_callback(lambda _: self._built(build))
        return build

    def _built(self, build: _SnapshotBuild) -> None:
        """`build` ended: later subscribers start their own; a failure no one waited for is logged."""
        self._forget(build)
        error = None if build.task.cancelled() else build.task.exception()
        if error is not None and not build.waiters:
            log.error("building a KV event snapshot failed", exc_info=error)

    def _forget(self, build: _SnapshotBuild) -> None:
        """`build` is done or abandoned: later subscribers start their own."""
        if self._building is build:
            self._building = None

    async def _wait_for(self, build: _SnapshotBuild) -> common_pb2.KvEventBatch:
        """The snapshot, once built; the last waiter to leave stops the build."""
        build.waiters += 1
        try:
            snapshot = await asyncio.shield(build.task)
        finally:
            build.waiters -= 1
            if not build.waiters and not build.task.done():
                build.stop.set()
                self._forget(build)
        assert snapshot is not None  # stopped only once no one waits
        return snapshot

    async def subscribe(
        self, start_sequence: int, early_loads: bool = False
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches after `start_sequence` (0: the live blocks first), then each new one as it is sent;
        with `early_loads`, load-only batches numbered 0 before the first one. Raises
        Unavailable(OUT_OF_RANGE) when those batches are gone, (DATA_LOSS) when it falls behind."""
        stream = _Stream(early_loads)
        build: _SnapshotBuild | None = None
        first: list[common_pb2.KvEventBatch] = []
        sequence = self.sequence
        if start_sequence == 0:
            if sequence:  # the live blocks first, as of the last batch sent
                build, stream.sequence = self._snapshot_build(sequence), sequence
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
            first = [_carrying(b, None) for b in self.history if b.sequence_number > start_sequence]
            stream.sequence = start_sequence
        if build is not None:
            load = build.load
        else:
            load = self._load(full=True) if self._read_load is not None and first else None
        if first and load is not None:  # the stream's first record: all of it
            first[-1] = _carrying(first[-1], load)
        elif load is not None:  # it goes with the snapshot
            stream.told, stream.told_at = _routing(load), time.monotonic()
        for batch in first:
            stream.put(batch)
        self._subscribers.add(stream)  # no await since the first batches were taken: no gap
        if self._read_load is not None and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        try:
            if build is not None:  # later batches wait in the queue meanwhile
                yield await self._wait_for(build)
            while True:
                batch = await stream.queue.get()
                if batch is None:
                    raise Unavailable("DATA_LOSS", "subscriber fell behind; subscribe again from 0")
                yield batch
        finally:
            self._subscribers.discard(stream)


def _carrying(batch: common_pb2.KvEventBatch, load: common_pb2.EngineLoad | None) -> common_pb2.KvEventBatch:
    """`batch` with `load` in place of its own (None: without one, as a replayed batch goes, its
    load being old); a copy when that changes it: the original may be in the history."""
    if load is None and not batch.HasField("load"):
        return batch
    copy = common_pb2.KvEventBatch()
    copy.CopyFrom(batch)
    if load is None:
        copy.ClearField("load")
    else:
        copy.load.CopyFrom(load)
    return copy
