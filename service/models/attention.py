"""Attention backends over the paged KV pool.

A backend has a `name`, `prepare(fb, ...)` (per-batch metadata, built once per
forward and reused by every layer) and `forward(q, k, v, k_cache, v_cache,
meta, scale)`, which stores the step's K/V rows at `fb.out_cache_loc` and
attends over each request's rows of the pool (`fb.kv_indices`).

`torch` (the CPU backend):
- decode, and extends whose chunks are short: the native paged kernel
  (`cpu_kernels.py`) reads the pool rows in place — no gather, no padding;
- extends with a long chunk: one SDPA per request over that request's rows
  (gathered with index_select), so a prefill costs what its tokens cost
  whatever the mix of prompt lengths (no padding to the longest);
- without a C compiler: gather + one masked SDPA for decode, per-request SDPA
  for extend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.forward_batch import ForwardBatch, ForwardMode
from service.models import cpu_kernels

# Extend chunks up to this many tokens go through the paged kernel (its cost grows
# with tokens x context; SDPA's blocked matmuls win for long chunks).
KERNEL_MAX_EXTEND = 64


@dataclass
class AttentionMeta:
    """Per-batch tensors every layer reuses."""

    fb: ForwardBatch
    num_q_heads: int
    num_kv_heads: int
    sliding_window: int | None
    use_kernel: bool
    req_of: torch.Tensor | None = None  # [T] request row of each query token (kernel)
    decode_mask: torch.Tensor | None = None  # [bs, 1, g, L] (decode without the kernel)
    seq_lens: list[int] | None = None  # per request (per-request SDPA)
    extend_lens: list[int] | None = None
    q_starts: list[int] | None = None


def _decode_mask(fb: ForwardBatch, group: int, sliding_window: int | None) -> torch.Tensor:
    kv_pos = torch.arange(fb.kv_indices.shape[1]).view(1, -1)
    q_pos = fb.positions.view(-1, 1)
    mask = kv_pos <= q_pos
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    return mask.view(mask.shape[0], 1, 1, -1).expand(-1, 1, group, -1)


class TorchAttention:
    """Paged attention on CPU: the native kernel where it pays, SDPA elsewhere."""

    name = "torch"

    def __init__(self, use_kernel: bool = True):
        self.use_kernel = use_kernel

    def prepare(self, fb: ForwardBatch, num_q_heads: int, num_kv_heads: int, sliding_window: int | None) -> AttentionMeta:
        group = num_q_heads // num_kv_heads
        decode = fb.mode is ForwardMode.DECODE
        short = decode or max(fb.extend_lens or [0]) <= KERNEL_MAX_EXTEND
        use_kernel = self.use_kernel and short and group <= cpu_kernels.MAX_GROUP and cpu_kernels.available()
        meta = AttentionMeta(fb, num_q_heads, num_kv_heads, sliding_window, use_kernel)
        if use_kernel:
            bs = fb.batch_size
            meta.req_of = torch.arange(bs) if decode else torch.repeat_interleave(torch.arange(bs), torch.tensor(fb.extend_lens))
        elif decode:
            meta.decode_mask = _decode_mask(fb, group, sliding_window)
        else:
            assert fb.extend_lens is not None
            meta.seq_lens = fb.seq_lens.tolist()
            meta.extend_lens = list(fb.extend_lens)
            meta.q_starts = [0]
            for n in meta.extend_lens[:-1]:
                meta.q_starts.append(meta.q_starts[-1] + n)
        return meta

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
        if meta.use_kernel:
            assert meta.req_of is not None
            out = cpu_kernels.paged_attention(q, k_cache, v_cache, fb.kv_indices, meta.req_of, fb.positions, scale, meta.sliding_window)
            return out.view(q.shape[0], -1)
        if fb.mode is ForwardMode.DECODE:
            return self._decode_gathered(q, k_cache, v_cache, meta, scale)
        return self._extend_per_request(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def _decode_gathered(q, k_cache, v_cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
        fb = meta.fb
        bs, length = fb.kv_indices.shape
        hkv, d = k_cache.shape[1], k_cache.shape[2]
        rows = fb.kv_indices.reshape(-1)
        kp = k_cache.index_select(0, rows).view(bs, length, hkv, d).transpose(1, 2)  # [bs, Hkv, L, D]
        vp = v_cache.index_select(0, rows).view(bs, length, hkv, d).transpose(1, 2)
        qp = q.view(bs, hkv, -1, d)  # the group's query heads as query rows of their kv head
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.decode_mask, scale=scale)
        return out.reshape(bs, -1)

    @staticmethod
    def _extend_per_request(q, k_cache, v_cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
        """One SDPA per request over its own rows: the cost of a prefill is that of its tokens."""
        fb = meta.fb
        assert meta.seq_lens is not None and meta.extend_lens is not None and meta.q_starts is not None
        hq, hkv, d = q.shape[1], k_cache.shape[1], k_cache.shape[2]
        group = hq // hkv
        out = torch.empty(q.shape[0], hq * d, dtype=q.dtype)
        for r, (length, n, start) in enumerate(zip(meta.seq_lens, meta.extend_lens, meta.q_starts)):
            rows = fb.kv_indices[r, :length]
            kr = k_cache.index_select(0, rows).transpose(0, 1)  # [Hkv, L, D]
            vr = v_cache.index_select(0, rows).transpose(0, 1)
            if group > 1:
                kr = kr.repeat_interleave(group, dim=0)
                vr = vr.repeat_interleave(group, dim=0)
            qr = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
            prefix = length - n
            if prefix == 0 and meta.sliding_window is None:
                o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale)
            else:
                q_pos = torch.arange(prefix, length).view(-1, 1)
                kv_pos = torch.arange(length).view(1, -1)
                mask = kv_pos <= q_pos
                if meta.sliding_window is not None:
                    mask &= kv_pos > q_pos - meta.sliding_window
                o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
            out[start : start + n] = o.transpose(0, 1).reshape(n, hq * d)
        return out


def get_attention_backend(name: str) -> TorchAttention:
    if name == "torch":
        return TorchAttention()
    if name == "torch-sdpa":  # the pure-torch path alone (tests, comparisons)
        return TorchAttention(use_kernel=False)
    raise ValueError(f"unknown attention backend {name!r} (available: torch, torch-sdpa)")
