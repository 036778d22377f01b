"""Falcon-H1 (TII): in every layer Mamba-2 (mamba2.py) beside attention on the same normed input,
their outputs summed (`ModelShape.parallel_recurrent`), then a SwiGLU MLP; norms `input_layernorm`,
`pre_ff_layernorm`, `final_layernorm`.

Its muP multipliers are folded into the weights at load, where each is a scale of a projection's
input or output: `attention_in_multiplier` (q/k/v), `key_multiplier` (k), `attention_out_multiplier`
(o), `ssm_in_multiplier` and the five `ssm_multipliers` (Mamba's in_proj, by segment: z, x, B, C,
dt), `ssm_out_multiplier` (its out_proj), `mlp_multipliers` (gate, down); `embedding_multiplier`
and `lm_head_multiplier` scale the embeddings and the logits. Mamba's gate: RMSNorm per group
before or after it (`mamba_norm_before_gate`), or none (`mamba_rms_norm` false); its width
`mamba_d_ssm` (else `mamba_expand` x hidden)."""

from __future__ import annotations

import torch

from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape, load_common, load_linear
from service.models.mamba2 import load_mamba2, mamba2_shape

ARCHITECTURES = ("FalconH1ForCausalLM",)


def shape(config) -> ModelShape:
    if not config.mamba_rms_norm:
        gating = "gate"
    else:
        gating = "norm_gate" if config.mamba_norm_before_gate else "gate_norm"
    mamba = mamba2_shape(config, out_bias=bool(config.projectors_bias), gating=gating)
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(
        config,
        qkv_bias=bias,
        o_bias=bias,
        embed_scale=float(config.embedding_multiplier) if config.embedding_multiplier != 1 else None,
        logits_scale=float(config.lm_head_multiplier) if config.lm_head_multiplier != 1 else None,
        recurrent=mamba,
        parallel_recurrent=True,
    )


@torch.no_grad()
def load(model: CausalLM, take: Checkpoint) -> None:
    c, s = model.config, model.shape
    load_common(model, take, norm="model.final_layernorm")
    q, kv = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
    m = s.recurrent
    gn = m.groups * m.d_state
    mup = torch.cat(
        [torch.full((n,), float(x)) for n, x in zip((m.inner, m.inner, gn, gn, m.heads), c.ssm_multipliers)]
    )
    gate_mult, down_mult = c.mlp_multipliers
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_attention_scaled(layer.attn, take, p + "self_attn.", q, kv, c)
        load_mamba2(layer.beside, take, p + "mamba.")
        mamba = layer.beside
        mamba.in_proj.weight.mul_((mup * c.ssm_in_multiplier).unsqueeze(1))
        if mamba.in_proj.bias is not None:
            mamba.in_proj.bias.mul_(mup)
        mamba.out.weight.mul_(c.ssm_out_multiplier)
        if mamba.out.bias is not None:
            mamba.out.bias.mul_(c.ssm_out_multiplier)
        f = p + "feed_forward."
        gate = take(f + "gate_proj.weight") * gate_mult
        layer.mlp.gate_up.weight.copy_(torch.cat([gate, take(f + "up_proj.weight")]))
        load_linear(layer.mlp.down, take, f + "down_proj")
        layer.mlp.down.weight.mul_(down_mult)
        if layer.mlp.gate_up.bias is not None:
            layer.mlp.gate_up.bias.copy_(
                torch.cat([take(f + "gate_proj.bias") * gate_mult, take(f + "up_proj.bias")])
            )
            layer.mlp.down.bias.mul_(down_mult)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "pre_ff_layernorm.weight"))


def load_split_attention_scaled(attn, take: Checkpoint, a: str, q: int, kv: int, c) -> None:
    """q/k/v fused with the input multiplier folded in (and the key multiplier into k), o with the
    output multiplier."""
    scale = torch.cat(
        [
            torch.full((q,), float(c.attention_in_multiplier)),
            torch.full((kv,), float(c.attention_in_multiplier * c.key_multiplier)),
            torch.full((kv,), float(c.attention_in_multiplier)),
        ]
    )
    attn.qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")) * scale.unsqueeze(1))
    if attn.qkv.bias is not None:
        bias_scale = torch.cat([torch.ones(q), torch.full((kv,), float(c.key_multiplier)), torch.ones(kv)])
        attn.qkv.bias.copy_(take.cat(*(a + f"{n}_proj.bias" for n in "qkv")) * bias_scale)
    load_linear(attn.o, take, a + "o_proj")
    attn.o.weight.mul_(c.attention_out_multiplier)
    if attn.o.bias is not None:
        attn.o.bias.mul_(c.attention_out_multiplier)
