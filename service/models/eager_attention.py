"""Attention over the paged KV pool in plain torch ops, for scores SDPA cannot make: soft-capped
(Gemma-2), with ALiBi's linear bias (BLOOM, MPT), or with a sink per head in the softmax (gpt-oss).

scores = q.k * scale, then cap * tanh(scores / cap) where capped, plus slope_h * kv_position
where ALiBi (transformers adds slope_h * (kv_position - q_position); the difference is the same
for a query's every key, so its softmax is too), masked (causal, sliding window), softmax, times
V, accumulated in float32: the op order of transformers' eager attentions. The native CPU kernel
and the Triton kernels cap scores themselves, so the torch backend routes here what its kernels
do not take (long extends; every capped layer without a C compiler), and every ALiBi layer on
either backend. Decode is one batched computation over each request's pool rows with no host read
(CUDA-graph safe); an extend runs one request at a time, like the torch backend's SDPA path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.core.forward_batch import ForwardBatch, ForwardMode


class AlibiSlopes:
    """ALiBi's slopes as float32 tensors, made once per model and device: a backend asks every
    forward, and a CUDA graph's capture may not copy from the host (its warm-up forwards make them)."""

    def __init__(self) -> None:
        self._made: dict[tuple[tuple[float, ...], str], torch.Tensor] = {}

    def __call__(self, alibi: tuple[float, ...], device: torch.device) -> torch.Tensor:
        key = (alibi, str(device))
        if key not in self._made:
            self._made[key] = torch.tensor(alibi, dtype=torch.float32, device=device)
        return self._made[key]


def extend_rows(fb: ForwardBatch) -> list[tuple[int, int, int]]:
    """(kv length, new tokens, first packed row) per request of an extend, from host copies."""
    lens = list(fb.extend_lens or [])
    prefixes = fb.extend_prefix_lens_cpu  # host copies: no device read
    if prefixes is None:
        prefixes = fb.extend_prefix_lens.tolist() if fb.extend_prefix_lens is not None else [0] * len(lens)
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    return [(p + n, n, s) for p, n, s in zip(prefixes, lens, starts)]


def allowed(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and within the last `window` positions) mask, broadcast over q_pos x kv_pos."""
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= kv_pos > q_pos - window
    return mask


def _attend(
    q,
    k,
    v,
    mask,
    scale: float,
    softcap: float | None,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [..., Hkv, g, n, D], k/v [..., Hkv, L, D], mask broadcastable to [..., Hkv, g, n, L];
    bias (ALiBi's) broadcastable to the scores, or None; sinks [Hkv, g, 1, 1]: a logit per head
    that joins each softmax's denominator and weighs no value (gpt-oss)."""
    s = torch.matmul(q.float(), k.float().unsqueeze(-3).transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        p = torch.softmax(torch.cat([s, sinks.float().expand(*s.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v.float().unsqueeze(-3))


def eager_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [pool, Hkv, D]
    v_cache: torch.Tensor,
    fb: ForwardBatch,
    scale: float,
    softcap: float | None,
    window: int | None,
    alibi: torch.Tensor | None = None,  # [Hq] float32 slopes
    sinks: torch.Tensor | None = None,  # [Hq]: gpt-oss's
) -> torch.Tensor:
    """Stores this step's K/V at fb.out_cache_loc, then attends: [T, Hq * D]."""
    k_cache[fb.out_cache_loc] = k
    v_cache[fb.out_cache_loc] = v
    hq, hkv, d = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    sink = None if sinks is None else sinks.view(hkv, g, 1, 1)
    if softcap is None and alibi is not None and sinks is None:
        return _alibi_attention(q, k_cache, v_cache, fb, scale, window, alibi.to(q.device))
    slopes = None if alibi is None else alibi.to(q.device).view(hkv, g, 1, 1)
    if fb.mode is ForwardMode.DECODE:
        bs, length = fb.kv_indices.shape
        rows = fb.kv_indices.reshape(-1)
        kp = k_cache.index_select(0, rows).view(bs, length, hkv, d).transpose(1, 2)  # [bs, Hkv, L, D]
        vp = v_cache.index_select(0, rows).view(bs, length, hkv, d).transpose(1, 2)
        kv_pos = torch.arange(length, device=q.device).view(1, -1)
        mask = allowed(fb.positions.view(-1, 1), kv_pos, window).view(bs, 1, 1, 1, length)
        bias = None if slopes is None else slopes * kv_pos.float()  # [Hkv, g, 1, L]
        o = _attend(q.view(bs, hkv, g, 1, d), kp, vp, mask, scale, softcap, bias, sink)
        return o.to(q.dtype).reshape(bs, hq * d)
    out = torch.empty(q.shape[0], hq * d, dtype=q.dtype, device=q.device)
    for r, (length, n, start) in enumerate(extend_rows(fb)):
        rows = fb.kv_indices[r, :length]
        kr = k_cache.index_select(0, rows).transpose(0, 1)  # [Hkv, L, D]
        vr = v_cache.index_select(0, rows).transpose(0, 1)
        qr = q[start : start + n].view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
        q_pos = torch.arange(length - n, length, device=q.device).view(-1, 1)
        kv_pos = torch.arange(length, device=q.device).view(1, -1)
        mask = allowed(q_pos, kv_pos, window)
        bias = None if slopes is None else slopes * kv_pos.float()
        o = _attend(qr, kr, vr, mask, scale, softcap, bias, sink)  # [Hkv, g, n, D]
        out[start : start + n] = o.permute(2, 0, 1, 3).reshape(n, hq * d).to(q.dtype)
    return out


def _alibi_attention(
    q, k_cache, v_cache, fb: ForwardBatch, scale: float, window: int | None, slopes
) -> torch.Tensor:
    """ALiBi: the bias is slope_h * (kv_position - q_position), 0 at the query's own position and
    negative with distance, -inf where the query may not look. Extends go through SDPA with it as
    an additive mask in q's dtype (in bf16 the far keys it rounds most are the ones whose weights
    it makes negligible); decode rows through two matmuls in q's dtype. [T, Hq * D]."""
    hq, hkv, d = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    slopes = slopes.view(-1, 1, 1)  # [Hq, 1, 1]
    if fb.mode is ForwardMode.DECODE:
        bs, length = fb.kv_indices.shape
        rows = fb.kv_indices.reshape(-1)
        kp = k_cache.index_select(0, rows).view(bs, length, hkv, d).transpose(1, 2)  # [bs, Hkv, L, D]
        vp = v_cache.index_select(0, rows).view(bs, length, hkv, d).transpose(1, 2)
        kv_pos = torch.arange(length, device=q.device).view(1, 1, 1, -1)
        q_pos = fb.positions.view(-1, 1, 1, 1)
        bias = (slopes * (kv_pos - q_pos).float()).masked_fill(~allowed(q_pos, kv_pos, window), float("-inf"))
        # one query row each: matmuls in q's dtype beat SDPA with a mask here (0.5 against 2.9 ms a
        # layer at 8 x 330 keys, bf16, Zen 4); the bias and the softmax in float32
        g = hq // hkv
        qg = q.view(bs, hkv, g, d)
        s = torch.matmul(qg, kp.transpose(-1, -2)).float() * scale + bias.view(bs, hkv, g, length)
        o = torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), vp)  # [bs, Hkv, g, D]
        return o.reshape(bs, hq * d)
    out = torch.empty(q.shape[0], hq * d, dtype=q.dtype, device=q.device)
    for r, (length, n, start) in enumerate(extend_rows(fb)):
        rows = fb.kv_indices[r, :length]
        kr = k_cache.index_select(0, rows).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vr = v_cache.index_select(0, rows).transpose(0, 1).unsqueeze(0)
        qr = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        q_pos = torch.arange(length - n, length, device=q.device).view(-1, 1)
        kv_pos = torch.arange(length, device=q.device).view(1, -1)
        bias = (slopes * (kv_pos - q_pos).float()).masked_fill(~allowed(q_pos, kv_pos, window), float("-inf"))
        o = F.scaled_dot_product_attention(
            qr, kr, vr, attn_mask=bias.to(q.dtype).unsqueeze(0), scale=scale, enable_gqa=hq != hkv
        )
        out[start : start + n] = o[0].transpose(0, 1).reshape(n, hq * d)
    return out
