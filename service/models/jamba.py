"""Jamba (AI21): Mamba layers (mamba1.py, with weighted RMSNorms on dt, B and C) and attention
without positions at every `attn_layer_period`-th layer from `attn_layer_offset`; routed experts at
every `expert_layer_period`-th from `expert_layer_offset` (softmax top-k, not renormalised), a
SwiGLU MLP elsewhere. Norms `input_layernorm`, `pre_ff_layernorm`, `final_layernorm`.

Checkpoint: the Mamba layers under `mamba.`, attention under `self_attn.`, the MLP or experts under
`feed_forward.` (`router`, `experts.{e}.gate_proj/up_proj/down_proj`, or the fused 3-D layout)."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_split_attention,
)
from service.models.mamba1 import load_mamba1, mamba1_shape
from service.models.moe import MoEShape, load_moe_block
from service.models.rope import NO_ROPE

ARCHITECTURES = ("JambaForCausalLM",)
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def shape(config) -> ModelShape:
    n = config.num_hidden_layers
    mamba = mamba1_shape(
        config,
        inner=int(config.mamba_expand * config.hidden_size),
        d_state=config.mamba_d_state,
        dt_rank=int(config.mamba_dt_rank),
        conv_kernel=config.mamba_d_conv,
        conv_bias=bool(config.mamba_conv_bias),
        proj_bias=bool(config.mamba_proj_bias),
        bcdt_norm_eps=config.rms_norm_eps,
        bcdt_norm_weights=True,
    )
    moe = MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=False,
    )
    return base_shape(
        config,
        layer_rope=(NO_ROPE,) * n,
        recurrent=mamba,
        recurrent_layers=tuple(t == "mamba" for t in config.layers_block_type),
        moe=moe if config.num_experts > 1 else None,
        moe_layers=tuple(e > 1 for e in config.layers_num_experts),
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take, norm="model.final_layernorm")
    s = model.shape
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if s.is_recurrent(i):
            load_mamba1(layer.attn, take, p + "mamba.")
        else:
            load_split_attention(layer, take, p)
        f = p + "feed_forward."
        if s.moe is not None and s.moe_layers[i]:
            load_moe_block(layer.mlp, take, f, EXPERT_NAMES, router="router.weight")
        else:
            layer.mlp.gate_up.weight.copy_(take.cat(f + "gate_proj.weight", f + "up_proj.weight"))
            layer.mlp.down.weight.copy_(take(f + "down_proj.weight"))
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "pre_ff_layernorm.weight"))
