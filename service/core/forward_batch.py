"""What one forward pass reads: plain tensors built by the scheduler.

A ForwardBatch is a snapshot: the scheduler builds fresh tensors for every
batch and never mutates them afterwards, so the forward thread can read them
while the scheduler already forms the next batch. Tensors live on the engine's
device (sent from pinned host buffers on CUDA); fields named `*_cpu`, the
SamplingBatch flags and `extend_lens` are host values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class ForwardMode(Enum):
    EXTEND = "extend"  # prompt tokens (prefill), several per request
    DECODE = "decode"  # one token per request


@dataclass
class SamplingBatch:
    """Per-row sampling settings of a batch (row i = request i)."""

    temperatures: torch.Tensor  # [bs] float32; 0 = greedy
    top_ks: torch.Tensor  # [bs] int64; vocab size = no top-k
    top_ps: torch.Tensor  # [bs] float32
    min_ps: torch.Tensor  # [bs] float32
    repetition_penalties: torch.Tensor  # [bs] float32
    frequency_penalties: torch.Tensor  # [bs] float32
    presence_penalties: torch.Tensor  # [bs] float32
    seeds: torch.Tensor  # [bs] int64
    steps: torch.Tensor  # [bs] int64: index of the output token being sampled
    req_slots: torch.Tensor  # [bs] int64: rows of the per-request sampling state
    all_greedy: bool
    need_top_k_p: bool
    need_min_p: bool
    need_penalties: bool
    # (row, token) pairs to forbid this step: EOS / stop ids before min_new_tokens.
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    # (row, token, bias) triples added to the logits: the requests' logit_bias.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None  # float32
    # [bs] bool: rows whose token counts (penalty state); None = all. A non-final prompt chunk's does not.
    kept: torch.Tensor | None = None


class FeatureData:
    """What features attach to a batch on the scheduler thread for its forward-thread hooks: at most
    one dataclass per feature, defined with the feature and keyed by its type (e.g.
    features/multimodal.py's ImageSplices), so a hook reads back exactly the type it wrote."""

    def __init__(self) -> None:
        self._items: dict[type, object] = {}

    def put(self, item: object) -> None:
        self._items[type(item)] = item

    def get(self, kind: type[T]) -> T | None:
        item = self._items.get(kind)
        assert item is None or isinstance(item, kind)
        return item

    def __getitem__(self, kind: type[T]) -> T:
        item = self._items[kind]
        assert isinstance(item, kind)
        return item

    def __contains__(self, kind: type) -> bool:
        return kind in self._items

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class StateCopies:
    """Recurrent layers' states copied between rows of the engine's SlotStates before the model runs
    (service/engine/state_snapshots.py): the saves (request slot -> snapshot row), then the restores
    (snapshot row -> request slot); each a (source rows, destination rows) pair of int64 tensors."""

    saves: tuple[torch.Tensor, torch.Tensor] | None = None
    restores: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ForwardBatch:
    """Inputs of one forward + sampling step, for bs requests and T tokens."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64; negative entries are future-token placeholders
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV pool rows written by this step
    kv_indices: torch.Tensor  # [bs, L] int64: KV pool rows each request attends to (pad: 0)
    q_positions: torch.Tensor  # [bs, Lq] int64: absolute position of each padded query (pad: 0)
    logits_index: torch.Tensor  # [bs] int64: packed row of each request's last token
    sampling: SamplingBatch
    # EXTEND only: packed <-> padded query layout, and the prompts of new requests.
    q_pad_index: torch.Tensor | None = None  # [bs*Lq] packed row per padded slot (T = zero row)
    q_unpad_index: torch.Tensor | None = None  # [T] padded slot per packed row
    extend_lens: list[int] | None = None  # tokens of each request in this batch (its chunk)
    new_slots: torch.Tensor | None = None  # [n] request slots whose sampling state is reset
    new_prompts: list[torch.Tensor] = field(default_factory=list)  # prompt ids per new slot
    # Features this batch carries, with their active rows (forward-thread hooks).
    features: list[tuple[Any, list[int]]] = field(default_factory=list)
    # Per-feature data attached on the scheduler thread, one dataclass per feature, by type.
    feature_data: FeatureData = field(default_factory=FeatureData)
    # Packed rows whose logits are wanted besides each request's last one (input logprobs).
    extra_logit_rows: torch.Tensor | None = None
    # Paged-kernel metadata (device): KV length of each request including this step's tokens,
    # cached-prefix length, and first packed row of each request's new tokens.
    seq_lens: torch.Tensor | None = None  # [bs] int64
    extend_prefix_lens: torch.Tensor | None = None  # [bs] int64
    extend_start_loc: torch.Tensor | None = None  # [bs] int64
    max_extend_len: int = 1  # host: longest new-token run (grid size of extend kernels)
    # Host copies the scheduler thread may read without touching the device.
    extend_prefix_lens_cpu: list[int] | None = None
    extend_start_loc_cpu: list[int] | None = None
    # EXTEND: per request, whether its one token continues the output (a decode in a mixed batch)
    extend_decodes_cpu: list[bool] | None = None
    # EXTEND: (slot, token) pairs of the new requests' prompts (sampler penalty state, device).
    new_prompt_slots: torch.Tensor | None = None
    new_prompt_tokens: torch.Tensor | None = None
    # Recurrent layers' states saved and restored (prefix cache) before the model runs.
    state_copies: StateCopies | None = None
    # Set at launch: the scheduler stream's work for this batch is done (the forward waits on it).
    ready: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.logits_index.shape[0])


@dataclass
class BatchResult:
    """What a step returns to the scheduler: sampled ids, and feature outputs by name."""

    ids: torch.Tensor  # [bs] int64 (host; pinned on CUDA)
    # after_sampling outputs by feature name: each the feature's own dataclass of host tensors.
    extras: dict[str, Any] = field(default_factory=dict)
    # Recorded on the forward stream after the copies to host: the scheduler's only wait.
    copy_done: Any = None

    def synchronize(self) -> None:
        if self.copy_done is not None:
            self.copy_done.synchronize()

    @property
    def tokens(self) -> list[int]:
        return self.ids.tolist()


@dataclass
class LogitsOutput:
    """The model's raw logits of one step (float32), before any processing."""

    next_token: torch.Tensor  # [bs, vocab]: at each request's last token
    extra: torch.Tensor | None = None  # [len(extra_logit_rows), vocab]
