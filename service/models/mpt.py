"""MPT (mpt-7b, mpt-30b and their chat/instruct tunes): the GPT lineage's block (`layers.py`
`LayerNormDecoderLayer`) one after the other, LayerNorms without biases, no biases anywhere, no
positions but ALiBi (`eager_attention.py`; slopes from `alibi_bias_max` 8, as transformers builds
them), q, k and v clamped to `clip_qkv` where set, `softmax_scale`, a GELU MLP of 4 x hidden, tied
embeddings. `qk_ln` and positions learned instead of ALiBi are refused.

Checkpoint: `transformer.wte`, `transformer.blocks.{i}.norm_1 / attn.Wqkv / attn.out_proj / norm_2 /
ffn.up_proj / ffn.down_proj`, `transformer.norm_f`."""

from __future__ import annotations

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

ARCHITECTURES = ("MptForCausalLM",)


def alibi_slopes(heads: int) -> tuple[float, ...]:
    """Each head's ALiBi slope, as transformers' `build_mpt_alibi_tensor` makes them (its bias at
    the last of two positions is 0, at the first minus the slope)."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    return tuple((-build_mpt_alibi_tensor(heads, 2)[:, 0, 0]).tolist())


def shape(config) -> ModelShape:
    attn = config.attn_config
    if getattr(attn, "qk_ln", False):
        raise UnsupportedModel("MptForCausalLM: qk_ln is not served")
    if not getattr(attn, "alibi", True):
        raise UnsupportedModel("MptForCausalLM: positions without ALiBi are not served")
    n = config.num_hidden_layers
    return layer_norm_shape(
        config,
        config.layer_norm_epsilon,
        bias=False,
        norm_bias=False,
        activation="gelu",
        intermediate_size=4 * config.hidden_size,
        layer_attention=(LayerAttention(alibi=alibi_slopes(config.num_attention_heads)),) * n,
        layer_rope=(NO_ROPE,) * n,
        attn_scale=attn.softmax_scale,
        qkv_clip=attn.clip_qkv or None,
        tie_word_embeddings=True,
        max_position_embeddings=config.max_seq_len,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    model.embed.weight.copy_(take("transformer.wte.weight"))
    model.norm.weight.copy_(take("transformer.norm_f.weight"))
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"transformer.blocks.{i}."
        layer.input_norm.weight.copy_(take(p + "norm_1.weight"))
        layer.post_norm.weight.copy_(take(p + "norm_2.weight"))
        load_linear(layer.attn.qkv, take, p + "attn.Wqkv")
        load_linear(layer.attn.o, take, p + "attn.out_proj")
        load_linear(layer.mlp.fc, take, p + "ffn.up_proj")
        load_linear(layer.mlp.proj, take, p + "ffn.down_proj")
