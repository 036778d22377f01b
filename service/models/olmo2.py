"""OLMo-2 and OLMo-3: Llama's projections with the norms moved. No norm before a block: each block
reads the residual stream itself, and its output is RMS-normalised before its residual add
(`post_norms`). q and k are RMS-normalised over their whole projections (all heads at once,
before rotary). OLMo-3 adds sliding-window layers as `layer_types` names them, with a rope per
layer type where the config gives one."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    layer_rope_keys,
    load_common,
    load_split_projections,
)

ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(
        config,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        qk_norm_whole=True,
        post_norms=True,
        layer_rope=layer_rope_keys(config, config.num_hidden_layers),
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        layer.attn.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
        layer.attn.k_norm.copy_(take(p + "self_attn.k_norm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
        layer.post_mlp_norm.copy_(take(p + "post_feedforward_layernorm.weight"))
