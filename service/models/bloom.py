"""BLOOM (bloom-560m to 176B, BLOOMZ): the GPT lineage's block (`layers.py`
`LayerNormDecoderLayer`) one after the other, with a LayerNorm on the embeddings, no positions but
ALiBi (a linear bias per head on the scores, `eager_attention.py`), biases everywhere, a GELU (tanh)
MLP of 4 x hidden, tied embeddings. The fused `query_key_value` is laid out head by head and
reordered at load. `apply_residual_connection_post_layernorm` is refused.

Checkpoint: `transformer.*` as `save_pretrained` writes it, or the hub's files saved from
`BloomModel` (`word_embeddings`, `h.0...`)."""

from __future__ import annotations

import torch

from service.models.gpt_neox import heads_to_blocks
from service.models.layers import (
    CausalLM,
    Checkpoint,
    LayerAttention,
    ModelShape,
    UnsupportedModel,
    layer_norm_shape,
    load_layer_norm,
    load_linear,
)
from service.models.rope import NO_ROPE

ARCHITECTURES = ("BloomForCausalLM",)


def alibi_slopes(heads: int) -> tuple[float, ...]:
    """Each head's ALiBi slope, as transformers' `build_alibi_tensor` makes them (a position's bias
    is its slope times the position: read at position 1)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    return tuple(build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1].tolist())


def shape(config) -> ModelShape:
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        raise UnsupportedModel("BloomForCausalLM: apply_residual_connection_post_layernorm is not served")
    n = config.num_hidden_layers
    return layer_norm_shape(
        config,
        config.layer_norm_epsilon,
        bias=True,
        activation="gelu_tanh",
        intermediate_size=4 * config.hidden_size,
        layer_attention=(LayerAttention(alibi=alibi_slopes(config.num_attention_heads)),) * n,
        layer_rope=(NO_ROPE,) * n,
        embed_layer_norm=True,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    s = model.shape
    t = (
        "transformer." if take.has("transformer.word_embeddings.weight") else ""
    )  # the hub's: BloomModel's names
    model.embed.weight.copy_(take(t + "word_embeddings.weight"))
    load_layer_norm(model.embed_ln, take, t + "word_embeddings_layernorm")
    load_layer_norm(model.norm, take, t + "ln_f")
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"{t}h.{i}."
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        load_layer_norm(layer.post_norm, take, p + "post_attention_layernorm")
        a = p + "self_attention.query_key_value"
        layer.attn.qkv.weight.copy_(heads_to_blocks(take(a + ".weight"), s.num_q_heads, s.head_dim))
        layer.attn.qkv.bias.copy_(heads_to_blocks(take(a + ".bias"), s.num_q_heads, s.head_dim))
        load_linear(layer.attn.o, take, p + "self_attention.dense")
        load_linear(layer.mlp.fc, take, p + "mlp.dense_h_to_4h")
        load_linear(layer.mlp.proj, take, p + "mlp.dense_4h_to_h")
