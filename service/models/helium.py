"""Helium (Kyutai): Llama's layer with interleaved rotary (dims 2i and 2i+1 turn together), served
by reordering q's and k's rows at load (`rotate_pairs_as_halves`); `attention_bias` biases q, k
and v, never o."""

from __future__ import annotations

from service.models import llama
from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape, rotate_pairs_as_halves

ARCHITECTURES = ("HeliumForCausalLM",)


def shape(config) -> ModelShape:
    return base_shape(config, qkv_bias=bool(getattr(config, "attention_bias", False)))


def load(model: CausalLM, take: Checkpoint) -> None:
    llama.load(model, take)
    rotate_pairs_as_halves(model)
