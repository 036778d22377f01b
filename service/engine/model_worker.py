"""The model worker: one forward + sampling step for a ForwardBatch."""

from __future__ import annotations

import time

import torch

from service.engine.forward_batch import BatchResult, ForwardBatch, LogitsOutput
from service.engine.kv_cache import TokenToKVPool
from service.engine.sampler import Sampler
from service.engine.timeline import FORWARD_TID, Timeline
from service.models.attention import TorchAttention
from service.models.llama import LlamaModel


class ModelWorker:
    """Runs the model and the sampler. Called from exactly one thread at a time."""

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: TokenToKVPool,
        sampler: Sampler,
        attention: TorchAttention,
        timeline: Timeline,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.sampler = sampler
        self.attention = attention
        self.timeline = timeline
        # Test hook: called with each ForwardBatch before the forward (fault injection).
        self.before_forward = None

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, input_ids: torch.Tensor, label: str = "forward") -> BatchResult:
        """Sample the next token of each row. `input_ids` holds real tokens only.

        Feature hooks run here, on whichever thread runs the forward: before the
        model, on the logits before sampling, and after sampling (raw logits are
        those of the model, before any feature or penalty touched them).
        """
        start = time.perf_counter()
        if self.before_forward is not None:
            self.before_forward(fb)
        for feature, _ in fb.features:
            feature.before_forward(fb)
        if fb.new_slots is not None:
            self.sampler.reset_slots(fb.new_slots, fb.new_prompts)
        logits = self.model(fb, input_ids, self.kv_pool, self.attention)
        bs = fb.batch_size
        if fb.features:  # feature hooks see float32 logits; a plain batch samples from the model's dtype
            logits = logits.float()
        raw = LogitsOutput(logits[:bs], logits[bs:] if fb.extra_logit_rows is not None else None)
        logits = raw.next_token
        for feature, _ in fb.features:
            logits = feature.process_logits(fb, logits)
        ids = self.sampler.sample(logits, fb.sampling)
        extras = {}
        for feature, _ in fb.features:
            extra = feature.after_sampling(fb, raw, ids)
            if extra is not None:
                extras[feature.name] = extra
        self.timeline.add(
            FORWARD_TID, f"{label} {fb.mode.value}", start, time.perf_counter(), {"bs": fb.batch_size, "tokens": int(input_ids.numel())}
        )
        return BatchResult(ids, extras)
