"""GPTBigCode (StarCoder 1, StarCoderBase, SantaCoder's successor, tiny_starcoder, WizardCoder):
GPT-2's model (`gpt2.py`: LayerNorm blocks one after the other, learned absolute positions, biases
everywhere, a GELU MLP without a gate, tied embeddings) with one key/value head for all queries
where `multi_query` (else one per query head), and plain linears instead of GPT-2's `Conv1D`.

The fused `c_attn` is [all q | k | v] under multi-query; with a key/value head per query head it
is laid out head by head ([q k v] per head) and reordered at load."""

from __future__ import annotations

from service.models import gpt2
from service.models.gpt_neox import heads_to_blocks
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_linear,
)
from service.models.rope import NO_ROPE

ARCHITECTURES = ("GPTBigCodeForCausalLM",)


def shape(config) -> ModelShape:
    return layer_norm_shape(
        config,
        config.layer_norm_epsilon,
        bias=True,
        num_kv_heads=1 if config.multi_query else config.num_attention_heads,
        intermediate_size=config.n_inner or 4 * config.hidden_size,
        learned_positions=0,
        layer_rope=(NO_ROPE,) * config.num_hidden_layers,
        attn_scale=None if getattr(config, "scale_attn_weights", True) else 1.0,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    s = model.shape
    gpt2.load_frame(model, take)
    for i, layer in enumerate(model.layers):
        p = f"transformer.h.{i}."
        qkv_w, qkv_b = take(p + "attn.c_attn.weight"), take(p + "attn.c_attn.bias")
        if s.num_kv_heads != 1:
            qkv_w, qkv_b = (heads_to_blocks(t, s.num_q_heads, s.head_dim) for t in (qkv_w, qkv_b))
        layer.attn.qkv.weight.copy_(qkv_w)
        layer.attn.qkv.bias.copy_(qkv_b)
        load_linear(layer.attn.o, take, p + "attn.c_proj")
        load_linear(layer.mlp.fc, take, p + "mlp.c_fc")
        load_linear(layer.mlp.proj, take, p + "mlp.c_proj")
