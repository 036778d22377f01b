"""GPT-NeoX (Pythia and its kin): the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`),
attention and MLP side by side on the layer's input where `use_parallel_residual` (a LayerNorm
each), rotary on the first `partial_rotary_factor` of each head (`rotary_pct`, 0.25 as
published), biases on every projection, a GELU MLP without a gate, an untied head (`embed_out`).

Checkpoint: `gpt_neox.*`; the fused `query_key_value` is laid out head by head ([q k v] per
head) and reordered at load to all q heads, then k, then v."""

from __future__ import annotations

import torch

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_layer_norm,
    load_linear,
)

ARCHITECTURES = ("GPTNeoXForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", True))
    return layer_norm_shape(
        config,
        config.layer_norm_eps,
        bias=True,
        qkv_bias=bias,
        o_bias=bias,
        parallel_blocks=bool(config.use_parallel_residual),
    )


def heads_to_blocks(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows [q k v] per head -> [all q | all k | all v] (a weight's rows, or a bias)."""
    return t.view(heads, 3, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def load(model: CausalLM, take: Checkpoint) -> None:
    s = model.shape
    model.embed.weight.copy_(take("gpt_neox.embed_in.weight"))
    load_layer_norm(model.norm, take, "gpt_neox.final_layer_norm")
    model.lm_head.weight.copy_(take("embed_out.weight"))
    for i, layer in enumerate(model.layers):
        p = f"gpt_neox.layers.{i}."
        load_layer_norm(layer.input_norm, take, p + "input_layernorm")
        load_layer_norm(layer.post_norm, take, p + "post_attention_layernorm")
        qkv = layer.attn.qkv
        qkv.weight.copy_(
            heads_to_blocks(take(p + "attention.query_key_value.weight"), s.num_q_heads, s.head_dim)
        )
        if qkv.bias is not None:
            qkv.bias.copy_(
                heads_to_blocks(take(p + "attention.query_key_value.bias"), s.num_q_heads, s.head_dim)
            )
        load_linear(layer.attn.o, take, p + "attention.dense")
        load_linear(layer.mlp.fc, take, p + "mlp.dense_h_to_4h")
        load_linear(layer.mlp.proj, take, p + "mlp.dense_4h_to_h")
