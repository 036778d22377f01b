"""Phi-1.5 and Phi-2: the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`) with
attention and MLP side by side on one LayerNorm of the layer's input, rotary on the first
`partial_rotary_factor` of each head, biases on every projection and on the LM head, a GELU
(tanh) MLP without a gate, and where `qk_layernorm` one LayerNorm (with a bias) over each q and
k head, the same for every head."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_layer_norm,
    load_linear,
)

ARCHITECTURES = ("PhiForCausalLM",)


def shape(config) -> ModelShape:
    qk_norm = bool(getattr(config, "qk_layernorm", False))
    return layer_norm_shape(
        config,
        config.layer_norm_eps,
        bias=True,
        parallel_blocks=True,
        shared_block_norm=True,
        lm_head_bias=True,
        tie_word_embeddings=False,  # a tied head still has its own bias: the embeddings are copied
        qk_norm=qk_norm,
        qk_layer_norm=qk_norm,
        qk_norm_bias=qk_norm,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    model.embed.weight.copy_(take("model.embed_tokens.weight"))
    load_layer_norm(model.norm, take, "model.final_layernorm")
    head = "lm_head.weight" if take.has("lm_head.weight") else "model.embed_tokens.weight"
    model.lm_head.weight.copy_(take(head))
    model.lm_head.bias.copy_(take("lm_head.bias"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        a = p + "self_attn."
        layer.attn.qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")))
        layer.attn.qkv.bias.copy_(take.cat(*(a + f"{n}_proj.bias" for n in "qkv")))
        load_linear(layer.attn.o, take, a + "dense")
        load_linear(layer.mlp.fc, take, p + "mlp.fc1")
        load_linear(layer.mlp.proj, take, p + "mlp.fc2")
        if model.shape.qk_norm:
            load_shared_qk_layer_norms(layer, take, a)


def load_shared_qk_layer_norms(layer, take: Checkpoint, a: str) -> None:
    """`{a}q_layernorm` and `{a}k_layernorm`: one LayerNorm (weight and bias) for every head."""
    attn = layer.attn
    for n, w, b in (("q", attn.q_norm, attn.q_norm_bias), ("k", attn.k_norm, attn.k_norm_bias)):
        w.copy_(take(f"{a}{n}_layernorm.weight").expand_as(w))
        b.copy_(take(f"{a}{n}_layernorm.bias").expand_as(b))
