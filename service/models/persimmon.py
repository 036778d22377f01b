"""Persimmon (persimmon-8b): the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`) one
after the other, biases everywhere, rotary on the first `partial_rotary_factor` of each head (half
as published), where `qk_layernorm` one LayerNorm (with a bias) over each q and k head, the same
for every head, a ReLU-squared MLP without a gate, an untied head. The fused `query_key_value` is
laid out head by head and reordered at load."""

from __future__ import annotations

from service.models.gpt_neox import heads_to_blocks
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_layer_norm,
    load_linear,
)
from service.models.phi import load_shared_qk_layer_norms

ARCHITECTURES = ("PersimmonForCausalLM",)


def shape(config) -> ModelShape:
    qk_norm = bool(getattr(config, "qk_layernorm", False))
    return layer_norm_shape(
        config,
        config.layer_norm_eps,
        bias=True,
        qk_norm=qk_norm,
        qk_layer_norm=qk_norm,
        qk_norm_bias=qk_norm,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    s = model.shape
    model.embed.weight.copy_(take("model.embed_tokens.weight"))
    load_layer_norm(model.norm, take, "model.final_layernorm")
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        load_layer_norm(layer.post_norm, take, p + "post_attention_layernorm")
        a = p + "self_attn."
        for part in ("weight", "bias"):
            qkv = take(f"{a}query_key_value.{part}")
            getattr(layer.attn.qkv, part).copy_(heads_to_blocks(qkv, s.num_q_heads, s.head_dim))
        load_linear(layer.attn.o, take, a + "dense")
        load_linear(layer.mlp.fc, take, p + "mlp.dense_h_to_4h")
        load_linear(layer.mlp.proj, take, p + "mlp.dense_4h_to_h")
        if s.qk_norm:
            load_shared_qk_layer_norms(layer, take, a)
