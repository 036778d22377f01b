"""LFM2, LFM2-MoE and LFM3 (Liquid AI): short gated convolutions (short_conv.py, a recurrent layer with a
conv state per request slot) in the layers `layer_types` names `conv`, Qwen3's attention (per-head
q/k RMSNorms, `q_layernorm` / `k_layernorm`) in the `full_attention` ones. Pre-norm blocks
(`operator_norm`, `ffn_norm`), the final norm named `embedding_norm`, tied embeddings as published.

MLPs: SwiGLU of `w1` (gate), `w3` (up), `w2` (down); LFM2's width is `intermediate_size` adjusted as
transformers does (`block_auto_adjust_ff_dim`: two thirds, times `block_ffn_dim_multiplier`,
rounded up to `block_multiple_of`). LFM2-MoE: the first `num_dense_layers` dense, then routed
experts: sigmoid scores, the choice on the scores plus `expert_bias` (`use_expert_bias`), top
`num_experts_per_tok`, renormalised where `norm_topk_prob`, times `routed_scaling_factor`.

LFM3: sliding and full attention layers (`layer_types`, a rope per type, `proportional` on the
full ones), a sigmoid gate per head on attention's output (`gate_proj` as published, `g_proj` in memory; `use_attention_gate`), norms
after the mixer and the MLP too (`use_sandwich_norm`: `post_operator_norm`, `post_ffn_norm`),
`q_norm` / `k_norm` and `o_proj`, the MLP's width as given."""

from __future__ import annotations

import dataclasses

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    architecture,
    base_shape,
    load_common,
    load_linear,
    served_layer_types,
)
from service.models.moe import BiasedRouting, MoEShape, load_moe_block
from service.models.short_conv import ShortConv, ShortConvShape

ARCHITECTURES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM")
MIXERS = ("conv", "full_attention", "sliding_attention")


def mlp_width(config) -> int:
    width = config.intermediate_size
    if architecture(config) != "Lfm2ForCausalLM" or not getattr(config, "block_auto_adjust_ff_dim", False):
        return width
    width = int(2 * width / 3)
    multiplier = getattr(config, "block_ffn_dim_multiplier", None)
    if multiplier is not None:
        step = config.block_multiple_of
        width = step * ((int(multiplier * width) + step - 1) // step)
    return width


def shape(config) -> ModelShape:
    arch = architecture(config)
    types = served_layer_types(config, MIXERS)
    s = base_shape(
        config,
        norm_eps=config.norm_eps,
        qk_norm=True,
        intermediate_size=mlp_width(config),
        recurrent=ShortConvShape(config.hidden_size, config.conv_L_cache, bool(config.conv_bias)),
        recurrent_layers=tuple(t == "conv" for t in types),
    )
    if arch == "Lfm3ForCausalLM":
        bias = bool(getattr(config, "attention_bias", False))
        return dataclasses.replace(
            s,
            qkv_bias=bias,
            o_bias=bias,
            sandwich_norms=bool(config.use_sandwich_norm),
            attn_output_gate=bool(config.use_attention_gate),
            attn_gate_per_head=True,
            # a rope per attention type (the conv layers' entry is never used)
            layer_rope=tuple("full_attention" if t == "conv" else t for t in types),
        )
    if arch != "Lfm2MoeForCausalLM":
        return s
    moe = MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        biased=BiasedRouting(
            scale=float(config.routed_scaling_factor), correction=bool(config.use_expert_bias), norm_eps=1e-6
        ),
    )
    dense = config.num_dense_layers
    return dataclasses.replace(s, moe=moe, moe_layers=tuple(i >= dense for i in range(s.num_layers)))


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take, norm="model.embedding_norm")
    s = model.shape
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if s.is_recurrent(i):
            load_short_conv(layer.attn, take, p + "conv.")
        else:
            a = p + "self_attn."
            attn = layer.attn
            attn.qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")))
            if attn.qkv.bias is not None:
                attn.qkv.bias.copy_(take.cat(*(a + f"{n}_proj.bias" for n in "qkv")))
            load_linear(attn.o, take, take_first_prefix(take, a, "out_proj", "o_proj"))
            attn.q_norm.copy_(take.first(a + "q_layernorm.weight", a + "q_norm.weight"))
            attn.k_norm.copy_(take.first(a + "k_layernorm.weight", a + "k_norm.weight"))
            if attn.gate is not None:  # LFM3's gate, a value per head
                attn.gate.weight.copy_(take.first(a + "gate_proj.weight", a + "g_proj.weight"))
        f = p + "feed_forward."
        if s.moe is not None and s.moe_layers[i]:
            load_moe_block(layer.mlp, take, f, ("w1", "w3", "w2"))
        else:
            layer.mlp.gate_up.weight.copy_(take.cat(f + "w1.weight", f + "w3.weight"))
            layer.mlp.down.weight.copy_(take(f + "w2.weight"))
        layer.input_norm.copy_(take(p + "operator_norm.weight"))
        if s.sandwich_norms:  # LFM3: after the mixer and the MLP too
            layer.post_norm.copy_(take(p + "post_operator_norm.weight"))
            layer.pre_mlp_norm.copy_(take(p + "ffn_norm.weight"))
            layer.post_mlp_norm.copy_(take(p + "post_ffn_norm.weight"))
        else:
            layer.post_norm.copy_(take(p + "ffn_norm.weight"))


def take_first_prefix(take: Checkpoint, a: str, *names: str) -> str:
    """`a + name` for the first of `names` whose weight the checkpoint has (LFM2's `out_proj`, LFM3's `o_proj`)."""
    return next((a + n for n in names if take.has(a + n + ".weight")), a + names[0])


def load_short_conv(conv: ShortConv, take: Checkpoint, c: str) -> None:
    s = conv.s
    conv.in_proj.weight.copy_(take(c + "in_proj.weight"))
    conv.out.weight.copy_(take(c + "out_proj.weight"))
    conv.conv_weight.copy_(take(c + "conv.weight").reshape(s.channels, s.kernel))
    if s.bias:
        conv.in_proj.bias.copy_(take(c + "in_proj.bias"))
        conv.out.bias.copy_(take(c + "out_proj.bias"))
        conv.conv_bias.copy_(take(c + "conv.bias"))
