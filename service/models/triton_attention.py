"""Paged attention in Triton: the KV store, decode (split-KV) and extend kernels.

All three read the KV pool through `ForwardBatch.kv_indices` ([bs, L], one
request-to-token row per request) and never leave the device:

- store: this step's K/V rows into the pool at `out_cache_loc`;
- decode: one query token per request. Stage 1 splits each request's KV range
  into `num_splits` pieces; one program per (request, KV head, split) attends
  with all query heads of the KV head's GQA group at once (a [group, D] x
  [D, BLOCK_N] dot) and writes a partial output and its log-sum-exp. Stage 2
  merges the splits per (request, query head);
- extend: new tokens of each request attend to the cached prefix (read from
  the pool) and causally to each other (read from this step's packed K/V).

Sliding windows (Mistral, Gemma's local layers) restrict both to the last `window` positions;
`softcap` > 0 caps the scores, softcap * tanh(scores / softcap) (Gemma-2), before the softmax.
Accumulation is float32; fp32 inputs use IEEE dot products (no TF32).

Tests run these on CPU with `TRITON_INTERPRET=1`, which must be set before
triton is first imported (tests/conftest.py does so when there is no GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.core.forward_batch import ForwardBatch, ForwardMode
from service.models.eager_attention import AlibiSlopes, eager_attention


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_cache,
    V_cache,
    Loc,
    stride_k,
    stride_v,
    stride_kc,
    stride_vc,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    row = tl.load(Loc + t)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    tl.store(K_cache + row * stride_kc + offs, tl.load(K + t * stride_k + offs, mask=mask), mask=mask)
    tl.store(V_cache + row * stride_vc + offs, tl.load(V + t * stride_v + offs, mask=mask), mask=mask)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _scores(q, k, sm_scale, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """q.k * scale; SOFTCAP > 0: SOFTCAP * tanh(. / SOFTCAP), tanh as 1 - 2 / (exp(2x) + 1)."""
    qk = _dot(q, k, IEEE) * sm_scale
    if SOFTCAP > 0:
        qk = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * qk / SOFTCAP) + 1.0))
    return qk


@triton.jit
def _online_softmax_step(qk, m_i, l_i, acc, v, IEEE: tl.constexpr):
    """One block of flash attention: qk [M, N] (masked with -inf), v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _decode_stage1_kernel(
    Q,
    K_cache,
    V_cache,
    KV_indices,
    Seq_lens,
    Mid_O,
    Mid_LSE,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kc_t,
    stride_kc_h,
    stride_vc_t,
    stride_vc_h,
    stride_idx,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b)
    lo = 0
    if WINDOW > 0:  # the query sits at seq_len - 1 and sees positions > seq_len - 1 - WINDOW
        lo = tl.maximum(seq_len - WINDOW, 0)
    split_len = tl.cdiv(seq_len - lo, NUM_SPLITS)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in range(start, end, BLOCK_N):
        offs_n = s + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows = tl.load(KV_indices + b * stride_idx + offs_n, mask=mask_n, other=0)
        k = tl.load(
            K_cache + rows[None, :] * stride_kc_t + kvh * stride_kc_h + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        qk = _scores(q, k, sm_scale, SOFTCAP, IEEE)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V_cache + rows[:, None] * stride_vc_t + kvh * stride_vc_h + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, v, IEEE)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        Mid_O + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :],
        out,
        mask=mask_g[:, None] & mask_d[None, :],
    )
    tl.store(Mid_LSE + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_g)


@triton.jit
def _decode_stage2_kernel(
    Mid_O,
    Mid_LSE,
    O,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(Mid_LSE + b * stride_ml_b + h * stride_ml_h + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the last position is always visible
    w = tl.exp(lse - m)
    o = tl.load(
        Mid_O + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    O,
    K_cache,
    V_cache,
    KV_indices,
    Seq_lens,
    Prefix_lens,
    Start_loc,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kc_t,
    stride_kc_h,
    stride_vc_t,
    stride_vc_h,
    stride_idx,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    prefix = tl.load(Prefix_lens + b)
    ext_len = tl.load(Seq_lens + b) - prefix
    if mb * BLOCK_M < ext_len:
        start = tl.load(Start_loc + b)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the new tokens
        mask_m = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        q_pos = prefix + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # 1. The cached prefix, from the pool (every prefix position precedes every query).
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(prefix + mb * BLOCK_M - WINDOW + 1, 0)
        for s in range(lo, prefix, BLOCK_N):
            offs_n = s + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix
            rows = tl.load(KV_indices + b * stride_idx + offs_n, mask=mask_n, other=0)
            k = tl.load(
                K_cache + rows[None, :] * stride_kc_t + kvh * stride_kc_h + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            qk = _scores(q, k, sm_scale, SOFTCAP, IEEE)
            visible = mask_n[None, :]
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_cache + rows[:, None] * stride_vc_t + kvh * stride_vc_h + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, v, IEEE)

        # 2. This step's tokens, causally, from the packed K/V.
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(mb * BLOCK_M - WINDOW + 1, 0)
        hi = tl.minimum((mb + 1) * BLOCK_M, ext_len)
        for s in range(lo, hi, BLOCK_N):
            offs_n = s + tl.arange(0, BLOCK_N)
            mask_n = offs_n < ext_len
            k = tl.load(
                K + (start + offs_n)[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            qk = _scores(q, k, sm_scale, SOFTCAP, IEEE)
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > offs_m[:, None] - WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V + (start + offs_n)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, v, IEEE)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            O + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor
) -> None:
    """k_cache[loc] = k; v_cache[loc] = v (k, v: [T, Hkv, D], rows contiguous)."""
    t = k.shape[0]
    if t == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        v_cache.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Each token's [H, D] block contiguous (packed qkv views already are)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def decode_attention(
    q: torch.Tensor,  # [bs, Hq, D]
    k_cache: torch.Tensor,  # [pool, Hkv, D]
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,  # [bs, L]
    seq_lens: torch.Tensor,  # [bs]
    scale: float,
    num_splits: int,
    window: int = 0,
    block_n: int = 64,
    mid: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    bs, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if mid is None:
        mid = (
            torch.empty(bs, hq, num_splits, d, dtype=torch.float32, device=q.device),
            torch.empty(bs, hq, num_splits, dtype=torch.float32, device=q.device),
        )
    mid_o, mid_lse = mid
    o = torch.empty_like(q)
    block_d = _pow2(d)
    ieee = q.dtype == torch.float32
    _decode_stage1_kernel[(bs, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        kv_indices,
        seq_lens,
        mid_o,
        mid_lse,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        kv_indices.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_H=_pow2(group),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        WINDOW=window,
        SOFTCAP=softcap,
        IEEE=ieee,
    )
    _decode_stage2_kernel[(bs, hq)](
        mid_o,
        mid_lse,
        o,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return o


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D] new tokens, packed
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,  # [bs, L]: prefix rows first
    seq_lens: torch.Tensor,  # [bs] prefix + new
    prefix_lens: torch.Tensor,  # [bs]
    start_loc: torch.Tensor,  # [bs] first packed row of each request
    max_extend_len: int,
    scale: float,
    window: int = 0,
    block_m: int = 64,
    block_n: int = 64,
    softcap: float = 0.0,
) -> torch.Tensor:
    bs = seq_lens.shape[0]
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    o = torch.empty_like(q)
    _extend_kernel[(bs, hq, triton.cdiv(max_extend_len, block_m))](
        q,
        k,
        v,
        o,
        k_cache,
        v_cache,
        kv_indices,
        seq_lens,
        prefix_lens,
        start_loc,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        kv_indices.stride(0),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_D=_pow2(d),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        WINDOW=window,
        SOFTCAP=softcap,
        IEEE=q.dtype == torch.float32,
    )
    return o


@dataclass
class TritonMeta:
    """Per-batch state every layer reuses."""

    fb: ForwardBatch
    window: int  # 0: no sliding window
    num_splits: int  # decode only
    softcap: float  # 0: scores not capped; else softcap * tanh(scores / softcap) (Gemma-2)
    mid: tuple[torch.Tensor, torch.Tensor] | None = None  # decode scratch, allocated by the first layer
    alibi: torch.Tensor | None = None  # ALiBi's slopes [Hq]: eager_attention.py, not the kernels


class TritonAttention:
    """Paged attention with Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(
        self, block_m: int = 64, block_n: int = 64, max_splits: int = 16, num_splits: int | None = None
    ):
        self.block_m = block_m
        self.block_n = block_n
        self.max_splits = max_splits
        self.num_splits = num_splits  # fixed (tests); None: chosen per batch
        self.alibi_slopes = AlibiSlopes()
        self._sm_count: int | None = None

    def _splits(self, fb: ForwardBatch, num_kv_heads: int) -> int:
        if self.num_splits is not None:
            return self.num_splits
        if self._sm_count is None:
            dev = fb.kv_indices.device
            self._sm_count = (
                torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
            )
        programs = fb.batch_size * num_kv_heads
        by_occupancy = triton.cdiv(2 * self._sm_count, programs)
        by_length = triton.cdiv(fb.kv_indices.shape[1], self.block_n)
        return max(1, min(self.max_splits, by_occupancy, by_length))

    def prepare(
        self,
        fb: ForwardBatch,
        num_q_heads: int,
        num_kv_heads: int,
        sliding_window: int | None = None,
        softcap: float | None = None,
        alibi: tuple[float, ...] | None = None,
        head_dim: int | None = None,  # (the CPU backend's split depends on it; the kernels here take any)
    ) -> TritonMeta:
        splits = self._splits(fb, num_kv_heads) if fb.mode is ForwardMode.DECODE else 1
        slopes = None if alibi is None else self.alibi_slopes(alibi, fb.kv_indices.device)
        return TritonMeta(fb, sliding_window or 0, splits, softcap or 0.0, alibi=slopes)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [pool, Hkv, D]
        v_cache: torch.Tensor,
        meta: TritonMeta,
        scale: float,
        sinks: torch.Tensor | None = None,  # gpt-oss's: the kernels take none
    ) -> torch.Tensor:
        fb = meta.fb
        if meta.alibi is not None or sinks is not None:  # the kernels add no bias, take no sink
            window = meta.window or None
            return eager_attention(
                q, k, v, k_cache, v_cache, fb, scale, meta.softcap or None, window, meta.alibi, sinks
            )
        store_kv(k, v, k_cache, v_cache, fb.out_cache_loc)
        if fb.mode is ForwardMode.DECODE:
            if meta.mid is None:
                bs, hq, d = q.shape
                meta.mid = (
                    torch.empty(bs, hq, meta.num_splits, d, dtype=torch.float32, device=q.device),
                    torch.empty(bs, hq, meta.num_splits, dtype=torch.float32, device=q.device),
                )
            o = decode_attention(
                q,
                k_cache,
                v_cache,
                fb.kv_indices,
                fb.seq_lens,
                scale,
                meta.num_splits,
                meta.window,
                self.block_n,
                meta.mid,
                meta.softcap,
            )
        else:
            o = extend_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                fb.kv_indices,
                fb.seq_lens,
                fb.extend_prefix_lens,
                fb.extend_start_loc,
                fb.max_extend_len,
                scale,
                meta.window,
                self.block_m,
                self.block_n,
                meta.softcap,
            )
        return o.view(o.shape[0], -1)
