"""HyperCLOVA X (HyperCLOVAX-SEED-Think-14B): Granite's layer and multipliers with a norm on each
block's output before the multiplier and the residual add (`use_post_norm`, Gemma-2's sandwich
norms), and the logits multiplied by `logits_scaling` where Granite divides by it."""

from __future__ import annotations

import dataclasses

from service.models import granite, llama
from service.models.layers import CausalLM, Checkpoint, ModelShape

ARCHITECTURES = ("HyperCLOVAXForCausalLM",)


def shape(config) -> ModelShape:
    return dataclasses.replace(
        granite.shape(config),
        logits_divisor=None,
        logits_scale=config.logits_scaling,
        sandwich_norms=bool(config.use_post_norm),
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    llama.load(model, take)
    if not model.shape.sandwich_norms:
        return
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer.post_norm.copy_(take(p + "post_norm1.weight"))
        layer.pre_mlp_norm.copy_(take(p + "post_attention_layernorm.weight"))
        layer.post_mlp_norm.copy_(take(p + "post_norm2.weight"))
