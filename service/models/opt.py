"""OPT: the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`) one after the other, learned
absolute positions at offset 2, biases where `enable_bias` (on by default), a ReLU MLP without a
gate of `ffn_dim`, tied embeddings. Served as the models from 125m up publish it: LayerNorm
before each block (`do_layer_norm_before`), no projection around the embeddings; OPT-350m's
post-norm layout is refused. The hub's files name the tensors as `OPTModel` does (`decoder.*`),
`save_pretrained` under `model.decoder.`: both load.

XGLM: OPT's layer under `model.layers`, with the embeddings scaled by sqrt(d_model) (`scale_embedding`),
fixed sinusoidal positions at offset 2 (the table transformers computes, not in the checkpoint) and a
GELU MLP."""

from __future__ import annotations

import math

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    architecture,
    layer_norm_shape,
    load_layer_norm,
    load_linear,
)
from service.models.rope import NO_ROPE

ARCHITECTURES = ("OPTForCausalLM", "XGLMForCausalLM")
POSITION_OFFSET = 2  # OPT's learned (XGLM's sinusoidal) positions start at row 2


def shape(config) -> ModelShape:
    if architecture(config) == "XGLMForCausalLM":
        return layer_norm_shape(
            config,
            1e-5,
            bias=True,
            intermediate_size=config.ffn_dim,
            learned_positions=POSITION_OFFSET,
            layer_rope=(NO_ROPE,) * config.num_hidden_layers,
            embed_scale=math.sqrt(config.d_model) if config.scale_embedding else None,
            tie_word_embeddings=True,
        )
    hidden = config.hidden_size
    unsupported = [
        ("do_layer_norm_before false (post-norm)", not config.do_layer_norm_before),
        ("word_embed_proj_dim != hidden_size", (config.word_embed_proj_dim or hidden) != hidden),
        ("_remove_final_layer_norm", bool(getattr(config, "_remove_final_layer_norm", False))),
        ("layer_norm_elementwise_affine false", not getattr(config, "layer_norm_elementwise_affine", True)),
    ]
    asked = [what for what, set_ in unsupported if set_]
    if asked:
        raise UnsupportedModel(f"OPTForCausalLM: {', '.join(asked)} is not served")
    return layer_norm_shape(
        config,
        1e-5,
        bias=bool(getattr(config, "enable_bias", True)),
        intermediate_size=config.ffn_dim,
        learned_positions=POSITION_OFFSET,
        layer_rope=(NO_ROPE,) * config.num_hidden_layers,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    if architecture(model.config) == "XGLMForCausalLM":
        from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

        rows, dim = model.pos_embed.weight.shape
        table = XGLMSinusoidalPositionalEmbedding.get_embedding(rows, dim, model.config.pad_token_id)
        model.pos_embed.weight.copy_(table)
        model.embed.weight.copy_(take("model.embed_tokens.weight"))
        load_layer_norm(model.norm, take, "model.layer_norm")
        load_layers(model, take, "model.")
        return
    d = (
        "model.decoder." if take.has("model.decoder.embed_tokens.weight") else "decoder."
    )  # the hub's: OPTModel's
    model.embed.weight.copy_(take(d + "embed_tokens.weight"))
    model.pos_embed.weight.copy_(take(d + "embed_positions.weight"))
    load_layer_norm(model.norm, take, d + "final_layer_norm")
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    load_layers(model, take, d)


def load_layers(model: CausalLM, take: Checkpoint, d: str) -> None:
    """The layers under `{d}layers.{i}.` (OPT's names, XGLM's too)."""
    for i, layer in enumerate(model.layers):
        p = f"{d}layers.{i}."
        a = p + "self_attn."
        load_layer_norm(layer.input_norm, take, p + "self_attn_layer_norm")
        load_layer_norm(layer.post_norm, take, p + "final_layer_norm")
        qkv = layer.attn.qkv
        qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")))
        if qkv.bias is not None:
            qkv.bias.copy_(take.cat(*(a + f"{n}_proj.bias" for n in "qkv")))
        load_linear(layer.attn.o, take, a + "out_proj")
        load_linear(layer.mlp.fc, take, p + "fc1")
        load_linear(layer.mlp.proj, take, p + "fc2")
