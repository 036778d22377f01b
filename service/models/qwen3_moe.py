"""Qwen3-MoE: Qwen3's attention (an RMSNorm over each q and k head, no qkv bias) with routed
experts in the layers `decoder_sparse_step` and `mlp_only_layers` make sparse (a dense
GatedMLP of `intermediate_size` in the others): softmax, top-k of `num_experts`, renormalised
where `norm_topk_prob` says so. A sliding window (`use_sliding_window`) applies to every layer,
as transformers' Qwen3-MoE does. No shared expert (the config has none). Mellum 2: the same layer
with sliding windows and a rope per layer type as `layer_types` names them, dense layers where
`mlp_layer_types` says.

Checkpoint: `mlp.gate` (the router) and `mlp.experts.{e}.gate_proj/up_proj/down_proj`, as
published and as `save_pretrained` writes them; the fused 3-D layout too."""

from __future__ import annotations

import dataclasses

from service.models import qwen2_moe, qwen3
from service.models.layers import CausalLM, Checkpoint, ModelShape, architecture, layer_rope_keys
from service.models.moe import sparse_layers

ARCHITECTURES = ("Qwen3MoeForCausalLM", "MellumForCausalLM")


def shape(config) -> ModelShape:
    moe = qwen2_moe.moe_shape(config)
    s = dataclasses.replace(qwen3.shape(config), moe=moe, moe_layers=sparse_layers(config, moe.num_experts))
    if architecture(config) == "MellumForCausalLM":
        n = config.num_hidden_layers
        mlp = tuple(t == "sparse" for t in config.mlp_layer_types)
        s = dataclasses.replace(s, moe_layers=mlp, layer_rope=layer_rope_keys(config, n))
    return s


def load(model: CausalLM, take: Checkpoint) -> None:
    qwen2_moe.load(model, take)
    qwen3.load_qk_norms(model, take)
