"""The elementwise parts of a decoder layer, fused where the native library is built.

Each function has one meaning and two implementations: the native kernels of
`cpu_kernels.py` (one pass over the rows, no temporaries) and the eager torch
form (any device; the reference, HF's op order). Both give the same values up
to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.models import cpu_kernels


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight); delta None: h itself."""
    if cpu_kernels.fused_ok(h, weight):
        return cpu_kernels.rms_norm(h, weight, eps, delta)
    if delta is not None:
        h = h + delta
    return h, rms_norm_eager(h, weight, eps)


def rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] (HF rotate_half convention), R < D: partial rotary, the last
    D - R dims pass through."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat([rope_eager(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos.unsqueeze(1) + rotated.float() * sin.unsqueeze(1)).to(x.dtype)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on [.., 2I] (gate, then up): gate clamped to at most `limit`,
    up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def scale_by_position(q: torch.Tensor, positions: torch.Tensor, beta: float, period: int) -> torch.Tensor:
    """q [T, H, D] times 1 + beta * log(1 + floor(position / period)) (Llama 4's attention scale:
    Ministral 3, Mistral 4)."""
    scale = 1 + beta * torch.log(1 + torch.floor(positions / period))
    return q * scale.to(q.dtype)[:, None, None]


def split_qkv_rope(
    qkv: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, hq, d] and k [T, hkv, d] rotated to their positions, v [T, hkv, d], from the fused projection."""
    t = qkv.shape[0]
    if (
        cpu_kernels.fused_ok(qkv) and cos_table.dtype == torch.float32 and cos_table.shape[-1] == d
    ):  # q and k heads are adjacent: rotate both in place, in one pass
        qkv = qkv.contiguous()
        cpu_kernels.rope_(qkv, hq + hkv, d, positions, cos_table, sin_table)
        heads = qkv.view(t, hq + 2 * hkv, d)  # views: no copies, one call each
        return heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
    cos, sin = cos_table[positions], sin_table[positions]
    if cos_table.shape[-1] < d:  # partial rotary: rotate q's and k's leading dims in place, as views
        qkv = qkv.contiguous()
        heads = qkv.view(t, hq + 2 * hkv, d)
        r = cos_table.shape[-1]
        heads[:, : hq + hkv, :r] = rope_eager(heads[:, : hq + hkv, :r], cos, sin)
        return heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    return (
        rope_eager(q.reshape(t, hq, d), cos, sin),
        rope_eager(k.reshape(t, hkv, d), cos, sin),
        v.reshape(t, hkv, d),
    )


def norm_qk_heads(
    qkv: torch.Tensor, hq: int, hkv: int, d: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The fused projection with q and k RMS-normalised: each head over its d dims where the
    weights are d long (Qwen3, Gemma-3), else all of q and all of k at once (OLMo-2)."""
    t = qkv.shape[0]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q = add_rms_norm(q.reshape(-1, q_weight.shape[0]), None, q_weight, eps)[1].view(t, hq * d)
    k = add_rms_norm(k.reshape(-1, k_weight.shape[0]), None, k_weight, eps)[1].view(t, hkv * d)
    return torch.cat([q, k, v], dim=-1)


def layer_norm_qk_heads(
    qkv: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
    q_norm: tuple[torch.Tensor, torch.Tensor | None],
    k_norm: tuple[torch.Tensor, torch.Tensor | None],
    eps: float,
) -> torch.Tensor:
    """The fused projection with each q and k head LayerNorm-ed over its d dims (mean-centred, in
    float32 as Cohere's), times its own weights [heads, d] (plus biases where given)."""
    t = qkv.shape[0]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)

    def norm(x: torch.Tensor, heads: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = F.layer_norm(x.reshape(t, heads, d).float(), (d,), eps=eps) * weight.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(t, heads * d)

    return torch.cat([norm(q, hq, *q_norm), norm(k, hkv, *k_norm), v], dim=-1)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (the exact, erf form) for rows [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


def relu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.relu(gate) * up


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x) squared (Nemotron's and Arcee's MLP activation, `relu2`)."""
    return torch.square(F.relu(x))


def relu2_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return relu2(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu(gate, tanh approximation) * up for rows [gate | up] (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma-2's logit soft-capping), in transformers' op order; None: x."""
    return x if cap is None else torch.tanh(x / cap) * cap


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if cpu_kernels.fused_ok(gate_up):
        return cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
