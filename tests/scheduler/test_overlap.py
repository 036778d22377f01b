"""The overlap loop equals the normal loop; pools, future map and faults stay sound."""

from __future__ import annotations

import json
import random
import threading
import time

import grpc
import pytest

from service.config import ServerArgs
from service.core.request import FinishReason, SamplingParams
from service.engine.engine import SyncClient, collect
from service.server import BackgroundServer
from tests.helpers import on_each_result, wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc


def workload(seed: int, n: int) -> list[tuple[list[int], SamplingParams, float, int | None]]:
    """(prompt, params, arrival delay s, abort after k outputs or None) for n requests."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        prompt = [rng.randrange(3, 49000) for _ in range(rng.randrange(2, 40))]
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, 40))
        elif kind == 1:
            sp = SamplingParams(
                temperature=0.9,
                top_k=40,
                top_p=0.95,
                seed=rng.randrange(1 << 30),
                max_new_tokens=rng.randrange(5, 40),
                repetition_penalty=1.2,
                frequency_penalty=0.3,
                presence_penalty=0.2,
            )
        elif kind == 2:
            sp = SamplingParams(
                temperature=0.7, min_p=0.1, seed=i, max_new_tokens=rng.randrange(5, 30), stop=["e", ", "]
            )
        else:
            sp = SamplingParams(
                temperature=0, max_new_tokens=rng.randrange(10, 40), min_new_tokens=3, stop=["the"]
            )
        abort_after = rng.randrange(1, 5) if i % 7 == 3 else None
        items.append((prompt, sp, rng.random() * 0.3, abort_after))
    return items


def run_workload(client: SyncClient, items, tag: str) -> dict[int, tuple[list[int], str, FinishReason]]:
    """Submit with arrival delays from another thread; abort some after k tokens."""
    rids = [f"{tag}-{i}" for i in range(len(items))]

    def submitter():
        for rid, (prompt, sp, delay, _) in zip(rids, items):
            time.sleep(delay * 0.1)
            client.submit(rid, prompt, SamplingParams(**vars(sp)))

    t = threading.Thread(target=submitter)
    t.start()
    aborted = {i for i, it in enumerate(items) if it[3] is not None}
    for i in aborted:  # abort as soon as the request has produced k tokens (any loop)
        rid, k = rids[i], items[i][3]
        wait_until(
            lambda: (
                len(client._outputs.get(rid, [])) >= k
                or rid not in client.engine._live
                and rid in client._outputs
            ),
            30,
            0.001,
        )
        client.engine.abort(rid)
    t.join()
    results = {}
    for i, rid in enumerate(rids):
        ids, text, last = collect(client.wait(rid))
        assert all(t >= 0 for t in ids), "a placeholder reached the client"
        results[i] = (ids, text, last.finish_reason)
    return results


def assert_pools_initial(client: SyncClient) -> None:
    e = client.engine
    assert wait_until(lambda: e.num_live() == 0, 10)
    assert e.kv_all_free()  # all free once the prefix cache is flushed
    assert e.req_pool.free_count == e.req_pool.num_slots
    assert e.scheduler.reserved_tokens == 0
    ow = e.scheduler.overlap_worker
    if ow is not None:
        assert wait_until(lambda: ow.future_map.free_count == ow.future_map.size, 10)


def forbid_placeholders(client: SyncClient) -> None:
    """Wrap the model so any negative input id fails the forward loudly."""
    model = client.engine.worker.model
    inner = model.forward

    def checked(fb, input_ids, kv_pool, attn):
        assert int(input_ids.min()) >= 0, "a future placeholder reached the model"
        return inner(fb, input_ids, kv_pool, attn)

    model.forward = checked


def compare(normal: dict, overlap: dict, items) -> None:
    for i, it in enumerate(items):
        (a_ids, a_text, a_fin), (b_ids, b_text, b_fin) = normal[i], overlap[i]
        if it[3] is None:
            assert (a_ids, a_text, a_fin) == (b_ids, b_text, b_fin), f"request {i} differs"
        else:  # aborted at a timing-dependent point: one is a prefix of the other
            n = min(len(a_ids), len(b_ids))
            assert a_ids[:n] == b_ids[:n]


@pytest.fixture(scope="module")
def tiny_clients(tiny_llama_dir):
    clients = {}
    for mode in ("normal", "overlap"):
        clients[mode] = SyncClient(
            ServerArgs(dtype="float32", loop=mode, kv_cache_tokens=3000, max_running_requests=12),
            tiny_llama_dir,
        )
        forbid_placeholders(clients[mode])
    yield clients
    for c in clients.values():
        c.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_overlap_matches_normal_random_workload(tiny_clients, seed):
    items = workload(seed, 30)
    normal = run_workload(tiny_clients["normal"], items, f"n{seed}")
    overlap = run_workload(tiny_clients["overlap"], items, f"o{seed}")
    compare(normal, overlap, items)
    for c in tiny_clients.values():
        assert_pools_initial(c)


def test_overlap_matches_normal_on_smollm2(smol_dir):
    items = [(p, sp, d, None) for p, sp, d, _ in workload(11, 10)]
    res = {}
    for mode in ("normal", "overlap"):
        c = SyncClient(
            ServerArgs(dtype="float32", loop=mode, kv_cache_tokens=4096, max_running_requests=8), smol_dir
        )
        forbid_placeholders(c)
        try:
            res[mode] = run_workload(c, items, mode)
            assert_pools_initial(c)
        finally:
            c.close()
    compare(res["normal"], res["overlap"], items)


def test_tiny_future_map_is_still_correct(tiny_llama_dir, tiny_clients):
    """A map that holds just one batch forces sync points; results stay the same."""
    items = [(p, sp, d, None) for p, sp, d, _ in workload(5, 20)]
    ref = run_workload(tiny_clients["normal"], items, "ref")
    c = SyncClient(
        ServerArgs(
            dtype="float32", loop="overlap", kv_cache_tokens=3000, max_running_requests=12, future_map_size=12
        ),
        tiny_llama_dir,
    )
    forbid_placeholders(c)
    try:
        compare(ref, run_workload(c, items, "tiny"), items)
        assert_pools_initial(c)
        assert c.engine.scheduler.sync_points > 0  # the map really was too small to overlap freely
    finally:
        c.close()


def test_future_map_smaller_than_a_batch_fails_loudly(tiny_llama_dir):
    with pytest.raises(ValueError, match="future map size"):
        SyncClient(
            ServerArgs(
                dtype="float32",
                loop="overlap",
                kv_cache_tokens=1000,
                max_running_requests=8,
                future_map_size=4,
            ),
            tiny_llama_dir,
        )


def test_finish_and_abort_in_the_same_step_frees_once(tiny_clients):
    """Aborts racing with natural finishes (and double finish calls) never double free."""
    c = tiny_clients["overlap"]
    sched = c.engine.scheduler

    def hook(req):  # abort every request right as its last token is processed
        if len(req.output_ids) + 1 >= req.max_new_tokens:
            sched.abort_request(req.rid)

    with on_each_result(sched, hook):
        outs = c.generate(
            [[5, 6, 7, i + 10] for i in range(10)],
            SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True),
        )
        assert all(collect(o)[2].finish_reason in (FinishReason.LENGTH, FinishReason.ABORT) for o in outs)
    assert_pools_initial(c)


def test_overlap_matches_normal_through_grpc(smol_dir):
    rng = random.Random(3)
    prompts = [f"Question {i}: what is {rng.randrange(100)} plus {rng.randrange(100)}?" for i in range(10)]
    samplings = [
        pb2.SamplingParams(
            max_new_tokens=rng.randrange(4, 30),
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            stop=[" is"] if i % 3 == 0 else [],
        )
        for i in range(10)
    ]
    results = {}
    for mode in ("normal", "overlap"):
        srv = BackgroundServer(
            ServerArgs(
                dtype="float32",
                model=str(smol_dir),
                port=0,
                kv_cache_tokens=4096,
                max_running_requests=8,
                loop=mode,
            )
        )
        try:
            with grpc.insecure_channel(srv.address) as ch:
                stub = pb2_grpc.GenerationStub(ch)
                futures = []
                for p, sp in zip(prompts, samplings):
                    futures.append(stub.Generate.future(pb2.GenerateRequest(text=p, sampling=sp)))
                    time.sleep(0.02)
                results[mode] = [
                    (list(f.result().token_ids), f.result().text, f.result().finish_reason) for f in futures
                ]
                assert stub.GetServerInfo(pb2.GetServerInfoRequest()).scheduler_mode == mode
            assert wait_until(lambda: srv.engine.kv_all_free(), 10)
        finally:
            srv.stop()
    assert results["normal"] == results["overlap"]


def test_trace_file_and_busy_stats(tiny_llama_dir, tmp_path):
    trace = tmp_path / "trace.json"
    c = SyncClient(
        ServerArgs(
            dtype="float32",
            loop="overlap",
            kv_cache_tokens=2000,
            max_running_requests=8,
            trace_file=str(trace),
        ),
        tiny_llama_dir,
    )
    try:
        before = time.perf_counter()
        c.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
        after = time.perf_counter()
        stats = c.engine.stats()
        assert 0 < stats.forward_busy_fraction <= 1 and stats.forward_steps >= 20
    finally:
        c.close()
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    # the clock origin puts the spans on the caller's perf_counter clock (a client lines its stamps up)
    origin = doc["otherData"]["clock_origin_s"]
    forwards = [origin + e["ts"] / 1e6 for e in events if e["ph"] == "X" and e["name"].startswith("forward")]
    assert forwards and before <= min(forwards) and max(forwards) <= after
    assert names == {"scheduler", "forward"}
    assert any(e["name"].startswith("forward decode") for e in events if e["ph"] == "X")
    assert any(e["name"].startswith("process decode") for e in events if e["ph"] == "X")
