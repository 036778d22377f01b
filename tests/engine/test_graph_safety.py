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
