"""Which decode batches a CUDA graph may run, decided per batch on CPU (no capture needed)."""

from __future__ import annotations

import torch

from features.multimodal import ImageSplices, MultimodalFeature
from service.core.feature import Feature
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
    fb.feature_data[mm.name] = ImageSplices([(0, torch.zeros(16, 8), 0, 16)])  # rows to splice: eager
    assert not graphs.can_run(fb)
    fb.feature_data.clear()
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
