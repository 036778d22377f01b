"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: hybrid layers, Gated DeltaNet (gated_delta.py) in the layers
`layer_types` names `linear_attention`, gated attention in the `full_attention` ones.

The attention layers: an output gate (q_proj publishes each head's q and its gate side by side),
RMSNorms over each q and k head, partial rotary (`partial_rotary_factor`; Qwen3.5's M-RoPE streams
are equal on text). Every RMSNorm but the Gated DeltaNet's is zero-centred, (1 + w), stored as 1 + w.
MLPs: dense (Qwen3.5), or routed experts beside a shared expert behind a sigmoid gate (Qwen3.5-MoE in
every layer; Qwen3-Next where `decoder_sparse_step`/`mlp_only_layers` say), softmax top-k,
renormalised (Qwen3-Next: where `norm_topk_prob` says).

Checkpoint: Qwen3.5's `linear_attn.in_proj_qkv/in_proj_z/in_proj_b/in_proj_a`; Qwen3-Next's
`in_proj_qkvz`/`in_proj_ba` group q, k, v, z (and b, a) per key head, reordered here at load.
A Qwen3.5 vision-language checkpoint is served for its language model (service/models/vision.py)."""

from __future__ import annotations

import dataclasses

import torch

from service.models import qwen2_moe
from service.models.gated_delta import GatedDeltaNet, GatedDeltaShape, gated_delta_shape
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    architecture,
    base_shape,
    load_common,
    load_split_mlp,
    served_layer_types,
)
from service.models.moe import load_moe_block, sparse_layers

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
MIXERS = ("linear_attention", "full_attention")


def shape(config) -> ModelShape:
    arch = architecture(config)
    types = served_layer_types(config, MIXERS)
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise UnsupportedModel(f"{arch}: linear_num_value_heads is not a multiple of linear_num_key_heads")
    bias = bool(getattr(config, "attention_bias", False))
    s = base_shape(
        config,
        qk_norm=True,
        qkv_bias=bias,
        o_bias=bias,
        attn_output_gate=True,
        recurrent=gated_delta_shape(config),
        recurrent_layers=tuple(t == "linear_attention" for t in types),
    )
    if arch == "Qwen3_5ForCausalLM":
        return s
    moe = qwen2_moe.moe_shape(config)
    if arch == "Qwen3_5MoeForCausalLM":  # every layer routed, always renormalised
        return dataclasses.replace(
            s, moe=dataclasses.replace(moe, renormalize=True), moe_layers=(True,) * s.num_layers
        )
    return dataclasses.replace(s, moe=moe, moe_layers=sparse_layers(config, moe.num_experts))


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take, norm_offset=1.0)
    s = model.shape
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if s.is_recurrent(i):
            load_gated_delta(layer.attn, take, p + "linear_attn.")
        else:
            load_gated_attention(model, layer.attn, take, p + "self_attn.")
        if s.moe is not None and s.moe_layers[i]:
            load_moe_block(layer.mlp, take, p + "mlp.", qwen2_moe.EXPERT_NAMES, shared="shared_expert.")
        else:
            load_split_mlp(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight") + 1.0)
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight") + 1.0)


def load_gated_attention(model: CausalLM, attn, take: Checkpoint, a: str) -> None:
    """q_proj's rows are each head's q, then its gate: split into the fused qkv and the gate."""
    s = model.shape
    hq, d = s.num_q_heads, s.head_dim

    def q_and_gate(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = t.reshape(hq, 2, d, *t.shape[1:])
        return both[:, 0].reshape(hq * d, *t.shape[1:]), both[:, 1].reshape(hq * d, *t.shape[1:])

    q, gate = q_and_gate(take(a + "q_proj.weight"))
    attn.qkv.weight.copy_(torch.cat([q, take(a + "k_proj.weight"), take(a + "v_proj.weight")]))
    attn.gate.weight.copy_(gate)
    if attn.qkv.bias is not None:
        q_bias, gate_bias = q_and_gate(take(a + "q_proj.bias"))
        if gate_bias.abs().max() > 0:
            raise UnsupportedModel(f"{a}q_proj: a bias on the output gate is not served")
        attn.qkv.bias.copy_(torch.cat([q_bias, take(a + "k_proj.bias"), take(a + "v_proj.bias")]))
    attn.o.weight.copy_(take(a + "o_proj.weight"))
    if attn.o.bias is not None:
        attn.o.bias.copy_(take(a + "o_proj.bias"))
    attn.q_norm.copy_(take(a + "q_norm.weight") + 1.0)
    attn.k_norm.copy_(take(a + "k_norm.weight") + 1.0)


def load_gated_delta(net: GatedDeltaNet, take: Checkpoint, a: str) -> None:
    s = net.s
    if take.has(a + "in_proj_qkvz.weight"):  # Qwen3-Next: grouped per key head
        qkv, z, b, a_ = _ungroup(s, take(a + "in_proj_qkvz.weight"), take(a + "in_proj_ba.weight"))
    else:
        qkv, z = take(a + "in_proj_qkv.weight"), take(a + "in_proj_z.weight")
        b, a_ = take(a + "in_proj_b.weight"), take(a + "in_proj_a.weight")
    net.in_proj.weight.copy_(torch.cat([qkv, z]))
    net.in_ba.weight.copy_(torch.cat([b, a_]))
    net.conv_weight.copy_(take(a + "conv1d.weight").reshape(s.conv_channels, s.conv_kernel))
    net.A_log.copy_(take(a + "A_log"))
    net.dt_bias.copy_(take(a + "dt_bias"))
    net.norm.copy_(take(a + "norm.weight"))
    net.out.weight.copy_(take(a + "out_proj.weight"))


def _ungroup(s: GatedDeltaShape, qkvz: torch.Tensor, ba: torch.Tensor):
    """Qwen3-Next's projections, per key head [q, k, v, z] and [b, a] -> q, k, v of every head
    (the conv's channel order), z, b, a."""
    r = s.num_v_heads // s.num_k_heads
    hidden = qkvz.shape[-1]
    grouped = qkvz.reshape(s.num_k_heads, -1, hidden)
    q, k, v, z = grouped.split([s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim], dim=1)
    b, a = ba.reshape(s.num_k_heads, 2 * r, hidden).split([r, r], dim=1)
    flat = [t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]
    return torch.cat(flat[:3]), flat[3], flat[4], flat[5]
