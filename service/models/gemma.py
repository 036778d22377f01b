"""Gemma, Gemma-2, VaultGemma and Gemma-3 (text): Llama's blocks with Gemma's differences.

- embeddings scaled by sqrt(hidden); RMSNorms of the form x * (1 + w) (stored as 1 + w at load);
- GeGLU (the config's GELU: the tanh approximation in the published ones) MLP;
- Gemma (the first): no more than that (attention scale head_dim ** -0.5, every layer global);
- Gemma-2/3: a norm on each block's output before its residual add, and a pre-MLP norm
  (`sandwich_norms`); attention scale query_pre_attn_scalar ** -0.5; sliding-window and global
  layers as `layer_types` alternate them;
- Gemma-2: attention-score and final-logit soft-capping;
- VaultGemma: Gemma-2's without the norms on the blocks' outputs (its pre-MLP norm is
  `pre_feedforward_layernorm`);
- Gemma-3: q/k per-head norms, a rope base per layer type (local 10k, global 1M and its scaling).
Embeddings are tied unless the config says otherwise.
"""

from __future__ import annotations

import dataclasses

from service.models.layers import (
    CausalLM,
    Checkpoint,
    LayerAttention,
    ModelShape,
    base_shape,
    layer_rope_keys,
    load_common,
    load_split_projections,
)
from service.models.qwen3 import load_qk_norms

ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "VaultGemmaForCausalLM", "Gemma3ForCausalLM")


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))  # on q, k, v and o
    s = base_shape(config, qkv_bias=bias, o_bias=bias, embed_scale=config.hidden_size**0.5)
    if s.architecture == "GemmaForCausalLM":
        return s
    cap = getattr(config, "attn_logit_softcapping", None)
    return dataclasses.replace(
        s,
        layer_attention=tuple(LayerAttention(la.window, cap) for la in s.layer_attention),
        layer_rope=layer_rope_keys(config, s.num_layers),
        qk_norm=s.architecture == "Gemma3ForCausalLM",
        attn_scale=config.query_pre_attn_scalar**-0.5,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        sandwich_norms=s.architecture != "VaultGemmaForCausalLM",
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take, norm_offset=1.0)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight") + 1.0)
        if model.shape.architecture == "VaultGemmaForCausalLM":  # pre-norms only, the MLP's named so
            layer.post_norm.copy_(take(p + "pre_feedforward_layernorm.weight") + 1.0)
            continue
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight") + 1.0)
        if not model.shape.sandwich_norms:  # Gemma (the first)
            continue
        layer.pre_mlp_norm.copy_(take(p + "pre_feedforward_layernorm.weight") + 1.0)
        layer.post_mlp_norm.copy_(take(p + "post_feedforward_layernorm.weight") + 1.0)
    if model.shape.qk_norm:
        load_qk_norms(model, take, norm_offset=1.0)
