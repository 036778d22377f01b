"""The KV event stream (service/kv_events.py) replayed as SMG's indexer does equals the replica's tree,
in the gateway's block terms, after a random workload with evictions, retractions and flushes."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from service.config import ServerArgs
from service.engine.prefix_cache import CacheEvent
from service.kv_events import BLOCK_SIZE, block_hash, blocks_of
from service.server import BackgroundServer
from tests.helpers import wait_until


def test_blocks_of_a_node_are_those_ending_inside_it():
    path = tuple(range(100, 140))  # 40 tokens: blocks end at 16 and 32
    first, second = blocks_of(CacheEvent("stored", path, 0))
    assert first.parent is None and first.tokens == path[:16] and first.hash == block_hash(None, path[:16])
    assert second.parent == first.hash and second.tokens == path[16:32]
    assert blocks_of(CacheEvent("stored", path, 16)) == [second]  # the parent block ends where it starts
    assert blocks_of(CacheEvent("stored", path, 15)) == [first, second]
    assert blocks_of(CacheEvent("removed", path, 32)) == []  # a partial block is never published
    other = blocks_of(CacheEvent("stored", (7, *path[1:]), 0))
    assert other[1].tokens == second.tokens and other[1].hash != second.hash  # hashes name the whole prefix


def tree_blocks(paths: list[tuple[int, ...]], block_size: int = BLOCK_SIZE) -> set[tuple[int, ...]]:
    """The full-block prefixes the tree's root-to-leaf paths hold: what the gateway should know."""
    return {path[:end] for path in paths for end in range(block_size, len(path) + 1, block_size)}


def test_the_tree_told_to_a_publisher_is_the_tree_in_block_terms():
    """Random inserts (with splits by matches), evictions and a flush on a bare tree, its observer a
    publisher on an event loop: the published live blocks are always the tree's full-block prefixes."""
    import asyncio

    import torch

    from service.engine.kv_cache import TokenToKVPool
    from service.engine.prefix_cache import RadixCache
    from service.kv_events import KvEventPublisher

    async def run() -> None:
        rng = random.Random(7)
        tree = RadixCache(TokenToKVPool(2048, 1, 1, 2, torch.float32))
        publisher = KvEventPublisher(asyncio.get_running_loop(), block_size=4)
        tree.observers.append(publisher.observe)
        replay = Replay(block_size=4)
        stems = [[rng.randrange(100) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
        for step in range(300):
            op = rng.random()
            if op < 0.6:
                tokens = rng.choice(stems) + [rng.randrange(100) for _ in range(rng.randrange(0, 20))]
                if tree.kv_pool.free_count < len(tokens):
                    tree.evict(len(tokens))
                rows = tree.kv_pool.alloc(len(tokens))
                tree.kv_pool.free(rows[: tree.insert(tokens, rows)])
            elif op < 0.8:
                tree.match(rng.choice(stems) + [rng.randrange(100)])  # may split an edge: no event
            elif op < 0.98:
                tree.evict(rng.randrange(1, 30))
            else:
                tree.flush()
            await asyncio.sleep(0)  # the publisher's batch for this step
            if step % 10 == 0:
                for batch in publisher.history:
                    if batch.sequence_number > replay.last_seq:
                        replay.apply(batch)
                expected = tree_blocks([tree.path(n) for n in tree._leaves()], 4)
                assert replay.orphans == 0 and replay.prefixes() == expected
                assert len(publisher.live) == len(expected)
        tree.check()

    asyncio.run(run())


class Replay:
    """What SMG's positional indexer keeps from a stream: block hash -> the prefix it ends."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.last_seq = 0
        self.orphans = 0  # stored events whose parent was unknown (the indexer would misplace them)

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        if batch.load.load_only:  # a load record between batches: numbered like the last one, no events
            assert batch.sequence_number == self.last_seq and not batch.events
            return
        assert self.last_seq == 0 or batch.sequence_number == self.last_seq + 1, "a gap in the stream"
        self.last_seq = batch.sequence_number
        for e in batch.events:
            kind = e.WhichOneof("data")
            if kind == "cleared":
                self.blocks.clear()
            elif kind == "removed":
                for h in e.removed.block_hashes:
                    assert self.blocks.pop(h, None) is not None, "removed a block never stored"
            else:
                s = e.stored
                prefix: tuple[int, ...] = ()
                if s.HasField("parent_block_hash"):
                    if s.parent_block_hash not in self.blocks:
                        self.orphans += 1
                        continue
                    prefix = self.blocks[s.parent_block_hash]
                for b in s.blocks:
                    assert b.block_size == self.block_size == len(b.token_ids)
                    prefix = prefix + tuple(b.token_ids)
                    self.blocks[b.block_hash] = prefix

    def prefixes(self) -> set[tuple[int, ...]]:
        return set(self.blocks.values())


class Subscriber:
    """SubscribeKvEvents on a thread, replayed as it arrives."""

    def __init__(self, stub, start: int = 0, replay: Replay | None = None):
        self.replay = replay or Replay()
        self.call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.call:
                self.replay.apply(batch)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e

    def stop(self) -> None:
        self.call.cancel()
        self.thread.join(5)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # A pool of 640 rows for 12 requests of up to 160 tokens: the cache evicts and requests are retracted.
    srv = BackgroundServer(
        ServerArgs(
            model=str(tiny_llama_dir), port=0, dtype="float32", kv_cache_tokens=640, max_running_requests=12
        )
    )
    yield srv
    srv.stop()


def leaves(tree) -> list[tuple[int, ...]]:
    return [tree.path(n) for n in tree._leaves()]


def run_round(stub, rng: random.Random, prefixes: list[list[int]], n: int = 12) -> None:
    def one(i: int) -> None:
        ids = rng.choice(prefixes) + [rng.randrange(3, 49000) for _ in range(rng.randrange(3, 30))]
        req = vpb.GenerateRequest(
            request_id=f"r{time.monotonic_ns()}-{i}",
            tokenized=vpb.TokenizedInput(input_ids=ids),
            sampling_params=vpb.SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(40, 80), ignore_eos=True
            ),
            stream=bool(i % 2),
        )
        list(stub.Generate(req, timeout=120))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def wait_caught_up(subs: list[Subscriber], publisher, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.replay.last_seq == publisher.sequence for s in subs):
            return
        time.sleep(0.02)
    raise AssertionError(f"{[s.replay.last_seq for s in subs]} != {publisher.sequence}")


def test_replayed_stream_equals_the_tree_under_evictions_retractions_and_flushes(server):
    rng = random.Random(25)
    prefixes = [[rng.randrange(3, 49000) for _ in range(rng.randrange(20, 50))] for _ in range(3)]
    publisher = server.running.smg_worker.kv_events
    tree = server.engine.scheduler.prefix_cache.tree
    with grpc.insecure_channel(server.address) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        early = Subscriber(stub)  # from the start: every batch
        run_round(stub, rng, prefixes)
        run_round(stub, rng, prefixes)
        late = Subscriber(stub)  # from 0 mid-way: the live blocks first
        wait_caught_up([early, late], publisher)
        resumed = Subscriber(stub, start=early.replay.last_seq, replay=_copy(early.replay))  # a cursor
        assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5)).success
        run_round(stub, rng, prefixes)
        subs = [early, late, resumed]
        wait_caught_up(subs, publisher)
        # the last finishes' inserts may still be on their way: wait until the tree and the streams agree
        wait_until(lambda: all(s.replay.prefixes() == tree_blocks(leaves(tree)) for s in subs), 10)
        expected = tree_blocks(leaves(tree))
        for s in subs:
            s.stop()
            assert s.error is None and s.replay.orphans == 0
            assert s.replay.prefixes() == expected
        with pytest.raises(grpc.RpcError) as e:  # a cursor from before a restart: the gateway resyncs from 0
            next(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9)))
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    stats = server.engine.stats()
    assert stats.retractions > 0 and stats.prefix_cache.evicted_tokens > 0 and expected
    assert len(expected) == len(publisher.live)


def _copy(replay: Replay) -> Replay:
    out = Replay(replay.block_size)
    out.blocks, out.last_seq = dict(replay.blocks), replay.last_seq
    return out


def _loaded_publisher(monkeypatch, read):
    import asyncio

    from service import kv_events
    from service.kv_events import KvEventPublisher

    monkeypatch.setattr(kv_events, "LOAD_CHECK_S", 0.01)
    monkeypatch.setattr(kv_events, "LOAD_HEARTBEAT_S", 1.5)
    publisher = KvEventPublisher(asyncio.get_running_loop(), block_size=4)
    publisher.report_load(read)
    return publisher


async def _collect(gen, out: list, go=None) -> None:
    async for batch in gen:
        out.append(batch)
        if go is not None:
            await go.wait()  # a reader that stalls after its first batch


async def _until(cond, timeout: float = 3.0) -> None:
    import asyncio

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_batches_carry_the_load_and_load_only_batches_follow_its_changes(monkeypatch):
    """With a load reader, every batch carries the load; a change without a KV event, and a heartbeat,
    reach each stream as a load-only batch numbered like its last one; only a gateway that asks gets
    load records before the first batch; a stream's first record and load-only batches carry the
    telemetry, event batches after the first the routing core; replayed batches carry no (old) load
    but the last one."""
    import asyncio

    running = [0]

    def read(full: bool) -> common_pb2.EngineLoad:
        record = common_pb2.EngineLoad(running_requests=running[0], max_running_requests=8)
        if full:
            record.num_used_tokens = 5
        return record

    async def run() -> None:
        publisher = _loaded_publisher(monkeypatch, read)
        early, plain = [], []
        tasks = [
            asyncio.create_task(_collect(publisher.subscribe(0, early_loads=True), early)),
            asyncio.create_task(_collect(publisher.subscribe(0), plain)),
        ]
        await _until(lambda: bool(early))
        assert all(b.load.load_only and b.sequence_number == 0 and not b.events for b in early)
        assert early[0].load.HasField("num_used_tokens")  # load-only records carry the telemetry
        assert plain == []  # an older gateway takes its first record with the first batch
        publisher.observe(CacheEvent("stored", tuple(range(8)), 0))
        await _until(lambda: bool(plain) and early[-1].sequence_number == 1)
        for stream in (early, plain):
            batch = stream[-1]
            assert batch.sequence_number == 1 and batch.events and not batch.load.load_only
        assert plain[-1].load.HasField("num_used_tokens")  # its first record: all of it
        told = len(plain)
        await asyncio.sleep(0.1)
        assert len(plain) == told  # nothing changed, no heartbeat due yet: nothing sent
        running[0] = 2
        await _until(lambda: len(plain) > told and early[-1].load.running_requests == 2)
        for stream in (early, plain):
            batch = stream[-1]
            assert batch.load.load_only and batch.sequence_number == 1 and batch.load.running_requests == 2
        told = len(plain)
        await _until(lambda: len(plain) > told, timeout=5)  # a heartbeat, nothing having changed
        assert plain[-1].load.load_only and plain[-1].load.running_requests == 2
        for stream in (early, plain):
            samples = [b.load.sample for b in stream]
            assert samples == sorted(set(samples))  # monotonic per stream
        publisher.observe(CacheEvent("stored", tuple(range(100, 108)), 0))
        await asyncio.sleep(0)  # one batch per event loop turn
        publisher.observe(CacheEvent("stored", tuple(range(300, 308)), 0))
        await _until(lambda: publisher.sequence == 3 and plain[-1].sequence_number == 3)
        for batch in plain[-2:]:  # told before: event batches carry the routing core only
            assert batch.events and not batch.load.HasField("num_used_tokens")
        resumed: list = []
        tasks.append(asyncio.create_task(_collect(publisher.subscribe(1), resumed)))
        await _until(lambda: len(resumed) >= 2)
        assert [b.sequence_number for b in resumed[:2]] == [2, 3]
        assert not resumed[0].HasField("load")  # replayed: its load is old
        assert resumed[1].load.HasField("num_used_tokens")  # the stream's first record, read now
        assert not publisher.history[-1].load.HasField("num_used_tokens")  # the history's is untouched
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def test_a_subscription_from_zero_gets_the_live_chains_built_off_the_loop(monkeypatch):
    """The live blocks go as one `stored` event per chain, in a batch built on a worker thread (a large
    cache's take a while and the loop serves the replica's streams meanwhile); a batch published while
    it is built follows it, without a gap, and the replay is the cache's blocks."""
    import asyncio

    from service.kv_events import KvEventPublisher

    built_on: list[threading.Thread] = []
    original = KvEventPublisher._snapshot

    def recording(self, *args):
        built_on.append(threading.current_thread())
        time.sleep(0.05)  # a slow build: the loop publishes meanwhile
        return original(self, *args)

    monkeypatch.setattr(KvEventPublisher, "_snapshot", recording)
    paths = [tuple(range(100 * i, 100 * i + 12)) for i in range(1, 4)]  # 3 chains of 3 blocks

    async def run() -> None:
        publisher = _loaded_publisher(monkeypatch, lambda full: common_pb2.EngineLoad(running_requests=1))
        for path in paths:
            publisher.observe(CacheEvent("stored", path, 0))
            await asyncio.sleep(0)
        await _until(lambda: publisher.sequence == 3)
        got: list = []
        task = asyncio.create_task(_collect(publisher.subscribe(0), got))
        await _until(lambda: bool(built_on))
        publisher.observe(CacheEvent("stored", paths[0] + (1, 2, 3, 4), 12))  # while it builds
        await _until(lambda: any(b.sequence_number == 4 for b in got))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert built_on[0] is not threading.main_thread()
        snapshot = got[0]
        assert snapshot.sequence_number == 3 and snapshot.load.running_requests == 1
        stored = [e.stored for e in snapshot.events if e.WhichOneof("data") == "stored"]
        assert [len(s.blocks) for s in stored] == [3, 3, 3]
        replay = Replay(block_size=4)
        for batch in got:
            if not batch.load.load_only:
                replay.apply(batch)
        assert replay.orphans == 0
        assert replay.prefixes() == tree_blocks([paths[0] + (1, 2, 3, 4), *paths[1:]], 4)

    asyncio.run(run())


def test_subscribers_from_zero_at_once_share_one_build_and_the_last_to_leave_stops_it(monkeypatch):
    """Gateways reconnecting at once (subscriptions from 0 while the last batch sent is the same)
    share one snapshot build; one that leaves keeps it going for the others; when the last one
    leaves mid-build the worker thread stops at its next chain, and a later subscriber gets a
    build of its own, whole."""
    import asyncio

    from service.kv_events import KvEventPublisher

    release = threading.Event()
    entered: list[int] = []
    results: list = []
    original = KvEventPublisher._snapshot

    def held(self, chains, sequence, load, stop):
        entered.append(sequence)
        release.wait(5)  # a build that takes a while: subscribers come and go meanwhile
        result = original(self, chains, sequence, load, stop)
        results.append(result)
        return result

    monkeypatch.setattr(KvEventPublisher, "_snapshot", held)
    paths = [tuple(range(100 * i, 100 * i + 8)) for i in range(1, 4)]

    async def run() -> None:
        publisher = _loaded_publisher(monkeypatch, lambda full: common_pb2.EngineLoad(running_requests=2))
        for path in paths:
            publisher.observe(CacheEvent("stored", path, 0))
            await asyncio.sleep(0)
        await _until(lambda: publisher.sequence == 3)
        got = [[], [], []]
        tasks = [asyncio.create_task(_collect(publisher.subscribe(0), got[i])) for i in range(3)]
        await _until(lambda: len(entered) == 1)
        await asyncio.sleep(0.02)  # all three are waiting on it now
        tasks[2].cancel()  # one leaves: the others still wait for the same build
        await asyncio.gather(tasks[2], return_exceptions=True)
        release.set()
        await _until(lambda: bool(got[0]) and bool(got[1]))
        assert entered == [3] and len(results) == 1  # one build for all of them
        assert got[0][0] is got[1][0] and got[0][0].load.running_requests == 2
        assert [len(e.stored.blocks) for e in got[0][0].events[1:]] == [2, 2, 2]
        for t in tasks[:2]:
            t.cancel()
        await asyncio.gather(*tasks[:2], return_exceptions=True)

        # The last subscriber leaves mid-build: the thread gives up, the next one builds anew.
        release.clear()
        publisher.observe(CacheEvent("stored", paths[0] + (1, 2, 3, 4), 8))
        await _until(lambda: publisher.sequence == 4)
        gone: list = []
        task = asyncio.create_task(_collect(publisher.subscribe(0), gone))
        await _until(lambda: len(entered) == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        release.set()
        await _until(lambda: len(results) == 2)
        assert results[1] is None and not gone  # stopped at its first chain
        again: list = []
        task = asyncio.create_task(_collect(publisher.subscribe(0), again))
        await _until(lambda: bool(again))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert entered == [3, 4, 4]
        replay = Replay(block_size=4)
        replay.apply(again[0])
        assert replay.prefixes() == tree_blocks([paths[0] + (1, 2, 3, 4), *paths[1:]], 4)

    asyncio.run(run())


def test_a_failing_load_read_costs_no_batch_and_a_slow_reader_no_pile_of_loads(monkeypatch):
    """A load read that raises: the batch goes out without a load, in sequence, and the checks go on
    once reads work again. A reader that stalls gets no load-only batches queued behind the ones it
    has not read (the next check after it catches up sends the newest load)."""
    import asyncio

    running, broken = [0], [True]

    def read(full: bool) -> common_pb2.EngineLoad:
        if broken[0]:
            raise RuntimeError("stats read failed")
        return common_pb2.EngineLoad(running_requests=running[0])

    async def run() -> None:
        publisher = _loaded_publisher(monkeypatch, read)
        got, stalled = [], []
        go = asyncio.Event()
        tasks = [
            asyncio.create_task(_collect(publisher.subscribe(0), got)),
            asyncio.create_task(_collect(publisher.subscribe(0), stalled, go)),
        ]
        await asyncio.sleep(0.02)
        publisher.observe(CacheEvent("stored", tuple(range(8)), 0))
        await _until(lambda: bool(got) and bool(stalled))
        assert got[0].sequence_number == 1 and got[0].events and not got[0].HasField("load")
        broken[0] = False
        await _until(lambda: got[-1].load.load_only)  # the checks went on
        for _ in range(20):  # the load changes every check; the stalled reader reads none of it
            running[0] += 1
            publisher.observe(CacheEvent("stored", tuple(range(20 * running[0], 20 * running[0] + 8)), 0))
            await asyncio.sleep(0.015)
        (slow,) = [st for st in publisher._subscribers if st.queue.qsize() > 0]
        waiting = list(slow.queue._queue)
        assert (
            len(waiting) > 10 and sum(b.load.load_only for b in waiting) <= 1
        )  # the one sent ere it stalled
        go.set()
        await _until(lambda: stalled[-1].load.running_requests == running[0])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def test_the_load_reaches_a_subscriber_while_a_request_runs(server):
    """Through the RPC: records before the first batch when asked, a running request within a
    scheduler step or two, and back to idle when it ends (what SMG routes by between its polls)."""
    call = None
    with grpc.insecure_channel(server.address) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        call = stub.SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=0, load_records_before_first_batch=True)
        )
        loads: list[common_pb2.EngineLoad] = []

        def read() -> None:
            try:
                for batch in call:
                    if batch.HasField("load"):
                        loads.append(batch.load)
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert wait_until(lambda: bool(loads), 5)
        req = vpb.GenerateRequest(
            request_id="load-watch",
            tokenized=vpb.TokenizedInput(input_ids=list(range(300, 340))),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True),
            stream=True,
        )
        stream = stub.Generate(req, timeout=120)
        next(stream)
        # (a record read while the scheduler thread is part-way through a step may be off; the next
        # one, 50 ms on, is not)
        assert wait_until(lambda: loads[-1].running_requests == 1 and loads[-1].token_usage > 0, 5)
        assert loads[-1].max_running_requests == 12
        list(stream)
        assert wait_until(lambda: loads[-1].running_requests == 0 and loads[-1].waiting_requests == 0, 5)
        samples = [r.sample for r in loads]
        assert samples == sorted(set(samples))
        call.cancel()
        reader.join(5)
