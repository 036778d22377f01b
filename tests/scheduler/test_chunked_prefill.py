"""Chunked prefill and mixed batches: a prompt split across steps (alone or riding with the running
decodes) gives what one whole-prompt prefill gives — tokens, input and output logprobs, seeded
samples with penalties, stop strings, grammars — in both loops, and frees its KV when aborted."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from service.config import ServerArgs
from service.core.request import FinishReason, SamplingParams
from service.engine.chunking import PrefillChunker
from service.engine.engine import SyncClient, collect
from tests.engine.test_device_path import watch_forward
from tests.features.test_features import assert_close
from tests.helpers import wait_until
from tests.scheduler.test_overlap import assert_pools_initial, forbid_placeholders

LONG = 150  # tokens of the long prompt (the tiny models' context is 512)
LOGPROBS = {
    "logprobs": {
        "return_logprob": True,
        "top_logprobs_num": 3,
        "token_ids_logprob": [5, 17],
        "logprob_start_len": 0,
    }
}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


def client(model_dir, guard: bool = True, **args) -> SyncClient:
    """guard: any future placeholder reaching the model fails the forward (a host read itself)."""
    base = {
        "dtype": "float32",
        "loop": "normal",
        "kv_cache_tokens": 3000,
        "max_running_requests": 8,
        "chunked_prefill_size": 0,
        "enable_mixed_chunk": False,
    }  # the reference: whole-prompt prefill
    c = SyncClient(ServerArgs(**{**base, **args}), model_dir)
    if guard:
        forbid_placeholders(c)
    return c


def run(model_dir, prompts, params, feats, **args):
    """(per request: token ids, finish reason, logprob extras of every delta), chunk counters."""
    c = client(model_dir, **args)
    try:
        outs = c.generate(prompts, params, feats)
        assert_pools_initial(c)
        counters = next(r.counters for r in c.engine.features.matrix() if r.feature == "chunked_prefill")
    finally:
        c.close()
    results = []
    for o in outs:
        ids, text, last = collect(o)
        assert last.error is None, last.error
        results.append((ids, text, last.finish_reason, [d.extras.get("logprobs") for d in o]))
    return results, counters


def assert_same(a, b) -> None:
    """Tokens, text and finish reasons equal; logprobs within float32 tolerance."""
    for i, (x, y) in enumerate(zip(a, b)):
        assert x[:3] == y[:3], f"request {i} differs"
        assert_close(x[3], y[3], f"request {i} logprobs")


def workload():
    """A long prompt with input logprobs from position 0, beside short requests that decode while it
    prefills: seeded sampling with penalties, a stop string, input logprobs from the middle."""
    prompts = [prompt(1, LONG), prompt(2, 5), prompt(3, 23), prompt(4, 40), prompt(5, 9)]
    params = [
        SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=0.9,
            seed=7,
            max_new_tokens=16,
            ignore_eos=True,
            frequency_penalty=1.5,
            repetition_penalty=1.3,
            presence_penalty=0.5,
        ),
        SamplingParams(temperature=0.8, seed=11, top_k=40, max_new_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop=["e"], min_new_tokens=2),
    ]
    feats = [
        LOGPROBS,
        LOGPROBS,
        None,
        {"logprobs": {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 17}},
        None,
    ]
    return prompts, params, feats


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Whole-prompt prefill, normal loop."""
    return run(tiny_llama_dir, *workload())[0]


@pytest.mark.parametrize("size", [1, 7, 64])
def test_chunk_sizes_give_the_same_tokens_and_logprobs(size, tiny_llama_dir, reference):
    got, counters = run(tiny_llama_dir, *workload(), chunked_prefill_size=size)
    assert_same(reference, got)
    assert counters["chunked_requests"] >= 1 and counters["chunks"] >= LONG // size
    assert counters["mixed_steps"] == 0
    first = [d for d in got[0][3] if d and d.input is not None]
    assert len(first) == 1 and len(first[0].input) == LONG - 1 and first[0].input_start == 1


@pytest.mark.parametrize(
    "loop,mixed,size",
    [
        ("normal", False, 16),
        ("overlap", False, 16),
        ("normal", True, 16),
        ("overlap", True, 16),
        ("overlap", True, 100),
    ],
)
def test_mixed_and_overlap_equal_whole_prefill(loop, mixed, size, tiny_llama_dir, reference):
    """The long prompt comes last, so its chunks meet running decodes. Size 100: chunks past the CPU
    kernel's extend limit (SDPA), the decode rows beside them through the kernel."""
    prompts, params, feats = (x[::-1] for x in workload())
    got, counters = run(
        tiny_llama_dir, prompts, params, feats, chunked_prefill_size=size, enable_mixed_chunk=mixed, loop=loop
    )
    assert_same(reference, got[::-1])
    assert counters["chunks"] > 0
    if mixed:
        assert counters["mixed_steps"] > 0 and counters["mixed_decode_rows"] >= counters["mixed_steps"]
    else:
        assert counters["mixed_steps"] == 0


def test_sliding_window_across_chunk_boundaries(tiny_mistral_dir):
    """Mistral (window 8): chunks of 5 and mixed rows attend the same window as one prefill."""
    prompts, params = (
        [prompt(1, 60), prompt(2, 7)],
        [SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)] * 2,
    )
    ref, _ = run(tiny_mistral_dir, prompts, params, [LOGPROBS] * 2)
    got, _ = run(
        tiny_mistral_dir,
        prompts,
        params,
        [LOGPROBS] * 2,
        chunked_prefill_size=5,
        enable_mixed_chunk=True,
        loop="overlap",
    )
    assert_same(ref, got)


def test_prompt_at_and_over_the_budget(tiny_llama_dir):
    """Exactly the budget: one step, not a chunk. One token over: two chunks (16 + 1)."""
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    at, over = prompt(8, 16), prompt(9, 17)
    for p, chunks in ((at, 0), (over, 2)):
        ref, _ = run(tiny_llama_dir, [p], [sp], [LOGPROBS])
        got, counters = run(tiny_llama_dir, [p], [sp], [LOGPROBS], chunked_prefill_size=16, loop="overlap")
        assert_same(ref, got)
        assert counters["chunks"] == chunks and counters["chunked_requests"] == (chunks > 0)


def test_logprob_start_at_a_chunk_boundary(tiny_llama_dir):
    """Input logprobs from each position around a boundary (chunks of 8: boundary tokens at 8, 16)."""
    p = prompt(10, 20)
    sp = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    feats = [
        {"logprobs": {"top_logprobs_num": 2, "token_ids_logprob": [9], "logprob_start_len": s}}
        for s in (7, 8, 9, 16, 19)
    ]
    ref, _ = run(tiny_llama_dir, [p] * 5, [sp] * 5, feats)
    got, _ = run(tiny_llama_dir, [p] * 5, [sp] * 5, feats, chunked_prefill_size=8, max_running_requests=1)
    assert_same(ref, got)


def test_grammar_starts_after_the_last_chunk(tiny_llama_dir):
    """A constrained request with a chunked prompt: the matcher sees only real output tokens."""
    pytest.importorskip("xgrammar")
    prompts = [prompt(11, 90), prompt(12, 4)]
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    feats = [
        {"constrained": {"kind": "regex", "text": r"[a-z]{2,6}( [0-9]+)?"}},
        {"constrained": {"kind": "json_object"}},
    ]
    ref, _ = run(tiny_llama_dir, prompts, [sp] * 2, feats)
    got, counters = run(
        tiny_llama_dir,
        prompts,
        [sp] * 2,
        feats,
        chunked_prefill_size=8,
        enable_mixed_chunk=True,
        loop="overlap",
    )
    assert [r[:3] for r in got] == [r[:3] for r in ref]
    assert counters["chunked_requests"] == 1


def test_abort_during_chunked_prefill_frees_its_kv(tiny_llama_dir):
    """Aborted part-way through its prompt (chunks of 1): slot, KV rows and reservation come back;
    the request beside it is unaffected."""
    for loop in ("normal", "overlap"):
        c = client(tiny_llama_dir, chunked_prefill_size=1, enable_mixed_chunk=True, loop=loop)
        try:
            sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
            c.submit("short", prompt(13, 3), sp)
            c.submit("long", prompt(14, 300), sp)
            sched = c.engine.scheduler
            assert wait_until(lambda: sched.chunker.stats.chunks > 20, 60)
            assert c.engine.abort("long")
            ids, _, last = collect(c.wait("long"))
            assert last.finish_reason is FinishReason.ABORT and ids == []
            ids, _, last = collect(c.wait("short"))
            assert last.finish_reason is FinishReason.LENGTH and len(ids) == 40
            assert_pools_initial(c)
            assert sched.chunker.holding == 0
        finally:
            c.close()


def test_a_prompt_part_way_through_its_chunks_counts_as_running(tiny_llama_dir):
    """What the loads report (GetLoads, the pushes to SMG): the request the chunker holds between its
    chunks is neither in the running list nor waiting, and is running all the same."""
    c = client(tiny_llama_dir, chunked_prefill_size=1, loop="overlap")
    try:
        c.submit("long", prompt(15, 300), SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        sched = c.engine.scheduler
        assert wait_until(lambda: sched.chunker.stats.chunks > 20, 60)
        occupancy = c.engine.occupancy()
        assert sched.chunker.holding == 1
        assert (occupancy.running_requests, occupancy.queued_requests) == (1, 0)
        collect(c.wait("long"))
    finally:
        c.close()


@pytest.mark.parametrize("cached", [0, 60], ids=["short-prompt", "cached-next-turn"])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_short_prompt_overtakes_a_long_one_part_way(loop, cached, tiny_llama_dir):
    """A short prompt that arrives while a long one is cut into chunks goes whole before the long
    one's next chunk: it finishes while the long one is still part-way through its prompt, and both
    give what they give alone. Short is what a prompt computes: a conversation's next turn (`cached`
    tokens of history in the prefix cache, then 2 new ones) is long but short, and overtakes too
    (judged by its whole length it waited for the long one's last chunk)."""
    sp_long = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    sp_short = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    history, long_p = prompt(17, cached), prompt(15, 400)
    short_p = history + prompt(16, 2)
    ref, _ = run(tiny_llama_dir, [long_p, short_p], [sp_long, sp_short], [{}, {}])
    c = client(tiny_llama_dir, chunked_prefill_size=4, enable_mixed_chunk=True, loop=loop)
    try:
        sched = c.engine.scheduler
        if history:
            c.generate([history], [sp_short], [{}])  # the earlier turns: now in the prefix cache
        c.submit("long", long_p, sp_long)
        assert wait_until(lambda: sched.chunker.stats.chunks > 5 + cached // 4, 60)
        c.submit("short", short_p, sp_short)
        short = collect(c.wait("short"))
        assert short[2].cached_tokens >= cached - 1  # a hit, not a recomputation
        assert c._outputs.get("long", []) == []  # no token of the long one yet: it was overtaken
        assert sched.chunker.holding == 1
        long = collect(c.wait("long"))
        assert_pools_initial(c)
    finally:
        c.close()
    assert long[0] == ref[0][0] and short[0] == ref[1][0]


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "decode-turns"])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_long_prompt_behind_an_overtaker_waits_while_the_chunk_is_left_out(loop, mixed, tiny_llama_dir):
    """While a long prompt is cut into chunks, a short prompt and a second long one arrive together:
    the short one overtakes and the chunk is left out of its step, so the second long one (which does
    not overtake) waits for a later step rather than being cut beside it. Every request gives what it
    gives alone, with running streams decoding throughout (mixed rows, or decode turns)."""
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    prompts = [prompt(31, 120), prompt(32, 2), prompt(33, 90), prompt(34, 5)]
    ref, _ = run(tiny_llama_dir, prompts, [sp] * 4, [{}] * 4)
    c = client(tiny_llama_dir, chunked_prefill_size=4, enable_mixed_chunk=mixed, loop=loop)
    try:
        sched = c.engine.scheduler
        c.submit("stream", prompts[3], SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True))
        c.submit("long", prompts[0], sp)
        assert wait_until(lambda: sched.chunker.stats.chunks > 5, 60)
        c.submit("short", prompts[1], sp)
        c.submit("long2", prompts[2], sp)
        outs = [collect(c.wait(rid)) for rid in ("long", "short", "long2")]
        assert all(o[2].error is None for o in outs)
        c.engine.abort("stream")
        collect(c.wait("stream"))
        assert sched.chunker.holding == 0
        assert_pools_initial(c)
    finally:
        c.close()
    assert [o[0] for o in outs] == [ref[0][0], ref[1][0], ref[2][0]]


def test_an_overtaken_chunk_is_left_out_then_takes_its_floor():
    """A step that prompts overtook leaves the pending chunk out: the overtakers' step carries only
    their rows. The next step that prompts overtake gives the chunk its floor (a quarter of the
    budget), so however many prompts keep overtaking, the long one advances every other step that
    admits prompts. Without
    an overtaker the chunk takes the rest of the budget, and a chunk with less left than its floor
    finishes; a decode turn in between (no budget) does not reset what the chunk is owed."""
    long = SimpleNamespace(prefill_ids=list(range(2000)), kv_len=512, finished=False, snapshot_at=0)
    chunker = PrefillChunker(size=256, mixed=True)
    chunker.partial = long

    def step(decodes: int, *short_lens: int) -> list[int]:
        running = [SimpleNamespace(finished=False, launched=0, max_new_tokens=8) for _ in range(decodes)]
        st = chunker.begin_step(running, free_rows=10_000)
        for n in short_lens:
            assert st.overtakes(n)
            st.add(
                SimpleNamespace(prefill_ids=list(range(1000 + n)), snapshot_at=0), 1000, fresh=True
            )  # 1000 cached
        chunker.settle(st)
        return [len(row.token_ids) for row in st.rows]

    assert step(3) == [253]  # no overtaker: the chunk takes the budget the decodes leave
    long.kv_len += 253
    assert step(3, 22) == [22]  # overtaken: left out
    assert chunker.partial is long and chunker.left_out
    assert step(3, 22) == [22, 64]  # overtaken again: the floor, 256 // 4
    long.kv_len += 64
    assert step(0, 22, 40) == [22, 40]
    chunker.decode_turn = True
    assert step(3) == [] and chunker.left_out  # a decode turn: the chunk is still owed its floor
    assert step(0, 22, 40) == [22, 40, 64]
    long.kv_len = 2000 - 30
    assert step(3, 10) == [10]
    assert step(3, 10) == [10, 30]  # less left than the floor: the chunk finishes
    assert chunker.partial is None


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_mixed_batches_have_no_host_sync(loop, tiny_llama_dir):
    """Chunk and decode rows in one batch, placeholders included: no host read of device values."""
    found: list[str] = []
    c = client(tiny_llama_dir, guard=False, chunked_prefill_size=6, enable_mixed_chunk=True, loop=loop)
    watch_forward(c, found)
    try:
        prompts, params, feats = workload()
        outs = c.generate(prompts[1:] + [prompts[0][:30]], params[1:] + params[:1], feats[1:] + feats[:1])
        assert all(collect(o)[2].error is None for o in outs)
        assert c.engine.scheduler.chunker.stats.mixed_steps > 0
    finally:
        c.close()
    assert found == [], f"host syncs in the forward path: {sorted(set(found))}"


def test_options_and_switch(tiny_llama_dir):
    from service.config import parse_server_args

    a = parse_server_args(["--chunked-prefill-size", "256", "--enable-mixed-chunk"])
    assert a.chunked_prefill_size == 256 and a.enable_mixed_chunk
    c = client(tiny_llama_dir, chunked_prefill_size=8, disabled_features=["chunked_prefill"])
    try:
        assert c.engine.scheduler.chunker is None  # switched off: whole prompts per step
    finally:
        c.close()


def test_a_cut_where_the_prefix_cache_keeps_a_snapshot_never_makes_a_second_part_way_prompt():
    """A recurrent model's prompt that parts from a cached one (`snapshot_at`) has a chunk end there,
    unless another prompt is part-way through: an overtaker goes whole, as the chunker assumes."""
    chunker = PrefillChunker(size=256, mixed=False)
    st = chunker.begin_step([], free_rows=10_000)
    alone = SimpleNamespace(prefill_ids=list(range(100)), kv_len=0, finished=False, snapshot_at=40)
    st.add(alone, 0, fresh=True)
    chunker.settle(st)
    assert [len(r.token_ids) for r in st.rows] == [40] and chunker.partial is alone
    alone.kv_len = 40
    st = chunker.begin_step([], free_rows=10_000)
    short = SimpleNamespace(prefill_ids=list(range(30)), kv_len=0, finished=False, snapshot_at=20)
    assert st.overtakes(30)
    st.add(short, 0, fresh=True)
    chunker.settle(st)
    assert [len(r.token_ids) for r in st.rows] == [
        30
    ] and chunker.partial is alone  # whole; the chunk left out
