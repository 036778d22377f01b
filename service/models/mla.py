"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Moonlight, GLM-4.7-Flash) over the paged pool.

q comes from the hidden state through a low-rank bottleneck (`q_a_proj`, an RMSNorm, `q_b_proj`)
or one projection (`q_proj`, where `q_lora_rank` is null). k and v come from one latent:
`kv_a_proj_with_mqa` gives the latent (`kv_lora_rank`) and a rotary key part (`qk_rope_head_dim`)
that every head shares; the latent, RMS-normalised, is expanded per head by `kv_b_proj` into k's
unrotated part (`qk_nope_head_dim`) and v (`v_head_dim`). Scores are scaled by
`qk_head_dim ** -0.5`, times YaRN's `mscale_all_dim` correction squared where the rope is scaled.

Served in its expanded form: each head's k and v go to the pool as an ordinary multi-head
attention's (kv heads = heads, head_dim = the larger of the qk head dim and v_head_dim), so every
attention backend, the prefix cache and retraction serve it unchanged. A q or k head is laid out
[rotary dims, unrotated dims, zeros], the rotary dims leading as the partial-rotary path turns
them (the loader moves q's rotary rows there; q and k alike, so scores are unchanged); a v head is
[v, zeros], and the padding is dropped before `o_proj`. The price is memory: a token takes
heads x head_dim x 2 values per layer in the pool where the latent is kv_lora_rank +
qk_rope_head_dim (DeepSeek-V2-Lite: 16 x 192 x 2 against 576, 10.7x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from service.models.ops import add_rms_norm, rope_eager, scale_by_position


@dataclass(frozen=True)
class MLAShape:
    q_lora_rank: int | None  # q's bottleneck (None: one projection)
    kv_lora_rank: int  # the latent k and v are expanded from
    nope_dim: int  # qk_nope_head_dim: the unrotated dims of a q and k head
    rope_dim: int  # qk_rope_head_dim: the rotary dims (k's shared by every head)
    v_dim: int  # v_head_dim
    bias: bool = False  # `attention_bias`: q_a_proj, kv_a_proj_with_mqa and o_proj have biases

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def head_dim(self) -> int:
        """A pool head's width: q/k and v padded to the larger of the two."""
        return max(self.qk_dim, self.v_dim)


class LatentAttention(nn.Module):
    """MLA's projections around the backend call; `forward` takes SelfAttention's arguments."""

    def __init__(
        self,
        m: MLAShape,
        hidden: int,
        heads: int,
        eps: float,
        scale: float,
        q_position_scale: tuple[float, int] | None = None,
    ):
        super().__init__()
        self.m, self.heads, self.eps, self.scale = m, heads, eps, scale
        self.q_position_scale = q_position_scale  # Mistral 4's (beta, period), as ModelShape's
        d = m.head_dim
        if m.q_lora_rank is None:
            self.q_a = None
            self.q_b = nn.Linear(hidden, heads * d, bias=False)  # `q_proj`
        else:
            self.q_a = nn.Linear(hidden, m.q_lora_rank, bias=m.bias)
            self.q_a_norm = nn.Parameter(torch.ones(m.q_lora_rank))
            self.q_b = nn.Linear(m.q_lora_rank, heads * d, bias=False)
        self.kv_a = nn.Linear(hidden, m.kv_lora_rank + m.rope_dim, bias=m.bias)
        self.kv_a_norm = nn.Parameter(torch.ones(m.kv_lora_rank))
        self.kv_b = nn.Linear(m.kv_lora_rank, heads * (m.nope_dim + m.v_dim), bias=False)
        self.o = nn.Linear(heads * m.v_dim, hidden, bias=m.bias)

    def forward(self, x, positions, cos, sin, k_cache, v_cache, meta, attn) -> torch.Tensor:
        m, h, d, r, nope = self.m, self.heads, self.m.head_dim, self.m.rope_dim, self.m.nope_dim
        t = x.shape[0]
        q_in = x if self.q_a is None else add_rms_norm(self.q_a(x), None, self.q_a_norm, self.eps)[1]
        q = self.q_b(q_in).view(t, h, d)  # rows [rotary, unrotated, zeros] per head (the loader's)
        latent, k_rope = self.kv_a(x).split((m.kv_lora_rank, r), dim=-1)
        expanded = self.kv_b(add_rms_norm(latent, None, self.kv_a_norm, self.eps)[1]).view(
            t, h, nope + m.v_dim
        )
        cos, sin = cos[positions], sin[positions]
        q[..., :r] = rope_eager(q[..., :r], cos, sin)
        if self.q_position_scale is not None:
            q = scale_by_position(q, positions, *self.q_position_scale)
        # k and v side by side in one buffer: the kernels take both with one row stride
        kv = x.new_empty(t, 2, h, d)
        k, v = kv[:, 0], kv[:, 1]
        k[..., :r] = rope_eager(k_rope.reshape(t, 1, r), cos, sin)
        k[..., r : r + nope] = expanded[..., :nope]
        k[..., r + nope :] = 0
        v[..., : m.v_dim] = expanded[..., nope:]
        v[..., m.v_dim :] = 0
        out = attn.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        if m.v_dim < d:
            out = out.view(t, h, d)[..., : m.v_dim].reshape(t, h * m.v_dim)
        return self.o(out)


def attention_scale(config, qk_dim: int) -> float:
    """qk_dim ** -0.5, times YaRN's mscale squared where the rope is scaled and `mscale_all_dim`
    is set (transformers' `yarn_apply_mscale`)."""
    import math

    scale = qk_dim**-0.5
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@torch.no_grad()
def load_latent_attention(attn: LatentAttention, take, prefix: str, interleaved: bool) -> None:
    """`{prefix}self_attn.*` into `attn`: q's rows laid out [rotary, unrotated, zeros] per head and
    kv_a's rotary rows de-interleaved where the checkpoint's rotary turns interleaved pairs (DeepSeek's
    dims 2i and 2i+1; the rotate-half kernels then give the same scores)."""
    m, a = attn.m, prefix + "self_attn."
    r, d = m.rope_dim, m.head_dim
    turn = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]) if interleaved else torch.arange(r)
    per_head = torch.cat([m.nope_dim + turn, torch.arange(m.nope_dim)])  # published [unrotated, rotary]
    q_name = a + ("q_proj" if attn.q_a is None else "q_b_proj") + ".weight"
    q = take(q_name).view(attn.heads, m.qk_dim, -1)[:, per_head]
    attn.q_b.weight.zero_()
    attn.q_b.weight.view(attn.heads, d, -1)[:, : m.qk_dim] = q
    if attn.q_a is not None:
        attn.q_a.weight.copy_(take(a + "q_a_proj.weight"))
        attn.q_a_norm.copy_(take(a + "q_a_layernorm.weight"))
        if m.bias:
            attn.q_a.bias.copy_(take(a + "q_a_proj.bias"))
    rows = torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + turn])
    attn.kv_a.weight.copy_(take(a + "kv_a_proj_with_mqa.weight")[rows])
    if m.bias:
        attn.kv_a.bias.copy_(take(a + "kv_a_proj_with_mqa.bias")[rows])
        attn.o.bias.copy_(take(a + "o_proj.bias"))
    attn.kv_a_norm.copy_(take(a + "kv_a_layernorm.weight"))
    attn.kv_b.weight.copy_(take(a + "kv_b_proj.weight"))
    attn.o.weight.copy_(take(a + "o_proj.weight"))
