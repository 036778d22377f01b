"""Nemotron (Nemotron-3, Minitron, Nemotron-Mini): the GPT lineage's block (`layers.py`
`LayerNormDecoderLayer`) one after the other, its LayerNorms "1p" (scaled by 1 + w: stored as
1 + w at load), an MLP without a gate (`up_proj`, `down_proj`; ReLU squared as published), rotary
on the first `partial_rotary_factor` of each head, biases where `attention_bias` and `mlp_bias`
say, an untied head. (Nemotron-H, its Mamba hybrid, is another architecture.)"""

from __future__ import annotations

from torch import nn

from service.models.layers import CausalLM, Checkpoint, ModelShape, layer_norm_shape, load_split_projections

ARCHITECTURES = ("NemotronForCausalLM",)


def shape(config) -> ModelShape:
    attention_bias = bool(getattr(config, "attention_bias", False))
    return layer_norm_shape(
        config,
        config.norm_eps,
        bias=bool(getattr(config, "mlp_bias", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
    )


def load_norm_1p(norm: nn.LayerNorm, take: Checkpoint, name: str) -> None:
    norm.weight.copy_(take(name + ".weight") + 1.0)
    norm.bias.copy_(take(name + ".bias"))


def load(model: CausalLM, take: Checkpoint) -> None:
    model.embed.weight.copy_(take("model.embed_tokens.weight"))
    load_norm_1p(model.norm, take, "model.norm")
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        load_norm_1p(layer.input_norm, take, p + "input_layernorm")
        load_norm_1p(layer.post_norm, take, p + "post_attention_layernorm")
