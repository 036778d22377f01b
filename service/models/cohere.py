"""Command R (`CohereForCausalLM`, Aya) and Command R7B (`Cohere2ForCausalLM`): attention and a
gated SiLU MLP side by side on one LayerNorm of the layer's input (`layers.py`
`LayerNormDecoderLayer`; LayerNorms without a bias), interleaved rotary (dims 2i and 2i+1 turn
together: q's and k's rows reordered at load, `rotate_pairs_as_halves`), the logits times
`logit_scale`, tied embeddings. Cohere2: sliding-window layers as `layer_types` names them, and
rotary on those only (the full-attention layers have none). Command R+ normalises each q and k
head (`use_qk_norm`: a LayerNorm per head without a bias, weights [heads, head_dim])."""

from __future__ import annotations

import dataclasses

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    architecture,
    base_shape,
    load_common,
    load_layer_norm,
    load_split_projections,
    rotate_pairs_as_halves,
)
from service.models.rope import DEFAULT_LAYER, NO_ROPE

ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")


def shape(config) -> ModelShape:
    arch = architecture(config)
    qk_norm = bool(getattr(config, "use_qk_norm", False))
    bias = bool(getattr(config, "attention_bias", False))
    s = base_shape(
        config,
        norm="layer",
        norm_bias=False,
        norm_eps=config.layer_norm_eps,
        qkv_bias=bias,
        o_bias=bias,
        parallel_blocks=True,
        shared_block_norm=True,
        logits_scale=config.logit_scale,
        qk_norm=qk_norm,
        qk_layer_norm=qk_norm,
    )
    if arch == "Cohere2ForCausalLM":  # rotary on the sliding layers only
        rope = tuple(DEFAULT_LAYER if la.window is not None else NO_ROPE for la in s.layer_attention)
        s = dataclasses.replace(s, layer_rope=rope)
    return s


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        if model.shape.qk_norm:
            layer.attn.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
            layer.attn.k_norm.copy_(take(p + "self_attn.k_norm.weight"))
    rotate_pairs_as_halves(model)
