"""Granite MoE (IBM Granite 3.x 1B/3B-A..., and the `Shared` variant): Granite's layer and
multipliers (`granite.py`) with routed experts in every layer: top `num_experts_per_tok` of
`num_local_experts`, softmax over the chosen ones (the renormalised softmax, `moe.py`), experts
of `intermediate_size`; the Shared variant adds a shared expert of `shared_intermediate_size`
to their sum, without a gate. Granite 4.0's hybrid architecture (GraniteMoeHybrid): Mamba-2 layers
(`mamba2.py`) and attention as `layer_types` says (Granite-4.0-H; Granite-4.0-Micro has attention
in every layer), rotary where `position_embedding_type` is "rope", none otherwise, and with no
experts (`num_local_experts` 0) the shared MLP alone, gated.

Checkpoint: the Mamba layers under `mamba.` (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`); as published, `block_sparse_moe.router.layer`, `block_sparse_moe.input_linear`
([E, 2I, H]: gate then up) and `output_linear` ([E, H, I]), `shared_mlp.input_linear` /
`output_linear`; transformers' in-memory names (`router.weight`, `experts.gate_up_proj`,
`experts.down_proj`) too."""

from __future__ import annotations

import dataclasses

from service.models import granite, mixtral
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    architecture,
    load_common,
    load_split_attention,
    served_layer_types,
)
from service.models.mamba2 import load_mamba2, mamba2_shape
from service.models.rope import NO_ROPE

ARCHITECTURES = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM")


def shape(config) -> ModelShape:
    if architecture(config) == "GraniteMoeHybridForCausalLM":
        return hybrid_shape(config)
    moe = dataclasses.replace(
        mixtral.moe_shape(config),
        shared_intermediate_size=getattr(config, "shared_intermediate_size", 0) or 0,
        shared_gated=False,
    )
    return dataclasses.replace(granite.shape(config), moe=moe, moe_layers=(True,) * config.num_hidden_layers)


MAMBA = ("mamba", "linear_attention")  # the published name, and transformers'
ATTENTION = ("attention", "full_attention")


def hybrid_shape(config) -> ModelShape:
    """Granite 4.0's layout: Mamba-2 layers (mamba2.py) and attention as `layer_types` says."""
    types = served_layer_types(config, MAMBA + ATTENTION)
    s = granite.shape(config)
    if config.position_embedding_type != "rope":
        s = dataclasses.replace(s, layer_rope=(NO_ROPE,) * s.num_layers)
    if any(t in MAMBA for t in types):
        s = dataclasses.replace(
            s, recurrent=mamba2_shape(config), recurrent_layers=tuple(t in MAMBA for t in types)
        )
    if not config.num_local_experts:  # the shared MLP alone: a gated MLP of its size
        return dataclasses.replace(s, intermediate_size=config.shared_intermediate_size)
    moe = dataclasses.replace(
        mixtral.moe_shape(config),
        shared_intermediate_size=config.shared_intermediate_size,
        shared_gated=False,
    )
    return dataclasses.replace(s, moe=moe, moe_layers=(True,) * s.num_layers)


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q = p + "block_sparse_moe."
        if model.shape.is_recurrent(i):
            load_mamba2(layer.attn, take, p + "mamba.")
        else:
            load_split_attention(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
        if model.shape.moe is None:  # Granite 4.0 without experts: the shared MLP alone
            layer.mlp.gate_up.weight.copy_(take(p + "shared_mlp.input_linear.weight"))
            layer.mlp.down.weight.copy_(take(p + "shared_mlp.output_linear.weight"))
            continue
        moe = layer.mlp
        moe.router.weight.copy_(take.first(q + "router.layer.weight", q + "router.weight"))
        moe.w_gate_up.copy_(take.first(q + "input_linear.weight", q + "experts.gate_up_proj"))
        moe.w_down.copy_(take.first(q + "output_linear.weight", q + "experts.down_proj"))
        if moe.shared is not None:
            moe.shared["gate_up"].weight.copy_(take(p + "shared_mlp.input_linear.weight"))
            moe.shared["down"].weight.copy_(take(p + "shared_mlp.output_linear.weight"))
