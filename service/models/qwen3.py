"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and k head before rotary, no qkv
bias (`attention_bias` adds them, on q/k/v/o alike), sliding windows as Qwen2's."""

from __future__ import annotations

from service.models import llama
from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape

ARCHITECTURES = ("Qwen3ForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(config, qk_norm=True, qkv_bias=bias, o_bias=bias)


def load_qk_norms(model: CausalLM, take: Checkpoint, norm_offset: float = 0.0) -> None:
    """The per-head q/k norms (norm_offset 1: Gemma's (1 + w), stored as 1 + w)."""
    for i, layer in enumerate(model.layers):
        a = f"model.layers.{i}.self_attn."
        layer.attn.q_norm.copy_(take(a + "q_norm.weight") + norm_offset)
        layer.attn.k_norm.copy_(take(a + "k_norm.weight") + norm_offset)


def load(model: CausalLM, take: Checkpoint) -> None:
    llama.load(model, take)
    load_qk_norms(model, take)
