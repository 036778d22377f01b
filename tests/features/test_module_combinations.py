"""The scheduler-level modules together: prefix cache, chunked prefill (+ mixed batches), multimodal
input and retraction, in pairs, against runs without them (fp32: exact). Each module's own file tests
it alone; this one tests what only shows when two meet (a cached prefix then chunks, image spans in
the cache, a retracted request re-prefilled on top of a cached prefix ...)."""

from __future__ import annotations

import pytest

from service.config import ServerArgs
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from tests.features.test_multimodal import IMAGES, mm

LOOPS = ["normal", "overlap"]


def _client(model_dir, loop: str, **kw) -> SyncClient:
    args = dict(dtype="float32", loop=loop, kv_cache_tokens=4096, max_running_requests=8)
    return SyncClient(ServerArgs(**{**args, **kw}), model_dir)


def _params(i: int, n: int = 8) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_k=50, seed=500 + i, max_new_tokens=n, ignore_eos=True)
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def _run(client: SyncClient, waves, feats=None):
    """Waves of requests, each wave submitted together after the previous one finished: outputs in order."""
    out = []
    k = 0
    for wave in waves:
        reqs = []
        for prompt, params in wave:
            f = feats[k] if feats else None
            reqs.append(client.engine.build_request(f"q{k}", prompt, params, f))
            k += 1
        client.engine.submit_all(reqs)
        out += [collect(client.wait(r.rid)) for r in reqs]
    return out


def _shared_prefix_waves():
    system = [1] + list(range(300, 340))  # a 41-token "system prompt"
    first = [(system + [400 + i] * (3 + i), _params(i)) for i in range(4)]
    second = [(system + [500 + i] * (2 + 3 * i) + [7, 8, 9], _params(i, 10)) for i in range(4)]
    return [first, second]


@pytest.mark.parametrize("loop", LOOPS)
def test_prefix_cache_with_chunked_prefill_and_mixed_batches(tiny_llama_dir, loop):
    """Cached prefixes, then the rest of each prompt in chunks of 7 riding with decodes: same tokens
    as no cache and no chunks; the second wave hits the cache."""
    waves = _shared_prefix_waves()
    ref = _client(tiny_llama_dir, loop, disable_prefix_cache=True)
    try:
        want = [ids for ids, _, _ in _run(ref, waves)]
    finally:
        ref.close()
    c = _client(tiny_llama_dir, loop, chunked_prefill_size=7, enable_mixed_chunk=True)
    try:
        got = _run(c, waves)
        assert [ids for ids, _, _ in got] == want
        assert all(
            last.cached_tokens >= 41 for _, _, last in got[4:]
        )  # the system prompt came from the cache
        assert c.engine.kv_all_free()
    finally:
        c.close()


def test_prefix_cache_keys_image_spans_by_the_image(tiny_llava_dir):
    """Same text, different images: no hit across the image span; the same image again: a hit past it.
    Outputs equal a run without the cache."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    prompt = tok.encode("Look at this picture: <image> and tell me what it shows, please")
    start = prompt.index(tok.convert_tokens_to_ids("<image>"))
    waves = [[(prompt, _params(0))], [(prompt, _params(0))], [(prompt, _params(0))]]
    feats = [mm(IMAGES[0]), mm(IMAGES[1]), mm(IMAGES[0])]
    ref = _client(tiny_llava_dir, "overlap", disable_prefix_cache=True)
    try:
        want = [ids for ids, _, _ in _run(ref, waves, feats)]
    finally:
        ref.close()
    c = _client(tiny_llava_dir, "overlap")
    try:
        got = _run(c, waves, feats)
        assert [ids for ids, _, _ in got] == want
        cached = [last.cached_tokens for _, _, last in got]
        assert cached[0] == 0
        assert cached[1] <= start, "a different image must not match the first image's span"
        assert cached[2] > start, "the same image again matches past its span"
        assert c.engine.kv_all_free()
    finally:
        c.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_chunked_prefill_through_image_spans(tiny_llava_dir, loop):
    """Chunks of 5 tokens cut through 16-token image spans, mixed with running decodes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    cases = [
        ("A picture: <image> What is it?", [IMAGES[0]]),
        ("Plain text, no image at all here", []),
        ("Two: <image> and <image> compared", [IMAGES[2], IMAGES[3]]),
    ]
    waves = [[(tok.encode(text), _params(i)) for i, (text, _) in enumerate(cases)]]
    feats = [mm(*imgs) if imgs else None for _, imgs in cases]
    ref = _client(tiny_llava_dir, loop)
    try:
        want = [ids for ids, _, _ in _run(ref, waves, feats)]
    finally:
        ref.close()
    c = _client(tiny_llava_dir, loop, chunked_prefill_size=5, enable_mixed_chunk=True)
    try:
        assert [ids for ids, _, _ in _run(c, waves, feats)] == want
        assert c.engine.kv_all_free()
    finally:
        c.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_retraction_with_prefix_cache_and_chunked_prefill(tiny_llama_dir, loop):
    """A tiny pool, prompts sharing a prefix, chunks of 7 mixed with decodes: requests are retracted
    (their KV goes into the cache, their re-prefill of prompt + kept tokens hits it and is chunked),
    and every output equals an ample pool without cache or chunks; everything is free at the end."""
    from tests.scheduler.test_retraction import (
        assert_initial,
        assert_same,
        generate_all,
        make_client,
        summary,
        workload,
    )

    prompts, params, feats = workload()
    shared = list(range(1000, 1024))
    prompts = [shared + p for p in prompts]
    ref = make_client(
        tiny_llama_dir, "normal", kv=16384, admission_policy="reserve", disable_prefix_cache=True
    )
    try:
        want = summary(generate_all(ref, prompts, params, feats))
    finally:
        ref.close()
    c = make_client(tiny_llama_dir, loop, kv=260, chunked_prefill_size=7, enable_mixed_chunk=True)
    try:
        outs = generate_all(c, prompts, params, feats)
        assert_same(summary(outs), want)
        stats = c.engine.stats()
        assert stats.retractions >= 2
        assert stats.prefix_cache.hit_tokens > 0
        assert_initial(c)
    finally:
        c.close()
