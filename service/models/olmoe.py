"""OLMoE (OLMoE-1B-7B): Llama's pre-norm layer with q and k RMS-normalised over their whole
projections (as OLMo-2) and then q, k and v clamped to `clip_qkv` where set, and routed experts in
every layer: softmax, top `num_experts_per_tok` of `num_experts` (64 and 8 as published),
renormalised where `norm_topk_prob` says so, each expert a gated SiLU MLP of `intermediate_size`.
FlexOlmo: the same experts in OLMo-2's layer (norms after the blocks only, `post_norms`), no clamp.

Checkpoint: `mlp.gate` (the router) and `mlp.experts.{e}.gate_proj/up_proj/down_proj`, as
published, or the fused 3-D layout `save_pretrained` writes (`docs/moe.md`)."""

from __future__ import annotations

from service.models import qwen2_moe, qwen3
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    architecture,
    base_shape,
    load_common,
    load_split_attention,
)
from service.models.moe import MoEShape, load_moe_block

ARCHITECTURES = ("OlmoeForCausalLM", "FlexOlmoForCausalLM")


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
        post_norms=architecture(config) == "FlexOlmoForCausalLM",
        moe=moe,
        moe_layers=(True,) * config.num_hidden_layers,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    if not model.shape.post_norms:
        qwen2_moe.load(model, take)  # Llama's names, experts under `mlp.` in every layer, no shared expert
    else:  # FlexOlmo: OLMo-2's norms
        load_common(model, take)
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            load_split_attention(layer, take, p)
            load_moe_block(layer.mlp, take, p + "mlp.", qwen2_moe.EXPERT_NAMES)
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
            layer.post_mlp_norm.copy_(take(p + "post_feedforward_layernorm.weight"))
    qwen3.load_qk_norms(model, take)  # its whole-projection weights go under the same names
