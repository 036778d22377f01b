"""Phi-3 and Phi-4-mini: Llama's layer, published with fused `qkv_proj` and `gate_up_proj`
(loaded as they are), partial rotary where `partial_rotary_factor` < 1 (Phi-4-mini), LongRoPE
(`longrope` / `su`) short and long factors (`rope.py`), a sliding window on every layer where the
config sets one."""

from __future__ import annotations

from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape, load_common

ARCHITECTURES = ("Phi3ForCausalLM",)


def shape(config) -> ModelShape:
    return base_shape(config)


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer.attn.qkv.weight.copy_(take(p + "self_attn.qkv_proj.weight"))
        layer.attn.o.weight.copy_(take(p + "self_attn.o_proj.weight"))
        layer.mlp.gate_up.weight.copy_(take(p + "mlp.gate_up_proj.weight"))
        layer.mlp.down.weight.copy_(take(p + "mlp.down_proj.weight"))
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
