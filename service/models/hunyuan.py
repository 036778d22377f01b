"""HunYuan dense (Hunyuan-0.5B to 7B): Llama's layer with an RMSNorm over each q and k head after
rotary (`query_layernorm`, `key_layernorm`), `attention_bias` on all four projections, and its rope
base stretched by a fixed NTK alpha where the rope parameters say `dynamic` with an `alpha`
(`rope.py`)."""

from __future__ import annotations

from service.models import llama
from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape

ARCHITECTURES = ("HunYuanDenseV1ForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(config, qk_norm=True, qk_norm_after_rope=True, qkv_bias=bias, o_bias=bias)


def load(model: CausalLM, take: Checkpoint) -> None:
    llama.load(model, take)
    for i, layer in enumerate(model.layers):
        a = f"model.layers.{i}.self_attn."
        layer.attn.q_norm.copy_(take(a + "query_layernorm.weight"))
        layer.attn.k_norm.copy_(take(a + "key_layernorm.weight"))
