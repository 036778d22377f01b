"""StableLM (StableLM-2, StableLM-3B-4E1T, StableCode): the GPT lineage's LayerNorm block
(`layers.py` `LayerNormDecoderLayer`, LayerNorms with biases) with a gated SiLU MLP, q/k/v biases
where `use_qkv_bias`, rotary on the first `partial_rotary_factor` of each head, attention and MLP
one after the other, or side by side on one norm where `use_parallel_residual`. Per-head q/k
LayerNorms (`qk_layernorm`, StableLM-2-12B) are not served."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    layer_norm_shape,
    load_common,
    load_layer_norm,
    load_split_projections,
)

ARCHITECTURES = ("StableLmForCausalLM",)


def shape(config) -> ModelShape:
    if getattr(config, "qk_layernorm", False):
        raise UnsupportedModel("StableLmForCausalLM: qk_layernorm is not served")
    parallel = bool(getattr(config, "use_parallel_residual", False))
    return layer_norm_shape(
        config,
        config.layer_norm_eps,
        bias=False,
        mlp_gated=True,
        qkv_bias=bool(getattr(config, "use_qkv_bias", False)),
        parallel_blocks=parallel,
        shared_block_norm=parallel,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        if layer.post_norm is not None:
            load_layer_norm(layer.post_norm, take, p + "post_attention_layernorm")
