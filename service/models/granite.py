"""Granite (IBM Granite 3.x dense): Llama's layer with four multipliers from the config:
embeddings times `embedding_multiplier`, attention scores times `attention_multiplier` (in place
of head_dim ** -0.5), each block's output times `residual_multiplier` before its residual add,
and the logits divided by `logits_scaling`."""

from __future__ import annotations

import dataclasses

from service.models import llama
from service.models.layers import ModelShape

ARCHITECTURES = ("GraniteForCausalLM",)
load = llama.load


def shape(config) -> ModelShape:
    return dataclasses.replace(
        llama.shape(config),
        attn_scale=config.attention_multiplier,
        embed_scale=config.embedding_multiplier,
        residual_scale=config.residual_multiplier,
        logits_divisor=config.logits_scaling,
    )
