"""Apertus (Swiss AI, 8B and 70B): Llama's layer with an RMSNorm over each q and k head before
rotary, norms named `attention_layernorm` and `feedforward_layernorm`, and an MLP without a gate
(`up_proj`, `down_proj`) through xIELU, an activation with two learned scalars per layer
(`layers.py` `XIELU`; `mlp.act_fn.alpha_p`, `alpha_n`, `beta`, `eps`)."""

from __future__ import annotations

from service.models import qwen3
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_split_projections,
)

ARCHITECTURES = ("ApertusForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(config, qk_norm=True, qkv_bias=bias, o_bias=bias, mlp_gated=False)


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_projections(layer, take, p)
        layer.input_norm.copy_(take(p + "attention_layernorm.weight"))
        layer.post_norm.copy_(take(p + "feedforward_layernorm.weight"))
        act = layer.mlp.act
        if model.shape.activation == "xielu":
            for name in ("alpha_p", "alpha_n", "beta", "eps"):
                getattr(act, name).copy_(take(f"{p}mlp.act_fn.{name}").reshape(getattr(act, name).shape))
    qwen3.load_qk_norms(model, take)
