"""OLMo (the first: OLMo-1B/7B `-hf`, OLMo-7B-0424): Llama's projections and gated SiLU MLP in the
GPT lineage's block (`layers.py` `LayerNormDecoderLayer`), its LayerNorms without a weight or a
bias (eps 1e-5: their weights are set to 1 at load, nothing is read for them), q, k and v clamped to
`clip_qkv` where set, `attention_bias` on all four projections. OLMoE (`olmoe.py`) has the same
clamp; OLMo-2 and -3 are `olmo2.py`."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_split_projections,
)

ARCHITECTURES = ("OlmoForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    return layer_norm_shape(
        config,
        1e-5,
        bias=False,
        mlp_gated=True,
        norm_bias=False,
        qkv_bias=bias,
        o_bias=bias,
        qkv_clip=getattr(config, "clip_qkv", None),
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    model.embed.weight.copy_(take("model.embed_tokens.weight"))
    model.norm.weight.fill_(1.0)  # built on the meta device: nothing there yet
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        load_split_projections(layer, take, f"model.layers.{i}.")
        layer.input_norm.weight.fill_(1.0)
        layer.post_norm.weight.fill_(1.0)
