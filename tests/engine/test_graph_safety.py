"""Which decode batches a CUDA graph may run, decided per batch on CPU (no capture needed)."""

from __future__ import annotations

import torch

from features.multimodal import ImageSplice, ImageSplices, MultimodalFeature
from service.core.feature import Feature
from service.core.forward_batch import FeatureData
from service.engine.cuda_graph import DecodeGraphs


class EmbeddingNoise(Feature):
    """Overrides modify_embeddings and says nothing more: it changes every batch it is in."""

    name = "test_noise"

    def modify_embeddings(self, fb, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + 1


def test_decode_graph_runs_image_requests_once_their_images_are_spliced():
    graphs = DecodeGraphs(None, None, None, torch.device("cpu"), max_bs=8, max_context=32)
    fb = graphs.static_batch(4)
    mm = MultimodalFeature()
    fb.features = [(mm, [0, 2])]  # decode rows of image requests: their images went in at prefill
    assert graphs.can_run(fb)
    fb.feature_data.put(ImageSplices([ImageSplice(0, torch.zeros(16, 8), 0, 16)]))  # rows to splice: eager
    assert not graphs.can_run(fb)
    fb.feature_data = FeatureData()
    fb.features = [(mm, [0]), (EmbeddingNoise(), [1])]
    assert not graphs.can_run(fb)  # a hook without its own changes_embeddings: never replayed


def test_feature_hooks_on_the_forward_thread_make_no_host_sync(tiny_llama_dir):
    """Constrained masks, logprobs (top-5 and input), and the re-prefills of retracted penalised
    requests: every forward-thread hook under the host-sync detector, in the overlap loop."""
    from service.config import ServerArgs
    from service.core.request import SamplingParams
    from service.engine.engine import SyncClient, collect
    from tests.engine.test_device_path import watch_forward

    found: list[str] = []
    args = ServerArgs(
        dtype="float32",
        loop="overlap",
        kv_cache_tokens=100,
        max_running_requests=8,
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.05,
        chunked_prefill_size=0,
    )
    c = SyncClient(args, tiny_llama_dir)
    watch_forward(c, found)
    try:
        # The grammar compiled first: else, on a loaded machine, the constrained requests are admitted
        # after the others have finished and the pool never runs short (no retraction).
        backend = c.engine.features.features["constrained"].backend
        assert backend.wait_ready(120)
        backend.compile("regex", "[a-z ]{30,60}").result(timeout=120)
        prompts = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(8)]
        params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, repetition_penalty=1.2)
        feats = [
            {"constrained": dict(kind="regex", text="[a-z ]{30,60}")}
            if i % 2
            else {"logprobs": dict(return_logprob=True, top_logprobs_num=5, logprob_start_len=0)}
            for i in range(8)
        ]
        outs = c.generate(prompts, params, feats)
        assert all(collect(o)[2].error is None for o in outs)
        assert c.engine.stats().retractions > 0
    finally:
        c.close()
    assert found == [], f"host syncs in the forward path: {sorted(set(found))}"


class EagerReplay:
    """Stands in for a captured decode graph on CPU: `replay` runs the model on the graph's static
    buffers and writes its static output, as the captured kernels would."""

    def __init__(self, graphs: DecodeGraphs, bs: int):
        self.graphs, self.fb = graphs, graphs.static_batch(bs)
        self.out = graphs.outputs[bs]

    def replay(self) -> None:
        g = self.graphs
        self.out.copy_(g.model(self.fb, self.fb.input_ids, g.kv_pool, g.attention))


def emulate_graphs(worker, max_bs: int, max_context: int, vocab: int) -> DecodeGraphs:
    graphs = DecodeGraphs(
        worker.model, worker.kv_pool, worker.attention, torch.device("cpu"), max_bs, max_context
    )
    for bs in graphs.buckets:
        graphs.outputs[bs] = torch.empty(bs, vocab)
        graphs.graphs[bs] = EagerReplay(graphs, bs)  # type: ignore[assignment]
    worker.graphs = graphs
    return graphs


def test_decode_through_the_graphs_static_buffers_matches_eager(tiny_llama_dir):
    """The graph path's staging on CPU: every decode step copies its batch
    into the same static buffers, pads to the bucket with rows that touch only the pool's row 0, and
    the tokens (overlap loop) equal the eager engine's (normal loop) as batches shrink across buckets."""
    from service.config import ServerArgs
    from service.core.request import SamplingParams
    from service.engine.engine import SyncClient, collect

    prompts = [[5 + i, 6, 7, 8, 9][: 2 + i % 4] for i in range(6)]
    params = [SamplingParams(temperature=0, max_new_tokens=2 + i, ignore_eos=True) for i in range(6)]
    results = {}
    for loop, graphed in (("normal", False), ("overlap", True)):
        args = ServerArgs(
            dtype="float32",
            attention_backend="torch",
            loop=loop,
            kv_cache_tokens=400,
            max_running_requests=6,
        )
        c = SyncClient(args, tiny_llama_dir)
        try:
            graphs = None
            if graphed:
                graphs = emulate_graphs(c.engine.worker, 6, c.engine.context_length, c.engine.vocab_size)
                buffers = [t.data_ptr() for t in (graphs.input_ids, graphs.positions, graphs.kv_indices)]
            results[(loop, graphed)] = [collect(o)[0] for o in c.generate(prompts, params)]
            if graphs is not None:
                assert graphs.replays > 0
                assert [
                    t.data_ptr() for t in (graphs.input_ids, graphs.positions, graphs.kv_indices)
                ] == buffers
            assert c.engine.kv_all_free()
        finally:
            c.close()
    assert results[("overlap", True)] == results[("normal", False)]


def test_capture_runs_thread_local_and_without_the_garbage_collector(monkeypatch):
    """On the H200 a capture failed ("operation not permitted when stream is capturing") when a
    collection during it freed an earlier engine's graphs; another thread's CUDA call would do the
    same in the default (global) capture mode. The capture is thread-local and runs without the
    collector, which is back on afterwards."""
    import contextlib
    import gc

    seen: list[tuple[str, bool]] = []

    class FakeGraph:
        def pool(self):
            return "pool"

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None, capture_error_mode="global"):
        seen.append((capture_error_mode, gc.isenabled()))
        yield

    class FakeStream:
        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)

    def model(fb, input_ids, kv_pool, attention):
        return torch.zeros(fb.batch_size, 4)

    graphs = DecodeGraphs(model, None, None, torch.device("cpu"), max_bs=8, max_context=32)
    assert gc.isenabled()
    graphs.capture()
    assert seen == [("thread_local", False)] * len(graphs.buckets)
    assert gc.isenabled()
    assert sorted(graphs.graphs) == graphs.buckets
