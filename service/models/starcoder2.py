"""StarCoder2: the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`) one after the other,
LayerNorms with biases, biases on every projection where `use_bias`, a GELU (tanh) MLP without a
gate (`c_fc`, `c_proj`), full rotary, a sliding window on every layer where set, tied
embeddings."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_common,
    load_layer_norm,
    load_linear,
    load_split_attention,
)

ARCHITECTURES = ("Starcoder2ForCausalLM",)


def shape(config) -> ModelShape:
    return layer_norm_shape(config, config.norm_epsilon, bias=bool(getattr(config, "use_bias", True)))


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        load_layer_norm(layer.post_norm, take, p + "post_attention_layernorm")
        load_split_attention(layer, take, p)
        load_linear(layer.mlp.fc, take, p + "mlp.c_fc")
        load_linear(layer.mlp.proj, take, p + "mlp.c_proj")
