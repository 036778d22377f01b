"""MiniCPM3 (MiniCPM3-4B): multi-head latent attention (`mla.py`, DeepSeek-V2's, with rotary on
halves, not interleaved pairs) on Llama's dense layers, with three multipliers: embeddings times
`scale_emb`, each block's output times `scale_depth / sqrt(num_hidden_layers)` before its residual
add, and the logits divided by `hidden_size / dim_model_base`."""

from __future__ import annotations

import math
from functools import partial

from service.models import deepseek
from service.models.layers import ModelShape

ARCHITECTURES = ("MiniCPM3ForCausalLM",)
load = partial(deepseek.load, interleaved=False)


def shape(config) -> ModelShape:
    return deepseek.dense_shape(
        config,
        embed_scale=float(config.scale_emb),
        residual_scale=config.scale_depth / math.sqrt(config.num_hidden_layers),
        logits_divisor=config.hidden_size / config.dim_model_base,
    )
