"""OLMoE (OLMoE-1B-7B): Llama's pre-norm layer with q and k RMS-normalised over their whole
projections (as OLMo-2) and then q, k and v clamped to `clip_qkv` where set, and routed experts in
every layer: softmax, top `num_experts_per_tok` of `num_experts` (64 and 8 as published),
renormalised where `norm_topk_prob` says so, each expert a gated SiLU MLP of `intermediate_size`.

Checkpoint: `mlp.gate` (the router) and `mlp.experts.{e}.gate_proj/up_proj/down_proj`, as
published, or the fused 3-D layout `save_pretrained` writes (`docs/moe.md`)."""

from __future__ import annotations

from service.models import qwen2_moe, qwen3
from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape
from service.models.moe import MoEShape

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
    qwen2_moe.load(model, take)  # Llama's names, experts under `mlp.` in every layer, no shared expert
    qwen3.load_qk_norms(model, take)  # its whole-projection weights go under the same names
