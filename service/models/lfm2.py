"""LFM2 and LFM2-MoE (Liquid AI): short gated convolutions (short_conv.py, a recurrent layer with a
conv state per request slot) in the layers `layer_types` names `conv`, Qwen3's attention (per-head
q/k RMSNorms, `q_layernorm` / `k_layernorm`) in the `full_attention` ones. Pre-norm blocks
(`operator_norm`, `ffn_norm`), the final norm named `embedding_norm`, tied embeddings as published.

MLPs: SwiGLU of `w1` (gate), `w3` (up), `w2` (down); LFM2's width is `intermediate_size` adjusted as
transformers does (`block_auto_adjust_ff_dim`: two thirds, times `block_ffn_dim_multiplier`,
rounded up to `block_multiple_of`). LFM2-MoE: the first `num_dense_layers` dense, then routed
experts: sigmoid scores, the choice on the scores plus `expert_bias` (`use_expert_bias`), top
`num_experts_per_tok`, renormalised where `norm_topk_prob`, times `routed_scaling_factor`."""

from __future__ import annotations

import dataclasses

from service.models.layers import CausalLM, Checkpoint, ModelShape, UnsupportedModel, architecture, base_shape
from service.models.moe import BiasedRouting, MoEShape, load_moe_block
from service.models.short_conv import ShortConv, ShortConvShape

ARCHITECTURES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
MIXERS = ("conv", "full_attention")


def mlp_width(config) -> int:
    width = config.intermediate_size
    if architecture(config) == "Lfm2MoeForCausalLM" or not getattr(config, "block_auto_adjust_ff_dim", False):
        return width
    width = int(2 * width / 3)
    multiplier = getattr(config, "block_ffn_dim_multiplier", None)
    if multiplier is not None:
        step = config.block_multiple_of
        width = step * ((int(multiplier * width) + step - 1) // step)
    return width


def shape(config) -> ModelShape:
    arch = architecture(config)
    types = list(config.layer_types)
    other = sorted(set(types) - set(MIXERS))
    if other:
        raise UnsupportedModel(f"{arch}: layer types {', '.join(other)} are not served")
    s = base_shape(
        config,
        norm_eps=config.norm_eps,
        qk_norm=True,
        intermediate_size=mlp_width(config),
        recurrent=ShortConvShape(config.hidden_size, config.conv_L_cache, bool(config.conv_bias)),
        recurrent_layers=tuple(t == "conv" for t in types),
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
    model.embed.weight.copy_(take("model.embed_tokens.weight"))
    model.norm.copy_(take("model.embedding_norm.weight"))
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    s = model.shape
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if s.is_recurrent(i):
            load_short_conv(layer.attn, take, p + "conv.")
        else:
            a = p + "self_attn."
            layer.attn.qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")))
            layer.attn.o.weight.copy_(take(a + "out_proj.weight"))
            layer.attn.q_norm.copy_(take(a + "q_layernorm.weight"))
            layer.attn.k_norm.copy_(take(a + "k_layernorm.weight"))
        f = p + "feed_forward."
        if s.moe is not None and s.moe_layers[i]:
            load_moe_block(layer.mlp, take, f, ("w1", "w3", "w2"))
        else:
            layer.mlp.gate_up.weight.copy_(take.cat(f + "w1.weight", f + "w3.weight"))
            layer.mlp.down.weight.copy_(take(f + "w2.weight"))
        layer.input_norm.copy_(take(p + "operator_norm.weight"))
        layer.post_norm.copy_(take(p + "ffn_norm.weight"))


def load_short_conv(conv: ShortConv, take: Checkpoint, c: str) -> None:
    s = conv.s
    conv.in_proj.weight.copy_(take(c + "in_proj.weight"))
    conv.out.weight.copy_(take(c + "out_proj.weight"))
    conv.conv_weight.copy_(take(c + "conv.weight").reshape(s.channels, s.kernel))
    if s.bias:
        conv.in_proj.bias.copy_(take(c + "in_proj.bias"))
        conv.out.bias.copy_(take(c + "out_proj.bias"))
        conv.conv_bias.copy_(take(c + "conv.bias"))
