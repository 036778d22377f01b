"""The model worker: one forward + sampling step for a ForwardBatch, on the forward stream.

`step` is what both loops call (the normal loop on the scheduler thread, the
overlap loop on the forward thread): on the forward stream it waits for the
batch's `ready` event (the GPU waits, not the host), resolves future tokens on
the device, runs the model and the sampler, stores the sampled ids in the
FutureMap, starts the copies of the results into pinned host memory and
records `copy_done` — the one event the scheduler waits on. Nothing between
the launch and that copy reads a device value on the host (tests enforce it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from service.core.device import CPU, Device
from service.core.forward_batch import BatchResult, ForwardBatch, ForwardMode, LogitsOutput
from service.engine.cpu_threads import AdaptiveTeam
from service.engine.kv_cache import TokenToKVPool
from service.engine.sampler import Sampler
from service.engine.timeline import FORWARD_TID, Timeline
from service.models.layers import CausalLM

if TYPE_CHECKING:
    from service.engine.future_map import FutureMap


class ModelWorker:
    """Runs the model and the sampler. Called from exactly one thread at a time."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: TokenToKVPool,
        sampler: Sampler,
        attention: Any,
        timeline: Timeline,
        device: Device = CPU,
        cpu_team: AdaptiveTeam | None = None,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.sampler = sampler
        self.attention = attention
        self.timeline = timeline
        self.device = device
        self.cpu_team = cpu_team  # CPU: the forward's OpenMP team, shrunk while the CPUs are contended
        self.stream = device.new_stream()  # the forward stream
        self.graphs = None  # CUDA graphs for decode (service/engine/cuda_graph.py), set by the engine

    def step(
        self,
        fb: ForwardBatch,
        label: str = "forward",
        future_map: "FutureMap | None" = None,
        slots: torch.Tensor | None = None,
    ) -> BatchResult:
        """Enqueue one step on the forward stream. The result's host tensors are valid
        once `result.synchronize()` returned (copy_done)."""
        dev = self.device
        with dev.use_stream(self.stream):
            if fb.ready is not None:
                self.stream.wait_event(fb.ready)
            timing = self.timeline.device_timing
            if timing:
                t0 = dev.new_event(timing=True)
                t0.record(self.stream)
            input_ids = fb.input_ids if future_map is None else future_map.resolve(fb.input_ids)
            ids, extras = self.forward(fb, input_ids, label)
            if future_map is not None and slots is not None:
                future_map.store(slots, ids)
            if timing:
                t1 = dev.new_event(timing=True)
                t1.record(self.stream)
                self.timeline.add_device_span(fb.mode.value, t0, t1)
            result = BatchResult(dev.to_host(ids), dev.tree_to_host(extras))
            result.copy_done = dev.record_event(self.stream)
        return result

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, input_ids: torch.Tensor, label: str = "forward"
    ) -> tuple[torch.Tensor, dict]:
        """Sample the next token of each row (device ids, device extras). `input_ids` holds real tokens only.

        Feature hooks run here, on whichever thread runs the forward: before the
        model, on the logits before sampling, and after sampling (raw logits are
        those of the model, before any feature or penalty touched them).
        """
        start = time.perf_counter()
        if self.cpu_team is not None:
            self.cpu_team.forward_started(decode=fb.mode is ForwardMode.DECODE)
        for feature, _ in fb.features:
            feature.before_forward(fb)
        if fb.state_copies is not None:  # the prefix cache's recurrent states (state_snapshots.py)
            self.kv_pool.states.apply(fb.state_copies)  # type: ignore[union-attr]
        if fb.new_slots is not None:
            self.sampler.reset_slots(fb.new_slots, fb.new_prompt_slots, fb.new_prompt_tokens)
        if self.graphs is not None and self.graphs.can_run(fb):
            logits = self.graphs.run(fb, input_ids)
        else:
            logits = self.model(fb, input_ids, self.kv_pool, self.attention)
        bs = fb.batch_size
        if any(
            f.reads_raw_logits for f, _ in fb.features
        ):  # they see float32; others sample from the model's dtype
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
        if self.cpu_team is not None:
            self.cpu_team.forward_ended(fb.batch_size if fb.mode is ForwardMode.DECODE else None)
        self.timeline.add(
            FORWARD_TID,
            f"{label} {fb.mode.value}",
            start,
            time.perf_counter(),
            {"bs": fb.batch_size, "tokens": int(input_ids.numel())},
        )
        return ids, extras
