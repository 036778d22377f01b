"""Chunked prefill and mixed batches, fully overlapped: the module's declaration and counters.

A prompt longer than the step's token budget (`--chunked-prefill-size`) is split
across steps; the request keeps its slot and KV between chunks and emits nothing
until its last chunk. With `--enable-mixed-chunk` the chunk rides in one EXTEND
batch with the running decodes (one-token rows on top of their cached KV), whose
inputs may be future placeholders — resolved on the device like any other. Batch
formation lives with the scheduler (service/engine/chunking.py); this module is
what the matrix shows and counts. It takes no per-request payload: it is a server
setting, and `--disable-feature chunked_prefill` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.feature import Feature, OverlapSupport


@dataclass
class ChunkCounters:
    chunks: int = 0  # prompt chunks launched (final ones included)
    chunked_requests: int = 0  # requests whose prompt was split
    mixed_steps: int = 0  # EXTEND steps that carried decode rows
    mixed_decode_rows: int = 0  # decode rows carried by them


class ChunkedPrefill(Feature):
    name = "chunked_prefill"
    support = OverlapSupport.FULL
    reason = ("chunks and decode rows are rows of one extend batch; decode inputs are future placeholders "
              "resolved on the device, a non-final chunk's token is dropped at result time")
    reads_raw_logits = False  # no forward-thread work: never forces a float copy of the logits

    def __init__(self) -> None:
        self.stats = ChunkCounters()

    def active_for(self, req: object) -> bool:
        return False  # never a per-request feature: the scheduler adds it to the batches it shapes

    def counters(self) -> dict[str, int]:
        return dict(vars(self.stats))
