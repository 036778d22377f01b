"""CUDA graphs for decode: one captured model forward per padded batch size.

A small model's decode step is a thousand small kernels; launched one by one
from Python the step is bound by the host, not the GPU. Captured once per
batch-size bucket at start-up, a step is a few input copies and one replay.

Static inputs live in buffers sized for the largest bucket. Before a replay
the forward stream copies the batch's (already future-resolved) input ids,
positions, KV rows and lengths into them; padding rows decode token 0 at
position 0 and write the pool's reserved row 0, so they touch nothing real.
The graph covers the model only: sampling, penalties and feature hooks run
eagerly on its logits (a view of the graph's output, consumed in stream order
before the next replay). Batches the graph cannot express (extend, input
logprob rows, a feature changing this batch's embeddings, too large) run eagerly: a decode batch
of image requests replays (their images were spliced in at prefill).
"""

from __future__ import annotations

import bisect
import gc
import logging

import torch

from service.core.forward_batch import ForwardBatch, ForwardMode

log = logging.getLogger("zerogap.cuda_graph")


def graph_buckets(max_bs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, and max_bs."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class DecodeGraphs:
    """Captured decode forwards by padded batch size, and their static inputs."""

    def __init__(self, model, kv_pool, attention, device: torch.device, max_bs: int, max_context: int):
        self.model, self.kv_pool, self.attention = model, kv_pool, attention
        self.buckets = graph_buckets(max_bs)
        self.max_bs, self.max_context = max_bs, max_context
        z = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **z)
        self.positions = torch.zeros(max_bs, **z)
        self.out_cache_loc = torch.zeros(max_bs, **z)  # row 0: the pool's never-allocated row
        self.seq_lens = torch.ones(max_bs, **z)
        self.kv_indices = torch.zeros(max_bs, max_context, **z)
        self.logits_index = torch.arange(max_bs, **z)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            kv_indices=self.kv_indices[:bs],
            q_positions=self.positions[:bs].unsqueeze(1),
            logits_index=self.logits_index[:bs],
            sampling=None,  # type: ignore[arg-type]  # the graph covers the model only
            seq_lens=self.seq_lens[:bs],
            extend_prefix_lens=self.positions[:bs],
            extend_start_loc=self.logits_index[:bs],
            max_extend_len=1,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every bucket, largest first (one memory pool).

        A capture fails if a CUDA call that is illegal while capturing runs meanwhile: from another
        thread (the grammar set-up, the gRPC server), or from a garbage collection on this one that
        frees CUDA objects (an earlier engine's graphs: seen on the H200 as a failed capture and
        eager decode). So the capture is thread-local, and the collector does not run during it."""
        torch.cuda.synchronize()  # weights, pools and static buffers were filled on the default stream
        stream = torch.cuda.Stream()
        pool = None
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            for bs in reversed(self.buckets):
                fb = self.static_batch(bs)
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self.model(fb, fb.input_ids, self.kv_pool, self.attention)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.outputs[bs] = self.model(fb, fb.input_ids, self.kv_pool, self.attention)
                pool = graph.pool()
                self.graphs[bs] = graph
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize()

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.mode is ForwardMode.DECODE
            and fb.batch_size <= self.max_bs
            and fb.kv_indices.shape[1] <= self.max_context
            and fb.extra_logit_rows is None
            and not any(f.changes_embeddings(fb) for f, _ in fb.features)
        )

    def run(self, fb: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch (current stream: the forward stream)."""
        bs = fb.batch_size
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        width = fb.kv_indices.shape[1]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.kv_indices[:bs, :width].copy_(fb.kv_indices)
        if bucket > bs:  # padding rows: token 0 at position 0, written to row 0
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
            self.out_cache_loc[bs:bucket].zero_()
            self.seq_lens[bs:bucket].fill_(1)
        self.graphs[bucket].replay()
        self.replays += 1
        return self.outputs[bucket][:bs]


def build_decode_graphs(
    model, kv_pool, attention, device: torch.device, max_bs: int, max_context: int
) -> DecodeGraphs | None:
    """Capture, or None (with a warning) when capture fails: the engine then runs eagerly."""
    graphs = DecodeGraphs(model, kv_pool, attention, device, max_bs, max_context)
    try:
        graphs.capture()
    except Exception:
        log.exception("CUDA graph capture failed; decode runs eagerly")
        return None
    return graphs
