"""StableLM (StableLM-2, StableLM-3B-4E1T, StableCode): the GPT lineage's LayerNorm block
(`layers.py` `LayerNormDecoderLayer`, LayerNorms with biases) with a gated SiLU MLP, q/k/v biases
where `use_qkv_bias`, rotary on the first `partial_rotary_factor` of each head, attention and MLP
one after the other, or side by side on one norm where `use_parallel_residual`; each q and k head
LayerNorm-ed with its own weights where `qk_layernorm` (StableLM-2-12B)."""

from __future__ import annotations

import torch

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_common,
    load_layer_norm,
    load_split_projections,
)

ARCHITECTURES = ("StableLmForCausalLM",)


def shape(config) -> ModelShape:
    qk_norm = bool(getattr(config, "qk_layernorm", False))
    parallel = bool(getattr(config, "use_parallel_residual", False))
    return layer_norm_shape(
        config,
        config.layer_norm_eps,
        bias=False,
        mlp_gated=True,
        qkv_bias=bool(getattr(config, "use_qkv_bias", False)),
        parallel_blocks=parallel,
        shared_block_norm=parallel,
        qk_norm=qk_norm,
        qk_layer_norm=qk_norm,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        if layer.post_norm is not None:
            load_layer_norm(layer.post_norm, take, p + "post_attention_layernorm")
        if model.shape.qk_norm:  # one LayerNorm per head
            a, attn = p + "self_attn.", layer.attn
            attn.q_norm.copy_(
                torch.stack([take(f"{a}q_layernorm.norms.{h}.weight") for h in range(attn.q_norm.shape[0])])
            )
            attn.k_norm.copy_(
                torch.stack([take(f"{a}k_layernorm.norms.{h}.weight") for h in range(attn.k_norm.shape[0])])
            )
