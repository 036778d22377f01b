"""The prefix cache: the radix tree itself, then outputs with the cache on equal outputs with it
off (greedy and seeded, both loops, fp32), hit counts, eviction, aborts and the pool accounting."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from service.config import ServerArgs
from service.core.forward_batch import ForwardMode
from service.core.request import FinishReason, SamplingParams
from service.engine.engine import SyncClient, collect
from service.engine.kv_cache import TokenToKVPool
from service.engine.prefix_cache import RadixCache
from tests.helpers import before_each_forward, wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

T = TypeVar("T")

LOOPS = ["normal", "overlap"]


# ---- the tree alone --------------------------------------------------------------------------------
def _pool(n: int = 64) -> TokenToKVPool:
    return TokenToKVPool(n, 1, 1, 2, torch.float32)


def _insert(tree: RadixCache, tokens: list[int]) -> torch.Tensor:
    rows = tree.kv_pool.alloc(len(tokens))
    cached = tree.insert(tokens, rows)
    tree.kv_pool.free(rows[:cached])  # what the tree had already stays the caller's
    return rows


def test_tree_match_split_insert_and_counts():
    tree = RadixCache(_pool())
    a = _insert(tree, [1, 2, 3, 4, 5])
    assert tree.match_len([1, 2, 3, 9]) == 3
    m = tree.match([1, 2, 3, 9])  # ends inside the edge: split
    assert m.length == 3 and m.rows.tolist() == a[:3].tolist() and m.node.key == [1, 2, 3]
    b = _insert(tree, [1, 2, 3, 7, 8])
    assert (
        tree.total_tokens == 7
        and tree.match([1, 2, 3, 7, 8]).rows.tolist() == a[:3].tolist() + b[3:].tolist()
    )
    assert tree.match([1, 2, 3, 4, 5], limit=4).length == 4
    tree.check()
    assert tree.kv_pool.free_count == 64 - 7


def test_tree_locks_protect_and_eviction_is_lru_leaves_first():
    tree = RadixCache(_pool())
    _insert(tree, [1, 2, 3, 4])
    _insert(tree, [1, 2, 9, 9])
    _insert(tree, [5, 6])
    tree.match([5, 6])  # most recently used
    locked = tree.match([1, 2, 3, 4]).node
    tree.lock(locked)
    assert tree.locked_tokens == 4 and tree.evictable_tokens == 4
    assert tree.evict(1) == 2  # the least recently used unlocked leaf: [9, 9]
    assert tree.match_len([1, 2, 9, 9]) == 2 and tree.match_len([5, 6]) == 2
    assert tree.evict(100) == 2  # [5, 6]; the locked path stays
    assert tree.match_len([1, 2, 3, 4]) == 4
    tree.unlock(locked)
    assert tree.flush() == 4 and tree.total_tokens == 0
    assert tree.kv_pool.free_count == tree.kv_pool.size
    tree.check()


# ---- through the engine ----------------------------------------------------------------------------
def _client(model_dir, loop: str, cache: bool, **kw) -> SyncClient:
    args = dict(
        dtype="float32",
        loop=loop,
        kv_cache_tokens=4096,
        max_running_requests=16,
        disable_prefix_cache=not cache,
    )
    return SyncClient(ServerArgs(**{**args, **kw}), model_dir)


def _off_and_on(model_dir, loop: str, run: Callable[[SyncClient], T], **kw) -> dict[bool, T]:
    """run(client) on an engine without the cache, then on one with it: {cache: result}."""
    results = {}
    for cache in (False, True):
        client = _client(model_dir, loop, cache, **kw)
        try:
            results[cache] = run(client)
        finally:
            client.close()
    return results


def _params(i: int, n: int = 8) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_k=50, seed=1000 + i, max_new_tokens=n, ignore_eos=True)
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def _run_waves(client: SyncClient, waves: list[list[tuple[list[int], SamplingParams]]]):
    """Each wave submitted together, after the previous one finished: (ids, final output) per request."""
    out = []
    for wave in waves:
        for ids_outs in client.generate([p for p, _ in wave], [sp for _, sp in wave]):
            ids, _, last = collect(ids_outs)
            out.append((ids, last))
    return out


def _shared_prefix_waves(rng: random.Random) -> list[list[tuple[list[int], SamplingParams]]]:
    system = [rng.randrange(3, 49000) for _ in range(40)]
    first = [(system + [rng.randrange(3, 49000) for _ in range(5)], _params(0))]
    rest = [
        (system + [rng.randrange(3, 49000) for _ in range(rng.randrange(1, 12))], _params(i))
        for i in range(1, 7)
    ]
    unrelated = [
        ([rng.randrange(3, 49000) for _ in range(rng.randrange(3, 30))], _params(i)) for i in range(3)
    ]
    return [first, rest + unrelated]


def _multi_turn(client: SyncClient, rng: random.Random, convs: int = 3, turns: int = 3):
    """Conversations whose turns resend the whole history: (ids, final output, previous history length)."""
    histories = [[rng.randrange(3, 49000) for _ in range(rng.randrange(10, 20))] for _ in range(convs)]
    out = []
    for t in range(turns):
        prompts = [h + [rng.randrange(3, 49000) for _ in range(4)] for h in histories]
        results = client.generate(prompts, [_params(c + t) for c in range(convs)])
        for c, res in enumerate(results):
            ids, _, last = collect(res)
            out.append((ids, last, len(histories[c]) if t else 0))
            histories[c] = prompts[c] + ids
    return out


@pytest.mark.parametrize("loop", LOOPS)
def test_outputs_equal_with_and_without_cache(tiny_llama_dir, loop):
    def run(client):
        shared = _run_waves(client, _shared_prefix_waves(random.Random(1)))
        turns = _multi_turn(client, random.Random(2))
        assert client.engine.kv_all_free()
        assert client.engine.scheduler.reserved_tokens == 0
        return shared, turns, client.engine.stats().prefix_cache

    results = _off_and_on(tiny_llama_dir, loop, run)
    (shared_off, turns_off, info_off), (shared_on, turns_on, info_on) = results[False], results[True]
    assert [ids for ids, _ in shared_on] == [ids for ids, _ in shared_off]
    assert [ids for ids, _, _ in turns_on] == [ids for ids, _, _ in turns_off]
    assert not info_off.enabled and all(last.cached_tokens == 0 for _, last in shared_off)
    # Hits: the shared system prompt (40 tokens) for the second wave's 6 sharing requests ...
    hits = [last.cached_tokens for _, last in shared_on]
    assert hits[0] == 0 and all(h >= 40 for h in hits[1:7]) and hits[7:] == [0, 0, 0]
    # ... and in each later turn the whole previous history but the last output token's KV.
    for _, last, prev in turns_on:
        assert last.cached_tokens == max(prev - 1, 0)
    assert info_on.enabled and info_on.hit_tokens == sum(hits) + sum(
        last.cached_tokens for _, last, _ in turns_on
    )
    assert 0 < info_on.hit_rate < 1 and info_on.hit_requests == 6 + 6


def test_concurrent_sharers_hit_the_first_ones_prefill(tiny_llama_dir):
    """Requests arriving together with a shared prompt: one prefills it, the others wait one step and reuse it."""
    rng = random.Random(3)
    system = [rng.randrange(3, 49000) for _ in range(48)]
    prompts = [system + [rng.randrange(3, 49000) for _ in range(3)] for _ in range(6)]

    def run(client):
        res = client.generate(prompts, [_params(i) for i in range(6)])
        assert client.engine.kv_all_free()
        return [collect(r)[0] for r in res], sorted(collect(r)[2].cached_tokens for r in res)

    outs = _off_and_on(tiny_llama_dir, "overlap", run)
    assert outs[True][0] == outs[False][0]
    assert outs[True][1] == [0] + [48] * 5


@pytest.mark.parametrize("loop", LOOPS)
def test_concurrent_sharers_of_a_chunked_prompt_wait_for_all_of_it(tiny_llama_dir, loop):
    """A shared prompt longer than a chunk: one request prefills it chunk by chunk and the others
    wait for the whole of it, rather than going ahead after its first chunk (n samples of one prompt
    cost one prefill)."""
    rng = random.Random(4)
    system = [rng.randrange(3, 49000) for _ in range(100)]
    prompts = [system + [rng.randrange(3, 49000) for _ in range(3)] for _ in range(4)]

    def run(client):
        res = client.generate(prompts, [_params(i) for i in range(4)])
        assert client.engine.kv_all_free()
        return [collect(r)[0] for r in res], sorted(collect(r)[2].cached_tokens for r in res)

    outs = _off_and_on(tiny_llama_dir, loop, run, chunked_prefill_size=32)
    assert outs[True][0] == outs[False][0]
    assert outs[True][1] == [0] + [100] * 3


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failed_final_chunk_leaves_its_prompt_out_of_the_cache(tiny_llama_dir, loop):
    """The overlap loop processes a chunk's result while the prompt's final chunk is in flight. The
    tree took the whole prompt's rows then; when that final chunk failed, its rows stayed in the
    cache unwritten and the next request with the prompt read them (its output differed)."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49000) for _ in range(100)]

    def fail_final_chunk(fb) -> None:
        if fb.mode is ForwardMode.EXTEND and int(fb.positions.max()) == len(prompt) - 1:
            raise RuntimeError("injected fault")

    def run(client):
        with before_each_forward(client.engine.worker, fail_final_chunk):
            (failed,) = client.generate([prompt], [_params(0)])
        assert failed[-1].finish_reason is FinishReason.ERROR
        (again,) = client.generate([prompt], [_params(0)])
        assert client.engine.kv_all_free()
        return collect(again)[0], collect(again)[2].cached_tokens

    outs = _off_and_on(tiny_llama_dir, loop, run, chunked_prefill_size=32)
    assert outs[True] == outs[False] and outs[True][1] == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_a_short_prompt_does_not_wait_for_a_long_one_that_shares_little(tiny_llama_dir, loop):
    """A long prompt in chunks shares a 40-token system prompt with a short one: the short one computes
    those 40 tokens itself rather than waiting for all of the long prefill (when the tree gets it)."""
    rng = random.Random(5)
    system = [rng.randrange(3, 49000) for _ in range(40)]
    long = system + [rng.randrange(3, 49000) for _ in range(400)]
    short = system + [rng.randrange(3, 49000) for _ in range(3)]

    def run(client):
        res = client.generate([long, short], [_params(0, 4), _params(1, 4)])
        return [collect(r)[2].cached_tokens for r in res]

    assert _off_and_on(tiny_llama_dir, loop, run, chunked_prefill_size=64)[True] == [0, 0]


@pytest.mark.parametrize("loop", LOOPS)
def test_eviction_under_a_tiny_pool_while_requests_run(tiny_llama_dir, loop):
    rng = random.Random(4)
    prefixes = [[rng.randrange(3, 49000) for _ in range(60)] for _ in range(6)]
    waves = [
        [
            (p + [rng.randrange(3, 49000) for _ in range(4)], _params(i, 12))
            for i, p in enumerate(prefixes[k : k + 2])
        ]
        for k in range(0, 6, 2)
    ]
    waves.append([(prefixes[0] + [7, 8], _params(0, 12)), (prefixes[5] + [9], _params(1, 12))])

    def run(client):
        out = [ids for ids, _ in _run_waves(client, waves)]
        # All at once: two run, and each admission evicts what finished ones left while the other runs.
        out += [ids for ids, _ in _run_waves(client, [[r for w in waves for r in w]])]
        info = client.engine.stats().prefix_cache
        tree = client.engine.scheduler.prefix_cache
        if tree.enabled:
            tree.tree.check()
            assert info.evicted_tokens > 0 and info.cached_tokens <= 200
        assert client.engine.kv_all_free()
        return out

    results = _off_and_on(tiny_llama_dir, loop, run, kv_cache_tokens=200, max_running_requests=4)
    assert results[True] == results[False]


@pytest.mark.parametrize("loop", LOOPS)
def test_abort_of_a_request_whose_prefix_running_ones_share(tiny_llama_dir, loop):
    rng = random.Random(5)
    base = [rng.randrange(3, 49000) for _ in range(50)]
    long = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    sharers = [base + [rng.randrange(3, 49000) for _ in range(3)] for _ in range(3)]
    want = {}
    ref = _client(tiny_llama_dir, loop, False)
    try:
        for i, p in enumerate(sharers):
            want[i] = collect(
                ref.generate([p], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))[0]
            )[0]
    finally:
        ref.close()
    client = _client(tiny_llama_dir, loop, True)
    try:
        e = client.engine
        client.submit("owner", base + [11, 12], long)  # its prompt is adopted by the cache after its prefill
        assert wait_until(lambda: len(client._outputs.get("owner", [])) >= 2, 60, 0.005)
        for i, p in enumerate(sharers):
            client.submit(f"s{i}", p, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
        assert wait_until(
            lambda: all(len(client._outputs.get(f"s{i}", [])) >= 1 for i in range(3)), 60, 0.005
        )
        e.abort("owner")
        e.abort("s0")
        assert collect(client.wait("owner"))[2].finish_reason is FinishReason.ABORT
        assert collect(client.wait("s0"))[2].finish_reason is FinishReason.ABORT
        for i in (1, 2):
            ids, _, last = collect(client.wait(f"s{i}"))
            assert ids == want[i] and last.cached_tokens >= 50
        e.scheduler.prefix_cache.tree.check()
        assert wait_until(lambda: e.num_live() == 0, 10)
        assert e.scheduler.prefix_cache.tree.locked_tokens == 0 and e.scheduler.reserved_tokens == 0
        assert e.kv_all_free()
    finally:
        client.close()


def test_input_logprobs_never_come_from_the_cache(tiny_llama_dir):
    """Input logprobs from position s need the logits at s - 1: at most s - 1 tokens are reused."""
    rng = random.Random(6)
    prompt = [rng.randrange(3, 49000) for _ in range(30)]
    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    lp = {"logprobs": dict(return_logprob=True, logprob_start_len=10)}

    def run(client):
        client.generate([prompt], greedy)  # cache the prompt
        return client.generate([prompt], greedy, [lp])[0]

    got = _off_and_on(tiny_llama_dir, "overlap", run)
    on, off = got[True], got[False]
    assert collect(on)[2].cached_tokens == 9 and collect(off)[2].cached_tokens == 0
    first_on = next(o.extras["logprobs"] for o in on if "logprobs" in o.extras and o.extras["logprobs"].input)
    first_off = next(
        o.extras["logprobs"] for o in off if "logprobs" in o.extras and o.extras["logprobs"].input
    )
    assert first_on.input_start == first_off.input_start == 10
    assert [e[0] for e in first_on.input] == [e[0] for e in first_off.input]
    for a, b in zip(first_on.input, first_off.input):
        assert abs(a[1] - b[1]) < 1e-3
    assert collect(on)[0] == collect(off)[0]


def test_grpc_usage_server_info_and_disable_flag(smol_dir):
    from service.gateway.protocol import usage as gateway_usage
    from service.server import BackgroundServer
    from zerogap.client.types import Completion

    chat = pb2.ChatInput(
        messages=[
            pb2.ChatMessage(role="system", content="You are a terse assistant. Answer in one word."),
            pb2.ChatMessage(role="user", content="Capital of France?"),
        ]
    )
    req = pb2.GenerateRequest(chat=chat, sampling=pb2.SamplingParams(max_new_tokens=6, temperature=0))
    texts = {}
    for disabled in (False, True):
        import grpc

        srv = BackgroundServer(
            ServerArgs(
                model=str(smol_dir),
                port=0,
                dtype="float32",
                disable_prefix_cache=disabled,
                kv_cache_tokens=4096,
                max_running_requests=8,
            )
        )
        try:
            with grpc.insecure_channel(srv.address) as ch:
                stub = pb2_grpc.GenerationStub(ch)
                first, second = stub.Generate(req), stub.Generate(req)
                texts[disabled] = (first.token_ids, second.token_ids)
                info = stub.GetServerInfo(pb2.GetServerInfoRequest())
                assert first.usage.cached_tokens == 0
                if disabled:
                    assert second.usage.cached_tokens == 0 and not info.prefix_cache_enabled
                    assert info.prefix_cache_tokens == 0
                else:
                    assert second.usage.cached_tokens == second.usage.prompt_tokens - 1
                    assert info.prefix_cache_enabled and info.prefix_cache_tokens > 0
                    assert info.prefix_cache_hit_tokens == second.usage.cached_tokens
                    assert info.prefix_cache_hit_rate == pytest.approx(
                        second.usage.cached_tokens / (2 * second.usage.prompt_tokens)
                    )
                    # The client library and the OpenAI gateway's usage carry it too.
                    assert Completion.from_proto(second).cached_tokens == second.usage.cached_tokens
                    body = gateway_usage(
                        second.usage.prompt_tokens, 0, Completion.from_proto(second).cached_tokens
                    )
                    assert body["prompt_tokens_details"]["cached_tokens"] == second.usage.cached_tokens
                # Idle: every row is free or held only by the cache (evictable).
                assert info.kv_pool_free_tokens == info.kv_pool_total_tokens
            assert srv.engine.kv_all_free()
        finally:
            srv.stop()
    assert texts[False] == texts[True] and texts[True][0] == texts[True][1]


def test_flush_while_requests_run_keeps_their_prefixes(tiny_llama_dir):
    client = _client(tiny_llama_dir, "overlap", True)
    try:
        e = client.engine
        prompt = list(range(100, 160))
        client.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4))
        client.submit("r", prompt + [5], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
        assert wait_until(lambda: len(client._outputs.get("r", [])) >= 1, 60, 0.005)
        e.flush_prefix_cache()  # the running request's path is locked: it stays
        assert e.scheduler.prefix_cache.tree.locked_tokens > 0
        done = threading.Event()
        threading.Thread(target=lambda: (client.wait("r"), done.set())).start()
        assert done.wait(120)
        assert e.kv_all_free()
    finally:
        client.close()


def test_constrained_requests_hit_and_equal(tiny_llama_dir):
    """A grammar constrains output tokens only: a cache hit changes nothing."""
    rng = random.Random(7)
    prompt = [rng.randrange(3, 49000) for _ in range(40)]
    feats = [{"constrained": dict(kind="regex", text=r"[a-z]{2,6}( [0-9]+)?")}]
    sp = SamplingParams(temperature=0.8, seed=3, max_new_tokens=12)

    def run(client):
        first = collect(client.generate([prompt], sp, feats)[0])
        second = collect(client.generate([prompt], sp, feats)[0])
        assert client.engine.kv_all_free()
        assert first[0] == second[0] and first[2].extras["constrained"].satisfied
        return first[0], second[2].cached_tokens

    got = _off_and_on(tiny_llama_dir, "overlap", run)
    assert got[True][0] == got[False][0] and got[True][1] == len(prompt) - 1 and got[False][1] == 0
