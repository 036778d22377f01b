"""OLMo hybrid (AI2): Gated DeltaNet (gated_delta.py) in the layers `layer_types` names
`linear_attention`, OLMo-2's attention (RMSNorms over all of q and all of k; rotary only where the
config gives a `rope_theta`, none as released) in the `full_attention` ones. The attention layers
keep OLMo-2's norms after each block (`post_attention_layernorm`, `post_feedforward_layernorm`);
the linear ones are pre-norm (`input_layernorm`, `post_attention_layernorm` before the MLP).

Its Gated DeltaNet: separate `q_proj`, `k_proj`, `v_proj` (one conv over the three), `g_proj` (the
output gate), `a_proj`, `b_proj`; beta doubled where `linear_allow_neg_eigval`; the output's
RMSNorm (`o_norm`) with eps 1e-5. Prefix cache with state snapshots (recurrent.py)."""

from __future__ import annotations

import dataclasses

from service.models.gated_delta import GatedDeltaNet, gated_delta_shape
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_split_mlp,
    load_split_projections,
    served_layer_types,
)
from service.models.rope import NO_ROPE

ARCHITECTURES = ("OlmoHybridForCausalLM",)


def shape(config) -> ModelShape:
    types = served_layer_types(config, ("linear_attention", "full_attention"))
    linear = tuple(t == "linear_attention" for t in types)
    params = getattr(config, "rope_parameters", None) or {}
    delta = dataclasses.replace(
        gated_delta_shape(config),
        norm_eps=1e-5,
        beta_scale=2.0 if config.linear_allow_neg_eigval else 1.0,
    )
    s = base_shape(
        config,
        qk_norm=True,
        qk_norm_whole=True,
        recurrent=delta,
        recurrent_layers=linear,
        post_norm_layers=tuple(not x for x in linear),
    )
    if params.get("rope_theta") is None:
        s = dataclasses.replace(s, layer_rope=(NO_ROPE,) * s.num_layers)
    return s


def load(model: CausalLM, take: Checkpoint) -> None:
    """transformers' names in memory, or OLMo's as published (`attention_layer_norm` for
    `input_layernorm`, `feedforward_layer_norm` for `post_attention_layernorm`, a conv each for q, k, v)."""
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        pre_mlp = take.first(p + "post_attention_layernorm.weight", p + "feedforward_layer_norm.weight")
        if model.shape.is_recurrent(i):
            load_olmo_gated_delta(layer.attn, take, p + "linear_attn.")
            load_split_mlp(layer, take, p)
            layer.input_norm.copy_(
                take.first(p + "input_layernorm.weight", p + "attention_layer_norm.weight")
            )
            layer.post_norm.copy_(pre_mlp)
            continue
        load_split_projections(layer, take, p)
        layer.attn.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
        layer.attn.k_norm.copy_(take(p + "self_attn.k_norm.weight"))
        layer.post_norm.copy_(pre_mlp)  # after attention, in this layout
        layer.post_mlp_norm.copy_(take(p + "post_feedforward_layernorm.weight"))


def load_olmo_gated_delta(net: GatedDeltaNet, take: Checkpoint, a: str) -> None:
    s = net.s
    net.in_proj.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkvg")))
    net.in_ba.weight.copy_(take.cat(a + "b_proj.weight", a + "a_proj.weight"))
    conv = (
        take(a + "conv1d.weight")
        if take.has(a + "conv1d.weight")
        else take.cat(*(a + f"{n}_conv1d.weight" for n in "qkv"))
    )
    net.conv_weight.copy_(conv.reshape(s.conv_channels, s.conv_kernel))
    net.A_log.copy_(take(a + "A_log"))
    net.dt_bias.copy_(take(a + "dt_bias"))
    net.norm.copy_(take(a + "o_norm.weight"))
    net.out.weight.copy_(take(a + "o_proj.weight"))
