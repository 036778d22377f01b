"""The matrix counters can fail a "full" declaration: overlap-loop batches that waited anyway are
counted per feature (`batches_synced`), from what happened, not from what was declared."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from service.config import ServerArgs
from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch
from service.core.request import SamplingParams
from service.engine.engine import SyncClient


@dataclass
class LateMask:
    """The test features' batch data (`fb.feature_data`, keyed by type)."""

    at_sampling: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)
    waited: bool = False


class OnTimeMask(LateMask):
    pass


class LateMaskFeature(Feature):
    """Declared full, but its forward always reaches sampling before the scheduler's work is done:
    after_launch finishes only once the forward waits for it (deterministically a sync point)."""

    name = "test_late"
    support = OverlapSupport.FULL
    reason = "test-only: claims full, waits at sampling"
    reads_raw_logits = False
    data_type: type[LateMask] = LateMask

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> bool:
        return True

    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        batch.fb.feature_data.put(self.data_type())

    def after_launch(self, batch: BatchView, rows: list[int]) -> None:
        data = batch.fb.feature_data[self.data_type]
        data.at_sampling.wait(30)
        data.ready.set()

    def process_logits(self, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        data = fb.feature_data[self.data_type]
        data.waited = not data.ready.is_set()
        data.at_sampling.set()
        data.ready.wait(30)
        return logits

    def waited_on_host(self, batch: BatchView) -> bool:
        return batch.fb.feature_data[self.data_type].waited


class OnTimeFeature(LateMaskFeature):
    """The same hooks, but the scheduler's work is done before the forward starts: never waits."""

    name = "test_on_time"
    data_type = OnTimeMask

    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        super().on_batch_formed(batch, rows)
        data = batch.fb.feature_data[self.data_type]
        data.at_sampling.set()
        data.ready.set()


def test_full_feature_that_waits_is_counted_synced(tiny_llama_dir):
    args = ServerArgs(dtype="float32", loop="overlap", kv_cache_tokens=1024, max_running_requests=8)
    client = SyncClient(args, tiny_llama_dir, features=[LateMaskFeature(), OnTimeFeature()])
    try:
        params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
        prompts = [[5 + i, 17, 300 + i] for i in range(4)]
        feats = [{"test_late": True} if i % 2 else {"test_on_time": True} for i in range(4)]
        client.generate(prompts, params, feats)
        rows = {r.feature: r for r in client.engine.features.matrix()}
    finally:
        client.close()
    late, on_time = rows["test_late"], rows["test_on_time"]
    assert late.batches_overlapped > 0 and late.batches_synced == late.batches_overlapped
    assert on_time.batches_overlapped > 0 and on_time.batches_synced == 0
    assert late.batches_fallback == on_time.batches_fallback == 0


def test_prefix_cache_row_counts_the_batches_that_hit(tiny_llama_dir):
    """The prefix cache is an engine mechanism (no request carries it): its row counts the prefill
    batches whose rows start from a cached prefix, and nothing before a hit."""
    args = ServerArgs(dtype="float32", loop="overlap", kv_cache_tokens=1024, max_running_requests=8)
    client = SyncClient(args, tiny_llama_dir)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
        shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 3
        client.generate([shared + [40]], params)
        row = {r.feature: r for r in client.engine.features.matrix()}["prefix_cache"]
        assert row.batches_overlapped == 0
        client.generate([shared + [41], shared + [42]], params)  # two hits, in one prefill batch or two
        row = {r.feature: r for r in client.engine.features.matrix()}["prefix_cache"]
    finally:
        client.close()
    # The second request may arrive after the first's prefill was formed (a loaded machine): two batches.
    assert row.batches_overlapped in (1, 2) and row.batches_synced == row.batches_fallback == 0
