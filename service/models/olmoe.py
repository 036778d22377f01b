"""OLMoE (OLMoE-1B-7B): Llama's pre-norm layer with q and k RMS-normalised over their whole
projections (as OLMo-2) and then q, k and v clamped to `clip_qkv` where set, and routed experts in
every layer: softmax, top `num_experts_per_tok` of `num_experts` (64 and 8 as published),
renormalised where `norm_topk_prob` says so, each expert a gated SiLU MLP of `intermediate_size`.

Checkpoint: `mlp.gate` (the router) and `mlp.experts.{e}.gate_proj/up_proj/down_proj`, as
published, or the fused 3-D layout `save_pretrained` writes (`docs/moe.md`)."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_split_attention,
)
from service.models.moe import MoEShape, load_moe_block

ARCHITECTURES = ("OlmoeForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    moe = MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=bool(config.norm_topk_prob),
    )
    return base_shape(
        config,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        qk_norm_whole=True,
        qkv_clip=getattr(config, "clip_qkv", None),
        moe=moe,
        moe_layers=(True,) * config.num_hidden_layers,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_attention(layer, take, p)
        layer.attn.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
        layer.attn.k_norm.copy_(take(p + "self_attn.k_norm.weight"))
        load_moe_block(layer.mlp, take, p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
