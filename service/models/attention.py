"""Attention backends over the paged KV pool.

`torch` (CPU and anywhere): gathers each request's KV rows into a padded
[bs, L] block and runs one batched SDPA for the whole batch, extend and decode
alike, with no per-request Python loop. A `triton` backend (paged kernels on
GPU) can be added beside it by implementing the same `forward` signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.forward_batch import ForwardBatch, ForwardMode


class AttentionMeta:
    """Per-batch tensors every layer reuses (built once per forward)."""

    def __init__(self, fb: ForwardBatch, num_q_heads: int, num_kv_heads: int, sliding_window: int | None = None):
        bs, lq = fb.q_positions.shape
        group = num_q_heads // num_kv_heads
        self.fb = fb
        self.bs, self.lq, self.group = bs, lq, group
        kv_pos = torch.arange(fb.kv_indices.shape[1], device=fb.kv_indices.device)
        # Query row (bs, lq) sees kv position p when p <= its own position;
        # padding rows sit at position 0 so no row is fully masked.
        q_pos = fb.q_positions.unsqueeze(-1)
        mask = kv_pos.view(1, 1, -1) <= q_pos  # [bs, lq, L]
        if sliding_window is not None:  # Mistral-style: only the last `sliding_window` positions
            mask &= kv_pos.view(1, 1, -1) > q_pos - sliding_window
        # GQA: the group's query heads share a kv head -> rows (lq, group).
        self.mask = mask.unsqueeze(2).expand(bs, lq, group, -1).reshape(bs, 1, lq * group, -1)


class TorchAttention:
    """Paged attention with torch ops (SDPA) — the CPU backend."""

    name = "torch"

    def prepare(self, fb: ForwardBatch, num_q_heads: int, num_kv_heads: int, sliding_window: int | None = None) -> AttentionMeta:
        return AttentionMeta(fb, num_q_heads, num_kv_heads, sliding_window)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [pool, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMeta,
        scale: float,
    ) -> torch.Tensor:
        fb = meta.fb
        k_cache[fb.out_cache_loc] = k
        v_cache[fb.out_cache_loc] = v
        bs, lq, g = meta.bs, meta.lq, meta.group
        hkv, d = k.shape[1], k.shape[2]
        if fb.mode is ForwardMode.DECODE:
            qp = q.view(bs, 1, hkv, g, d)
        else:
            q_ext = torch.cat([q, q.new_zeros(1, q.shape[1], d)])
            qp = q_ext[fb.q_pad_index].view(bs, lq, hkv, g, d)
        qp = qp.permute(0, 2, 1, 3, 4).reshape(bs, hkv, lq * g, d)
        kp = k_cache[fb.kv_indices].transpose(1, 2)  # [bs, Hkv, L, D]
        vp = v_cache[fb.kv_indices].transpose(1, 2)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, scale=scale)
        out = out.view(bs, hkv, lq, g, d).permute(0, 2, 1, 3, 4).reshape(bs * lq, hkv * g * d)
        if fb.mode is ForwardMode.DECODE:
            return out
        return out[fb.q_unpad_index]


def get_attention_backend(name: str) -> TorchAttention:
    if name == "torch":
        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (available: torch)")
