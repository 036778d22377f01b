"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases where `qkv_bias`, the
sliding layers `layer_types` name) with routed experts beside a shared expert behind a sigmoid
gate, in the layers `decoder_sparse_step` and `mlp_only_layers` make sparse (a dense GatedMLP of
`intermediate_size` in the others): softmax, top-k of `num_experts`, renormalised where
`norm_topk_prob` says so.

Checkpoint: `mlp.gate` (the router), `mlp.experts.{e}.gate_proj/up_proj/down_proj` (or the fused
3-D layout), `mlp.shared_expert.*` and `mlp.shared_expert_gate`, as published and as
`save_pretrained` writes them."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_split_attention,
    load_split_projections,
)
from service.models.moe import MoEShape, load_moe_block, sparse_layers

ARCHITECTURES = ("Qwen2MoeForCausalLM",)
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def moe_shape(config) -> MoEShape:
    """The experts of a Qwen MoE config (Qwen3-MoE's too: no shared expert there)."""
    return MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(getattr(config, "norm_topk_prob", True)),  # Qwen3-VL-MoE's has none: always
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )


def shape(config) -> ModelShape:
    moe = moe_shape(config)
    return base_shape(
        config,
        qkv_bias=bool(getattr(config, "qkv_bias", True)),
        moe=moe,
        moe_layers=sparse_layers(config, moe.num_experts),
    )


def load(model: CausalLM, take: Checkpoint, shared: str = "shared_expert.") -> None:
    """Llama's names with experts under `mlp.` in the sparse layers: Qwen3-MoE's checkpoints are
    laid out the same way (its q/k norms apart), and GLM-4.5's and ERNIE 4.5's (their shared
    experts under `shared`)."""
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if model.shape.moe_layers[i]:
            load_split_attention(layer, take, p)
            load_moe_block(layer.mlp, take, p + "mlp.", EXPERT_NAMES, shared=shared)
        else:
            load_split_projections(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
