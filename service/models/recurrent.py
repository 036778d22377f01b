"""What the recurrent layers share (Gated DeltaNet: gated_delta.py; LFM2's short conv: short_conv.py).

Such a layer takes attention's place and keeps, per request slot, states instead of K/V rows (the
engine's `SlotStates`, service/engine/kv_cache.py): what it left after the slot's last token. The
forward reads and writes them in launch order, so the overlap loop needs nothing more; a request
whose prompt starts in a batch (a new one, a retracted one re-prefilled, a slot's next owner) starts
from zeros, unless the prefix cache copied a snapshot of the states after its cached prefix into its
slot first (a cached prefix's K/V rows say nothing of them: service/engine/state_snapshots.py).

Here: `RecurrentRows` (where a batch's requests' states and tokens are), the `RecurrentMixer`
protocol a layer's shape meets, and the short causal depthwise conv over each slot's last inputs
that both layers run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from service.core.forward_batch import ForwardBatch, ForwardMode

StateSpec = list[tuple[tuple[int, ...], torch.dtype]]  # per slot: each state's shape and dtype


class RecurrentMixer(Protocol):
    """A recurrent layer's shape (ModelShape.recurrent): its per-slot states and its module, called
    as attention is, with its states and the batch's RecurrentRows in place of K/V and metadata."""

    def state_shapes(self, dtype: torch.dtype) -> StateSpec: ...

    def build(self, hidden_size: int) -> nn.Module: ...


@dataclass
class StepRows:
    """The decodes of a batch (every request of a decode batch, the decodes riding in a mixed one):
    their slots, their tokens' packed rows (None: rows 0..n-1, a decode batch), and which continue
    their slot's states (None: all)."""

    slots: torch.Tensor  # [n] int64
    rows: torch.Tensor | None = None  # [n] int64
    keep: torch.Tensor | None = None  # [n] bool


@dataclass
class ChunkRows:
    """The requests with several tokens in an extend batch, laid out right-padded [m, L]: `packed`
    gives each padded position's packed row (a valid one for padding too), `valid` which positions
    are real, `rows` the real ones' packed rows in order; `keep` as StepRows'."""

    slots: torch.Tensor  # [m] int64
    lens: torch.Tensor  # [m] int64
    packed: torch.Tensor  # [m, L] int64
    valid: torch.Tensor  # [m, L] bool
    rows: torch.Tensor  # [sum(lens)] int64
    keep: torch.Tensor  # [m] bool


@dataclass
class RecurrentRows:
    """Which slot's states each request of a batch reads and writes, and where its tokens are: built
    once per forward. Decodes (also those riding in a mixed batch) run the recurrence a step for all
    at once; prompt tokens run it chunked, right-padded together (a decode padded to a prompt
    chunk's length would cost that chunk's work)."""

    steps: StepRows | None = None
    chunks: ChunkRows | None = None

    @classmethod
    def of(cls, fb: ForwardBatch) -> RecurrentRows:
        slots = fb.sampling.req_slots
        if fb.mode is ForwardMode.DECODE:
            return cls(StepRows(slots))
        assert fb.extend_lens is not None and fb.extend_prefix_lens_cpu is not None
        dev = slots.device
        lens = torch.tensor(fb.extend_lens)
        starts = torch.cumsum(lens, 0) - lens
        keep = torch.tensor([p > 0 for p in fb.extend_prefix_lens_cpu])
        # decodes riding in the batch step; prompt tokens run chunked, even one (a layer may differ
        # between the forms: Mamba-2 clamps dt in the chunked one only, as transformers does)
        one = torch.tensor(fb.extend_decodes_cpu or [False] * len(fb.extend_lens)) & (lens == 1)
        steps = chunks = None
        if bool(one.any()):
            i = one.nonzero().flatten()
            steps = StepRows(slots[i.to(dev)], starts[i].to(dev), keep[i].to(dev))
        if not bool(one.all()):
            i = (~one).nonzero().flatten()
            n = lens[i]
            t = torch.arange(int(n.max()))
            valid = t.unsqueeze(0) < n.unsqueeze(1)
            packed = (starts[i].unsqueeze(1) + t).clamp(max=int(lens.sum()) - 1)
            chunks = ChunkRows(
                slots[i.to(dev)], *(x.to(dev) for x in (n, packed, valid, packed[valid], keep[i]))
            )
        return cls(steps, chunks)

    def run(
        self,
        step: Callable[..., torch.Tensor],
        chunk: Callable[..., torch.Tensor],
        inputs: tuple[torch.Tensor, ...],
        width: tuple[int, ...],
    ) -> torch.Tensor:
        """A layer's float32 output per packed token [T, *width]: `step(*decodes' inputs, StepRows)`
        for the decodes, `chunk(*inputs, ChunkRows)` for the prompt tokens (each giving its
        requests' tokens in packed order); `inputs` are the layer's packed per-token tensors."""
        steps, chunks = self.steps, self.chunks
        if chunks is None and steps is not None and steps.rows is None:  # a decode batch
            return step(*inputs, steps)
        out = torch.empty(inputs[0].shape[0], *width, dtype=torch.float32, device=inputs[0].device)
        if steps is not None:
            out[steps.rows] = step(*(t[steps.rows] for t in inputs), steps)
        if chunks is not None:
            out[chunks.rows] = chunk(*inputs, chunks)
        return out


def read_states(states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The slots' states (a copy), zeros for the requests that do not continue theirs."""
    rows = states.index_select(0, slots)
    return rows if keep is None else rows * keep.view(-1, *([1] * (rows.dim() - 1)))


def _taps(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The causal depthwise conv over [B, K-1+n, C] (channels last, float32) -> [B, n, C]: a
    multiply-add per kernel tap (a grouped conv1d wants channels first and costs ~5x here)."""
    w = weight.float()
    out = window[:, :n] * w[:, 0]
    for j in range(1, w.shape[1]):
        out.addcmul_(window[:, j : j + n], w[:, j])
    return out if bias is None else out + bias.float()


def conv_extend(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: ChunkRows,
) -> torch.Tensor:
    """The chunked requests' packed inputs (x [T, C]) through the conv (weight [C, K]), each from its
    slot's last K-1 inputs (zeros where it starts afresh), the state moved on: [m, L, C] float32,
    right-padded as `rows` lays them out."""
    window = torch.cat(  # [m, K-1+L, C]: each request's last inputs, then its new ones
        [read_states(conv_state, rows.slots, rows.keep), x[rows.packed] * rows.valid.unsqueeze(-1)], dim=1
    )
    kept = weight.shape[1] - 1
    last = rows.lens.view(-1, 1, 1) + torch.arange(kept, device=x.device).view(1, -1, 1)
    conv_state.index_copy_(0, rows.slots, window.gather(1, last.expand(-1, -1, window.shape[-1])))
    return _taps(window.float(), weight, bias, rows.packed.shape[1])


def conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: StepRows
) -> torch.Tensor:
    """One new input per request (x [n, C]) through the conv: [n, C] float32; the state moved on."""
    window = torch.cat([read_states(conv_state, rows.slots, rows.keep), x.unsqueeze(1)], dim=1)  # [n, K, C]
    conv_state.index_copy_(0, rows.slots, window[:, 1:])
    return _taps(window.float(), weight, bias, 1)[:, 0]
