"""GPT-Neo (EleutherAI's 125M to 2.7B): GPT-2's model (`gpt2.py`: LayerNorm blocks one after the
other, learned absolute positions, a GELU MLP without a gate, tied embeddings) with its own
attention: scores not scaled (no 1 / sqrt(head_dim)), no biases on q, k and v (one on the output
projection), and the layers `attention_layers` marks "local" attending to the last `window_size`
tokens (a sliding window), the "global" ones to all."""

from __future__ import annotations

from service.models import gpt2
from service.models.layers import (
    CausalLM,
    Checkpoint,
    LayerAttention,
    ModelShape,
    UnsupportedModel,
    layer_norm_shape,
    load_linear,
)
from service.models.rope import NO_ROPE

ARCHITECTURES = ("GPTNeoForCausalLM",)


def shape(config) -> ModelShape:
    kinds = list(config.attention_layers)
    if set(kinds) - {"global", "local"}:
        raise UnsupportedModel(
            f"GPTNeoForCausalLM: attention layers {sorted(set(kinds))} (global and local served)"
        )
    return layer_norm_shape(
        config,
        config.layer_norm_epsilon,
        bias=True,
        qkv_bias=False,
        intermediate_size=config.intermediate_size or 4 * config.hidden_size,
        learned_positions=0,
        layer_rope=(NO_ROPE,) * config.num_hidden_layers,
        layer_attention=tuple(LayerAttention(config.window_size if k == "local" else None) for k in kinds),
        attn_scale=1.0,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    gpt2.load_frame(model, take)
    for i, layer in enumerate(model.layers):
        p = f"transformer.h.{i}."
        a = p + "attn.attention."
        layer.attn.qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")))
        load_linear(layer.attn.o, take, a + "out_proj")
        load_linear(layer.mlp.fc, take, p + "mlp.c_fc")
        load_linear(layer.mlp.proj, take, p + "mlp.c_proj")
