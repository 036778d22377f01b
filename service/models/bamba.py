"""Bamba (IBM): Mamba-2 layers (mamba2.py) and Llama's attention (rotary on half of each head) at
`attn_layer_indices`, a SwiGLU MLP (`feed_forward.gate_proj/up_proj/down_proj`) in every layer;
norms `input_layernorm`, `pre_ff_layernorm` and `final_layernorm`. Prefix cache with state snapshots (recurrent.py)."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_linear,
    load_split_attention,
)
from service.models.mamba2 import load_mamba2, mamba2_shape

ARCHITECTURES = ("BambaForCausalLM",)


def shape(config) -> ModelShape:
    types = list(config.layers_block_type)  # "full_attention" or "linear_attention" (Mamba-2)
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(
        config,
        qkv_bias=bias,
        o_bias=bias,
        recurrent=mamba2_shape(config),
        recurrent_layers=tuple(t == "linear_attention" for t in types),
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take, norm="model.final_layernorm")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if model.shape.is_recurrent(i):
            load_mamba2(layer.attn, take, p + "mamba.")
        else:
            load_split_attention(layer, take, p)
        f = p + "feed_forward."
        layer.mlp.gate_up.weight.copy_(take.cat(f + "gate_proj.weight", f + "up_proj.weight"))
        load_linear(layer.mlp.down, take, f + "down_proj")
        if layer.mlp.gate_up.bias is not None:
            layer.mlp.gate_up.bias.copy_(take.cat(f + "gate_proj.bias", f + "up_proj.bias"))
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "pre_ff_layernorm.weight"))
