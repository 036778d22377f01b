"""Jais 2: Llama's projections in the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`,
LayerNorms with biases, one block after the other), an MLP without a gate (`up_proj`,
`down_proj`; ReLU squared as published), biases where `attention_bias` and `mlp_bias` say (both
on as published)."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_common,
    load_layer_norm,
    load_split_projections,
)

ARCHITECTURES = ("Jais2ForCausalLM",)


def shape(config) -> ModelShape:
    attention_bias = bool(getattr(config, "attention_bias", True))
    return layer_norm_shape(
        config,
        config.layer_norm_eps,
        bias=bool(getattr(config, "mlp_bias", True)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        load_layer_norm(layer.post_norm, take, p + "post_attention_layernorm")
