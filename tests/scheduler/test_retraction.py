"""Retraction under memory pressure, optimistic admission: outputs equal an ample-memory run."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from features.retraction import Retracted, retractions_of
from service.config import ServerArgs
from service.core.request import FinishReason, Req, RequestError, SamplingParams
from service.engine.engine import SyncClient, collect
from service.engine.scheduler.admission import AdmissionPolicy, RetractionConfig
from service.metrics import EngineCollector
from service.server import BackgroundServer
from tests.feature_workloads import WORKLOADS
from tests.features.test_features import assert_close
from tests.helpers import wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

POOL = 300  # KV tokens: a few requests' budgets; the workload's total is ~8x that
PRESSURE = dict(init_new_token_ratio=0.15, min_new_token_ratio=0.05, new_token_ratio_decay_steps=5)
REGEX = r"[a-z]{3,8}( [a-z]{2,8}){4,30}"


def workload(n: int = 16, seed: int = 0):
    """Mixed lengths and features: greedy + stop strings, seeded + penalties, logprobs, a grammar, top-p."""
    rng = random.Random(seed)
    prompts, params, feats = [], [], []
    for i in range(n):
        prompts.append([rng.randrange(3, 49000) for _ in range(rng.randrange(4, 30))])
        m = rng.randrange(20, 80)
        kind = i % 5
        f = None
        if kind == 0:
            sp = SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True, stop=["ing "])
        elif kind == 1:
            sp = SamplingParams(
                temperature=0.9,
                seed=i,
                max_new_tokens=m,
                ignore_eos=True,
                repetition_penalty=1.3,
                frequency_penalty=0.4,
                presence_penalty=0.2,
            )
        elif kind == 2:
            sp = SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True)
            f = {
                "logprobs": dict(
                    return_logprob=True, top_logprobs_num=3, token_ids_logprob=(5, 17), logprob_start_len=1
                )
            }
        elif kind == 3:
            sp = SamplingParams(temperature=0.8, seed=i, max_new_tokens=m)
            f = {"constrained": dict(kind="regex", text=REGEX)}
        else:
            sp = SamplingParams(
                temperature=0.7,
                seed=i,
                top_p=0.9,
                min_new_tokens=5,
                max_new_tokens=m,
                ignore_eos=True,
                stop=["e,"],
            )
        params.append(sp)
        feats.append(f)
    return prompts, params, feats


WORKLOAD = workload()


def grpc_request(i: int, rid: str = "") -> pb2.GenerateRequest:
    """Request i of workload() as a GenerateRequest."""
    prompts, params, feats = WORKLOAD
    sp = params[i]
    sampling = pb2.SamplingParams(
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        min_new_tokens=sp.min_new_tokens,
        repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        ignore_eos=sp.ignore_eos,
        stop=sp.stop,
    )
    if sp.seed is not None:
        sampling.seed = sp.seed
    req = pb2.GenerateRequest(request_id=rid, token_ids=pb2.TokenIds(ids=prompts[i]), sampling=sampling)
    f = feats[i] or {}
    if "constrained" in f:
        req.constraint.regex = REGEX
    if "logprobs" in f:
        req.return_logprob = True
    return req


def make_client(model_dir, loop: str, kv: int = POOL, **args) -> SyncClient:
    # Scenarios are tuned to whole-prompt prefill steps (chunked prefill: tests/features/test_module_combinations.py).
    base = dict(
        dtype="float32",
        loop=loop,
        kv_cache_tokens=kv,
        max_running_requests=16,
        chunked_prefill_size=0,
        enable_mixed_chunk=False,
        **PRESSURE,
    )
    return SyncClient(ServerArgs(**{**base, **args}), model_dir)


def generate_all(client: SyncClient, prompts, params, feats, tag: str = "r"):
    """All requests in one scheduler command (deterministic admission), then their outputs."""
    e = client.engine
    reqs = [
        e.build_request(f"{tag}-{i}", p, SamplingParams(**vars(sp)), f)
        for i, (p, sp, f) in enumerate(zip(prompts, params, feats))
    ]
    for r in reqs:
        for fut in e.features.pending(r):
            fut.result(timeout=60)
    e.submit_all(reqs)
    return [client.wait(r.rid) for r in reqs]


def summary(outs):
    """Per request: ids, text, finish reason, matched stop, logprobs and the grammar check."""
    rows = []
    for o in outs:
        ids, text, last = collect(o)
        lp = [d.extras["logprobs"] for d in o if "logprobs" in d.extras]
        grammar = last.extras["constrained"].satisfied if "constrained" in last.extras else None
        rows.append((ids, text, last.finish_reason, last.matched_stop, lp, grammar))
    return rows


def assert_same(got, ref):
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g[:4] == r[:4], f"request {i}"
        assert g[5] == r[5], f"request {i}: grammar check"
        assert_close(g[4], r[4], f"request {i} logprobs")


def assert_initial(client: SyncClient) -> None:
    e = client.engine
    assert wait_until(lambda: e.num_live() == 0, 10)
    s = e.scheduler
    assert e.kv_all_free()  # the prefix cache flushed first
    assert e.req_pool.free_count == e.req_pool.num_slots
    assert s.reserved_tokens == 0 and all(r.finished for r in s.running) and not s.waiting and not s.reqs
    ow = s.overlap_worker
    if ow is not None:
        assert wait_until(lambda: ow.future_map.free_count == ow.future_map.size, 10)
    assert e.features.counters["retraction"].live_requests == 0


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The workload with ample memory (reserve: nothing can be retracted)."""
    client = make_client(tiny_llama_dir, "normal", kv=16384, admission_policy="reserve")
    try:
        return summary(generate_all(client, *WORKLOAD))
    finally:
        client.close()


class StepLog:
    """Scheduler events between two forward launches: which requests finished, which were retracted."""

    def __init__(self, scheduler):
        self.steps: list[dict[str, list[str]]] = [{"finish": [], "retract": []}]
        launch = "launch_batch" if scheduler.overlap else "run_batch"
        run, finish, retract = (
            getattr(scheduler, launch),
            scheduler.output.finish,
            scheduler.retraction.retract,
        )

        def on_launch(*a, **k):
            self.steps.append({"finish": [], "retract": []})
            return run(*a, **k)

        def on_finish(req, reason, *a, **k):
            if req.finished is None and reason is not FinishReason.ABORT:
                self.steps[-1]["finish"].append(req.rid)
            return finish(req, reason, *a, **k)

        def on_retract(req):
            self.steps[-1]["retract"].append(req.rid)
            return retract(req)

        setattr(scheduler, launch, on_launch)
        scheduler.output.finish, scheduler.retraction.retract = on_finish, on_retract


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_retraction_matches_ample_memory(loop, tiny_llama_dir, reference, tmp_path):
    """A tiny pool forces repeated retractions; every output (tokens, text, logprobs, grammar) equals
    the ample-memory run; pools, slots and future map end as they began."""
    trace = tmp_path / "trace.json"
    client = make_client(tiny_llama_dir, loop, trace_file=str(trace))
    try:
        outs = generate_all(client, *workload())
        assert_same(summary(outs), reference)
        stats = client.engine.stats()
        counts = [o[-1].extras["retraction"].retractions if "retraction" in o[-1].extras else 0 for o in outs]
        assert stats.retractions >= 4 and sum(counts) == stats.retractions
        assert max(counts) >= 2, "some request is retracted twice"
        row = {r.feature: r for r in client.engine.features.matrix()}["retraction"]
        if loop == "overlap":
            assert (
                stats.retraction_sync_points > 0 and row.batches_overlapped > 0 and row.batches_fallback == 0
            )
            # the drains are its declared sync event, counted apart from its batches (none waited)
            assert row.counters["event_syncs"] == stats.retraction_sync_points and row.batches_synced == 0
        else:
            assert row.batches_normal_loop > 0
        assert_initial(client)
    finally:
        client.close()
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "retract"]
    assert spans and sum(e["args"]["retracted"] for e in spans) == stats.retractions


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_retraction_in_the_same_step_as_a_finish(loop, tiny_llama_dir):
    """A (4 + 10 tokens) finishes right when 14 requests of 20 + 60 tokens outgrow a pool of 419 rows:
    29 x 14 + 13 = 419, so the step after A's last token needs 14 rows with only A's 13 freed. The
    retraction happens between the same two forwards as A's finish; outputs equal an ample pool's."""
    prompts = [[9] * 4] + [[11 + i] * 20 for i in range(14)]
    params = [SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)] + [
        SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    ] * 14
    ratio = dict(init_new_token_ratio=0.05, min_new_token_ratio=0.05)
    ample = make_client(tiny_llama_dir, loop, kv=4096, **ratio)
    try:
        ref = [collect(o)[0] for o in generate_all(ample, prompts, params, [None] * 15)]
    finally:
        ample.close()
    client = make_client(tiny_llama_dir, loop, kv=419, **ratio)
    log = StepLog(client.engine.scheduler)
    try:
        assert [collect(o)[0] for o in generate_all(client, prompts, params, [None] * 15)] == ref
        first = next(s for s in log.steps if s["retract"])
        assert first["finish"] == ["r-0"] and "r-0" not in first["retract"], first
        assert_initial(client)
    finally:
        client.close()


def test_optimistic_admission_runs_more_requests_than_reserve(tiny_llama_dir):
    """Same pool, same requests (budget 48 tokens, pool 300): reserve runs 6 at once and never retracts;
    optimistic runs at least twice as many, with the same outputs."""
    prompts = [[7 + i] * 8 for i in range(16)]
    params = [SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)] * 16
    got = {}
    for policy in ("reserve", "optimistic"):
        client = make_client(tiny_llama_dir, "normal", admission_policy=policy, init_new_token_ratio=0.3)
        try:
            got[policy] = [collect(o)[0] for o in generate_all(client, prompts, params, [None] * 16)]
            s = client.engine.scheduler.admission.stats
            got[policy + " peak"] = s.peak_running
            if policy == "reserve":
                assert s.retractions == 0 and s.peak_running == POOL // 48
            assert_initial(client)
        finally:
            client.close()
    assert got["optimistic"] == got["reserve"]
    assert got["optimistic peak"] >= 2 * got["reserve peak"], got


def test_retractions_are_bounded_per_request(tiny_llama_dir, reference):
    """--max-retractions 1: a request retracted once is re-admitted with its budget reserved and never
    retracted again; the workload still completes, unchanged."""
    client = make_client(tiny_llama_dir, "overlap", max_retractions=1)
    try:
        outs = generate_all(client, *workload())
        assert_same(summary(outs), reference)
        counts = [o[-1].extras["retraction"].retractions if "retraction" in o[-1].extras else 0 for o in outs]
        assert max(counts) == 1 and client.engine.stats().retractions == sum(counts)
        assert_initial(client)
    finally:
        client.close()


@pytest.mark.parametrize("loop", ["overlap"])
def test_abort_while_retracted(loop, tiny_llama_dir, reference):
    """The first victim is aborted while it waits to be re-prefilled: it ends ABORT with the tokens it had
    (a prefix of its reference), its KV is not freed twice, the others are unchanged."""
    client = make_client(tiny_llama_dir, loop)
    s = client.engine.scheduler.retraction
    retract = s.retract
    victims: list[str] = []

    def retract_and_abort(req: Req) -> None:
        retract(req)
        if not victims:
            victims.append(req.rid)
            client.engine.abort(req.rid)

    s.retract = retract_and_abort
    try:
        outs = generate_all(client, *workload())
        got = summary(outs)
        assert victims
        k = int(victims[0].split("-")[1])
        ids, _, reason, *_ = got[k]
        assert reason is FinishReason.ABORT and ids == reference[k][0][: len(ids)]
        assert_same(got[:k] + got[k + 1 :], reference[:k] + reference[k + 1 :])
        assert_initial(client)
    finally:
        client.close()


def test_client_cancel_while_retracted(tiny_llama_dir, reference):
    """Through gRPC: the first victim's client cancels its call while the request waits to be re-prefilled
    (the scheduler holds until the abort is queued); it ends CANCELLED, the others equal the reference,
    and the pool is whole again."""
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            loop="overlap",
            port=0,
            model=str(tiny_llama_dir),
            kv_cache_tokens=POOL,
            chunked_prefill_size=0,
            enable_mixed_chunk=False,
            max_running_requests=16,
            **PRESSURE,
        )
    )
    s = srv.engine.scheduler
    calls: dict[str, grpc.Future] = {}
    cancelled: list[str] = []
    retract = s.retraction.retract

    def retract_and_cancel(req: Req) -> None:
        retract(req)
        if not cancelled and req.rid in calls:
            cancelled.append(req.rid)
            calls[req.rid].cancel()
            assert wait_until(lambda: s.inbox.qsize() > 0, 10)  # the server's abort, before re-admission

    s.retraction.retract = retract_and_cancel
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb2_grpc.GenerationStub(ch)
            for i in range(len(WORKLOAD[0])):
                calls[f"g-{i}"] = stub.Generate.future(grpc_request(i, f"g-{i}"))
            for rid, fut in calls.items():
                # the victim is chosen on the scheduler thread while this loop may already wait on its call,
                # so which call was cancelled is read after the wait
                try:
                    token_ids = list(fut.result(timeout=60).token_ids)
                except grpc.FutureCancelledError:
                    assert rid in cancelled, rid
                    continue
                assert rid not in cancelled, rid
                assert token_ids == reference[int(rid[2:])][0], rid
        assert cancelled, "no victim among the calls"
        assert wait_until(lambda: srv.engine.num_live() == 0 and srv.engine.kv_all_free(), 10)
        assert srv.engine.req_pool.free_count == srv.engine.req_pool.num_slots and not s.waiting
    finally:
        srv.stop()


def test_request_that_cannot_fit_alone_is_refused(tiny_llama_dir):
    """Optimistic admission never admits what could not finish alone: OUT_OF_RANGE at once (it never
    fits, however long it waits: not a status clients retry)."""
    client = make_client(tiny_llama_dir, "normal", kv=64)
    try:
        with pytest.raises(RequestError) as e:
            client.engine.build_request("big", [5] * 20, SamplingParams(max_new_tokens=45), None)
        assert e.value.code == "OUT_OF_RANGE" and "pool holds 64" in e.value.message
        client.engine.build_request("fits", [5] * 20, SamplingParams(max_new_tokens=44), None)
    finally:
        client.close()


def test_grpc_stream_and_unary_under_retraction(tiny_llama_dir, reference):
    """Through gRPC: concurrent streams and unary calls under retraction pressure; each stream's deltas
    concatenate to the reference (no gap, repeat or reorder); usage.retractions and ServerInfo agree."""
    prompts = WORKLOAD[0]
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            loop="overlap",
            port=0,
            model=str(tiny_llama_dir),
            kv_cache_tokens=POOL,
            chunked_prefill_size=0,
            enable_mixed_chunk=False,
            max_running_requests=16,
            **PRESSURE,
        )
    )
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb2_grpc.GenerationStub(ch)

            def run(i: int):
                if i % 2:
                    r = stub.Generate(grpc_request(i))
                    return list(r.token_ids), r.text, r.usage.retractions
                parts = list(stub.GenerateStream(grpc_request(i)))
                return (
                    [t for p in parts for t in p.token_ids],
                    "".join(p.text for p in parts),
                    parts[-1].usage.retractions,
                )

            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(run, range(len(prompts))))
            info = stub.GetServerInfo(pb2.GetServerInfoRequest())
        for i, (ids, text, _) in enumerate(results):
            assert (ids, text) == tuple(reference[i][:2]), f"request {i}"
        assert info.admission_policy == "optimistic" and info.retractions > 0
        assert sum(r[2] for r in results) == info.retractions
        metrics = {
            m.name: m.samples[0].value for m in EngineCollector(srv.engine, srv.running.router).collect()
        }
        assert (
            metrics["zerogap_retractions"] == info.retractions and 0 < metrics["zerogap_new_token_ratio"] <= 1
        )
        assert wait_until(lambda: srv.engine.kv_all_free(), 10)
    finally:
        srv.stop()


# ---- the policy alone ----------------------------------------------------------------------


def _req(rid: str, prompt: int, out: int, max_new: int, arrival: float) -> Req:
    r = Req(rid, [5] * prompt, SamplingParams(max_new_tokens=max_new), 0, None, frozenset())  # type: ignore[arg-type]
    r.output_ids = [7] * out
    r.launched = out + 1
    r.kv_len = prompt + out
    r.arrival = arrival
    return r


def test_victims_fewest_output_tokens_first_never_a_reserved_one():
    p = AdmissionPolicy(RetractionConfig(max_retractions=1, headroom_steps=2))
    a, b, c, d = (
        _req("a", 10, 30, 100, 1.0),
        _req("b", 10, 5, 100, 2.0),
        _req("c", 50, 5, 100, 3.0),
        _req("d", 10, 1, 100, 4.0),
    )
    d.features["retraction"] = Retracted(count=1)  # hit the bound: reserved, never a victim
    assert p.reserved(d) and retractions_of(d) == 1
    # 4 decoding, 0 free: c (5 tokens, later arrival) goes first, then b; 2 left need 4 rows.
    assert [r.rid for r in p.victims([a, b, c, d], 0)] == ["c"]  # c frees 55 rows >= 3 x 2
    assert [r.rid for r in p.victims([a, b, d], 0)] == ["b"]  # b frees 15 rows >= 2 x 2
    assert [r.rid for r in p.victims([d, a], 0)] == ["a"]  # never d
    assert p.victims([a], 0) == []  # the last one runs alone (it fits: its budget <= pool)
    assert p.victims([a, b, c], 3) == []  # a row each: no retraction (headroom is only sought once short)


def test_new_token_ratio_decays_and_backs_off():
    p = AdmissionPolicy(RetractionConfig(init_ratio=0.5, min_ratio=0.1, decay_steps=4))
    for _ in range(10):
        p.on_decode_step()
    assert p.ratio == pytest.approx(0.1)
    survivors = [_req("a", 10, 59, 100, 1.0), _req("b", 10, 39, 100, 2.0)]
    p.after_retraction(survivors)  # they used (60 + 40 + 2 x 4 headroom) / 200
    assert p.ratio == pytest.approx(108 / 200)
    r = _req("n", 10, 0, 100, 5.0)
    assert p.cost(r) == 10 + 54
    assert AdmissionPolicy(RetractionConfig(policy="reserve")).cost(r) == r.budget_tokens == 110


def test_expected_tokens_are_clipped_for_requests_that_may_run_long():
    """A request that may run to the end of a long context (max_tokens unset on the vLLM contract) is
    expected to take at most EXPECTED_TOKENS_CLIP more tokens: 0.7 x 30,000 set aside would keep one
    such request running at a time."""
    from service.engine.scheduler.admission import EXPECTED_TOKENS_CLIP

    p = AdmissionPolicy(RetractionConfig(init_ratio=0.5))
    long = _req("long", 10, 0, 30_000, 1.0)
    assert p.cost(long) == 10 + EXPECTED_TOKENS_CLIP // 2
    long.launched = 100
    assert p.future_rows(long) == EXPECTED_TOKENS_CLIP // 2
    assert AdmissionPolicy(RetractionConfig(policy="reserve")).cost(long) == 30_010  # reserve: all of it


def test_matrix_workload_is_registered():
    assert "retraction" in WORKLOADS
