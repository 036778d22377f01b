"""GLM (GLM-4-9B's `GlmForCausalLM`) and GLM-4 (`Glm4ForCausalLM`, the 0414 models): Llama's
layer with q/k/v biases where `attention_bias` says (o none), the MLP's gate and up published
fused (`gate_up_proj`), and interleaved rotary on the first `partial_rotary_factor` of each head
(0.5 as published), served by reordering q's and k's rows at load (`rotate_pairs_as_halves`).
GLM-4 adds a norm on each block's output before its residual add (`post_self_attn_layernorm`,
`post_mlp_layernorm`: the sandwich norms, plain RMSNorm)."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    architecture,
    base_shape,
    load_common,
    load_split_attention,
    rotate_pairs_as_halves,
)

ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM")


def shape(config) -> ModelShape:
    return base_shape(
        config,
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        sandwich_norms=architecture(config) == "Glm4ForCausalLM",
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_attention(layer, take, p)
        layer.mlp.gate_up.weight.copy_(take(p + "mlp.gate_up_proj.weight"))
        layer.mlp.down.weight.copy_(take(p + "mlp.down_proj.weight"))
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        if model.shape.sandwich_norms:  # GLM-4: its names for the four norms
            layer.post_norm.copy_(take(p + "post_self_attn_layernorm.weight"))
            layer.pre_mlp_norm.copy_(take(p + "post_attention_layernorm.weight"))
            layer.post_mlp_norm.copy_(take(p + "post_mlp_layernorm.weight"))
        else:
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
    rotate_pairs_as_halves(model)
