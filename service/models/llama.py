"""The Llama family: Llama, SmolLM, Mistral, Ministral (and Ministral 3), Qwen2, Seed-OSS, Arcee,
CWM (Code World Model: sliding layers as `layer_types` says) (the layers are `layers.py`'s).

Biases: Llama's `attention_bias` puts them on all four projections (and `mlp_bias` on the MLP's);
Qwen2 always has q/k/v biases and none on o; Seed-OSS biases o by its own `attention_out_bias`. Sliding windows: Mistral's on every layer; Qwen2's
(`use_sliding_window`) only on the layers at or above `max_window_layers`, and Ministral's on the
layers its `layer_types` name, as transformers' `layer_types` say. Arcee (AFM) has an MLP without
a gate (`up_proj`, `down_proj`; ReLU squared as published). Ministral 3 is Mistral's with q scaled
by position past `original_max_position_embeddings` (`llama_4_scaling_beta`).
"""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    architecture,
    base_shape,
    load_common,
    load_split_projections,
)

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MinistralForCausalLM",
    "Ministral3ForCausalLM",
    "Qwen2ForCausalLM",
    "SeedOssForCausalLM",
    "ArceeForCausalLM",
    "CwmForCausalLM",
)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    qkv_bias, o_bias = {  # where a family departs from Llama's rule
        "Qwen2ForCausalLM": (True, False),
        "SeedOssForCausalLM": (bias, bool(getattr(config, "attention_out_bias", False))),
    }.get(architecture(config), (bias, bias))
    gated = architecture(config) != "ArceeForCausalLM"
    return base_shape(
        config, qkv_bias=qkv_bias, o_bias=o_bias, mlp_gated=gated, q_position_scale=q_position_scale(config)
    )


def q_position_scale(config) -> tuple[float, int] | None:
    """Ministral 3's and Mistral 4's (beta, period) where their rope parameters give a beta."""
    if architecture(config) not in ("Ministral3ForCausalLM", "Mistral4ForCausalLM"):
        return None
    params = getattr(config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta")
    return None if beta is None else (float(beta), int(params["original_max_position_embeddings"]))


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
