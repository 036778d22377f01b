"""Fused mixture-of-experts in Triton: a grouped GEMM over expert-sorted (token, slot) pairs.

`align` sorts the T x k (token, slot) pairs (pair p = slot * T + token) by expert and pads each expert's run to a multiple of BLOCK_M,
so every block of BLOCK_M sorted rows belongs to one expert (`block_expert`, -1 past the
end); it uses only fixed-size torch ops, so nothing waits for the host and CUDA graphs can
capture it (buffers are sized for the worst case, T*k + E*(BLOCK_M-1) rows).

Two kernels then run one program per (block of rows, block of output columns):
- gate_up: each program loads its expert's gate and up tiles, accumulates both against
  the rows' hidden states and writes silu(gate) * up — the activation never leaves chip;
- down: the activations times the expert's down tile, scaled by the pair's routing weight,
  written at the pair's own row, so the k pairs of a token are summed by a reshape (in fp32).

Blocks of an expert that got no pair do not exist, so a step's cost follows the experts
its tokens chose, not the experts the model has. Accumulation is float32; fp32 inputs use
IEEE dot products (no TF32). Tests run it on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Alignment:
    sorted_pairs: torch.Tensor  # [padded rows] int32 pair ids (slot * T + token) by expert; T*k: padding
    block_expert: torch.Tensor  # [padded rows / BLOCK_M] int32 expert of each block, -1: unused
    block_m: int


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m (no host sync)."""
    flat = ids.t().reshape(-1)  # slot-major
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    dest = (padded_end - padded)[expert] + rank
    blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    sorted_pairs = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_pairs, block_expert, block_m)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _block_pairs(SortedPairs, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """A block's sorted rows, the pairs they hold and which are real (not padding), as int64 (offsets)."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(SortedPairs + rows).to(tl.int64)
    return rows, pair, pair < num_pairs


@triton.jit
def _gate_up_kernel(
    X,
    W,
    Act,
    SortedPairs,
    BlockExpert,
    num_pairs,
    num_tokens,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= 0:
        rows, pair, valid = _block_pairs(SortedPairs, pid_m, num_pairs, BLOCK_M)
        token = tl.where(valid, pair % num_tokens, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        w = W + e.to(tl.int64) * stride_we
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a = tl.load(
                X + token[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
            )
            w_mask = k_ok[:, None] & col_ok[None, :]
            g = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            u = tl.load(w + (cols[None, :] + inter) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc_g += _dot(a, g, IEEE)
            acc_u += _dot(a, u, IEEE)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(
            Act + rows[:, None] * stride_act + cols[None, :],
            act.to(Act.dtype.element_ty),
            mask=valid[:, None] & col_ok[None, :],
        )


@triton.jit
def _down_kernel(
    Act,
    W,
    Out,
    Weights,
    SortedPairs,
    BlockExpert,
    num_pairs,
    hidden,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= 0:
        rows, pair, valid = _block_pairs(SortedPairs, pid_m, num_pairs, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        w = W + e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a = tl.load(
                Act + rows[:, None] * stride_act + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                w + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            acc += _dot(a, b, IEEE)
        scale = tl.load(Weights + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        safe = tl.where(valid, pair, 0)
        tl.store(
            Out + safe[:, None] * stride_out + cols[None, :],
            acc.to(Out.dtype.element_ty),
            mask=valid[:, None] & col_ok[None, :],
        )


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when each expert gets a few pairs (decode), larger for prefill."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block_m: int | None = None,
) -> torch.Tensor:
    """The same as `moe.experts_torch`: [T, H] in x's dtype (the k pairs summed in float32)."""
    t, top_k = ids.shape
    num_experts, two_i, hidden = w_gate_up.shape
    inter = two_i // 2
    n = t * top_k
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    al = align(ids, num_experts, block_m or pick_block_m(n, num_experts))
    blocks = al.block_expert.numel()
    ieee = x.dtype == torch.float32
    act = torch.empty(al.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    bn, bk = 64, 64
    _gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
        x,
        w_gate_up,
        act,
        al.sorted_pairs,
        al.block_expert,
        n,
        t,
        hidden,
        inter,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        act.stride(0),
        BLOCK_M=al.block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE=ieee,
    )
    out = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, bn))](
        act,
        w_down,
        out,
        weights.t().reshape(-1).float().contiguous(),
        al.sorted_pairs,
        al.block_expert,
        n,
        hidden,
        inter,
        act.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        out.stride(0),
        BLOCK_M=al.block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE=ieee,
    )
    return out.view(top_k, t, hidden).sum(0).to(x.dtype)
