"""Jais 2: Llama's projections in the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`,
LayerNorms with biases, one block after the other), an MLP without a gate (`up_proj`,
`down_proj`; ReLU squared as published), biases where `attention_bias` and `mlp_bias` say (both
on as published)."""

from __future__ import annotations

from service.models import stablelm
from service.models.layers import ModelShape, layer_norm_shape

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


load = stablelm.load  # Llama's projections (the MLP's without a gate), a LayerNorm before each block
