"""Mixtral: Llama's attention (sliding window on every layer where the config sets one) with a
mixture of experts in every layer: top-k of `num_local_experts` (8, top-2 as published),
softmax then top-k, the k weights renormalised (`moe.py`).

Checkpoint: `block_sparse_moe.gate` (the router) and `block_sparse_moe.experts.{e}.w1/w3/w2`
(gate, up, down), as published and as transformers' `save_pretrained` writes them; the fused
3-D layout under `mlp.experts` too."""

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

ARCHITECTURES = ("MixtralForCausalLM",)
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def moe_shape(config) -> MoEShape:
    """The experts of a config that names them as Mixtral does (Granite MoE's too)."""
    return MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=True,
    )


def shape(config) -> ModelShape:
    return base_shape(config, moe=moe_shape(config), moe_layers=(True,) * config.num_hidden_layers)


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_attention(layer, take, p)
        moe = p + ("mlp." if take.has(p + "mlp.gate.weight") else "block_sparse_moe.")
        load_moe_block(layer.mlp, take, moe, EXPERT_NAMES)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
