"""ERNIE 4.5 (dense): Llama's layer with biases on every projection where `use_bias` says, and
interleaved rotary (dims 2i and 2i+1 turn together), served by reordering q's and k's rows at
load (`rotate_pairs_as_halves`)."""

from __future__ import annotations

from service.models import llama
from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape, rotate_pairs_as_halves

ARCHITECTURES = ("Ernie4_5ForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "use_bias", False))
    return base_shape(config, qkv_bias=bias, o_bias=bias, mlp_bias=bias)


def load(model: CausalLM, take: Checkpoint) -> None:
    llama.load(model, take)
    rotate_pairs_as_halves(model)
