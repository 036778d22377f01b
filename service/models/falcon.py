"""Falcon (7B, 40B, 180B, Falcon2-11B; Falcon 3 is Llama's): the GPT lineage's block (`layers.py`
`LayerNormDecoderLayer`) with rotary over whole heads, a GELU MLP without a gate of
`ffn_hidden_size`, biases where `bias` says, tied embeddings as published. Its three layouts:
- 7B (`multi_query`, `parallel_attn`): one key/value head, attention and MLP side by side on one
  LayerNorm; the fused `query_key_value` is [all q | k | v] already;
- 40B and 180B (`new_decoder_architecture`): `num_kv_heads` key/value heads, attention and MLP side
  by side on a norm each (`ln_attn`, `ln_mlp`; Falcon2-11B: one, `num_ln_in_parallel_attn` 1); the
  fused projection is [the group's q heads, k, v] per key/value head, reordered at load;
- neither (`parallel_attn` false): blocks one after the other, [q k v] per head, reordered at load.
ALiBi (`alibi`: falcon-rw) is not served."""

from __future__ import annotations

import torch

from service.models.gpt_neox import heads_to_blocks
from service.models.layers import (
    ACTIVATION_OF_CONFIG,
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    layer_norm_shape,
    load_layer_norm,
    load_linear,
)

ARCHITECTURES = ("FalconForCausalLM",)


def shape(config) -> ModelShape:
    if config.alibi:
        raise UnsupportedModel("FalconForCausalLM: ALiBi (alibi true) is not served")
    if config.activation not in ACTIVATION_OF_CONFIG:
        raise UnsupportedModel(f"FalconForCausalLM: activation {config.activation!r} is not served")
    heads = config.num_attention_heads
    if config.new_decoder_architecture:
        kv_heads, parallel = config.num_kv_heads, True
        shared_norm = (config.num_ln_in_parallel_attn or 2) == 1
    else:
        kv_heads = 1 if config.multi_query else heads
        parallel = bool(config.parallel_attn)
        shared_norm = parallel
    return layer_norm_shape(
        config,
        config.layer_norm_epsilon,
        bias=bool(config.bias),
        num_kv_heads=kv_heads,
        intermediate_size=config.ffn_hidden_size,
        activation=ACTIVATION_OF_CONFIG[config.activation],
        parallel_blocks=parallel,
        shared_block_norm=shared_norm,
    )


def fused_to_blocks(t: torch.Tensor, config, heads: int, kv_heads: int, d: int) -> torch.Tensor:
    """`query_key_value`'s rows (or bias) -> [all q | all k | all v]."""
    if config.new_decoder_architecture:  # per key/value head: its group's q heads, then k, then v
        groups = t.view(kv_heads, heads // kv_heads + 2, d, *t.shape[1:])
        q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
        return torch.cat([x.reshape(-1, *t.shape[1:]) for x in (q, k, v)])
    if config.multi_query:
        return t
    return heads_to_blocks(t, heads, d)


def load(model: CausalLM, take: Checkpoint) -> None:
    s, cfg = model.shape, model.config
    model.embed.weight.copy_(take("transformer.word_embeddings.weight"))
    load_layer_norm(model.norm, take, "transformer.ln_f")
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"transformer.h.{i}."
        a = p + "self_attention."
        qkv = layer.attn.qkv
        qkv.weight.copy_(
            fused_to_blocks(
                take(a + "query_key_value.weight"), cfg, s.num_q_heads, s.num_kv_heads, s.head_dim
            )
        )
        if qkv.bias is not None:
            qkv.bias.copy_(
                fused_to_blocks(
                    take(a + "query_key_value.bias"), cfg, s.num_q_heads, s.num_kv_heads, s.head_dim
                )
            )
        load_linear(layer.attn.o, take, a + "dense")
        load_linear(layer.mlp.fc, take, p + "mlp.dense_h_to_4h")
        load_linear(layer.mlp.proj, take, p + "mlp.dense_4h_to_h")
        two_norms = layer.post_norm is not None and s.parallel_blocks
        load_layer_norm(layer.input_norm, take, p + ("ln_attn" if two_norms else "input_layernorm"))
        if layer.post_norm is not None:
            load_layer_norm(
                layer.post_norm, take, p + ("ln_mlp" if two_norms else "post_attention_layernorm")
            )
