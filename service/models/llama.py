"""The Llama family: Llama, SmolLM, Mistral, Qwen2 (the layers are `layers.py`'s).

Qwen2 has q/k/v biases; Llama's `attention_bias` puts biases on all four projections. Sliding
windows: Mistral's on every layer; Qwen2's (`use_sliding_window`) only on the layers at or above
`max_window_layers`, as transformers' `layer_types` say.
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

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    is_qwen2 = architecture(config) == "Qwen2ForCausalLM"
    return base_shape(config, qkv_bias=is_qwen2 or bias, o_bias=bias and not is_qwen2)


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
