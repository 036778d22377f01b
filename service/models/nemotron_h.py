"""Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2): one pre-norm block per layer (`layers.py`
`BlockLayer`), as `layers_block_type` (or the older `hybrid_override_pattern`) says: Mamba-2
(`linear_attention`, mamba2.py), attention without rotary (`full_attention`), or an MLP without a
gate (`mlp`: `up_proj`, `mlp_hidden_act` (ReLU squared), `down_proj`), or routed experts (`moe`,
Nemotron 3: DeepSeek-V3's choice, experts and a shared expert without a gate, `moe.py`
`ungated_act`; experts in a latent space, `moe_latent_size`, are refused). Norms `norm` per block
and `norm_f` at the end.

Checkpoint: published under `backbone.` (`backbone.embeddings`, `backbone.layers.{i}.mixer.*`),
`save_pretrained`'s `model.` too."""

from __future__ import annotations

from service.models.layers import (
    ACTIVATION_OF_CONFIG,
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    base_shape,
    load_common,
    load_linear,
)
from service.models.mamba2 import Mamba2Shape, load_mamba2
from service.models.moe import MoEBlock, MoEShape, v3_routing
from service.models.rope import NO_ROPE

ARCHITECTURES = ("NemotronHForCausalLM",)
BLOCKS = {"linear_attention": "recurrent", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def shape(config) -> ModelShape:
    types = list(config.layers_block_type)
    other = sorted(set(types) - set(BLOCKS))
    if other:
        raise UnsupportedModel(f"NemotronHForCausalLM: blocks {', '.join(other)} are not served")
    if "moe" in types and getattr(config, "moe_latent_size", None):
        raise UnsupportedModel(
            "NemotronHForCausalLM: experts in a latent space (moe_latent_size) are not served"
        )
    act = config.mlp_hidden_act
    if act not in ACTIVATION_OF_CONFIG:
        raise UnsupportedModel(f"NemotronHForCausalLM: mlp_hidden_act {act!r} is not served")
    inner = config.mamba_num_heads * config.mamba_head_dim
    n = len(types)
    return base_shape(
        config,
        num_layers=n,
        norm_eps=config.layer_norm_epsilon,
        activation=ACTIVATION_OF_CONFIG[act],
        mlp_gated=False,
        mlp_bias=bool(config.mlp_bias),
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        layer_rope=(NO_ROPE,) * n,
        layer_blocks=tuple(BLOCKS[t] for t in types),
        recurrent=Mamba2Shape(
            hidden_size=config.hidden_size,
            inner=inner,
            heads=config.mamba_num_heads,
            head_dim=config.mamba_head_dim,
            groups=config.n_groups,
            d_state=config.ssm_state_size,
            conv_kernel=config.conv_kernel,
            conv_bias=bool(config.use_conv_bias),
            proj_bias=bool(config.use_bias),
            norm_eps=config.layer_norm_epsilon,
            dt_limit=(float(config.time_step_min), float("inf")),
        ),
        moe=experts_shape(config, act) if "moe" in types else None,
        moe_layers=tuple(t == "moe" for t in types),
    )


def experts_shape(config, act: str) -> MoEShape:
    """Nemotron 3's experts: DeepSeek-V3's choice (sigmoid scores plus `e_score_correction_bias`, in
    groups, times `routed_scaling_factor`), experts and a shared expert without a gate."""
    return MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        shared_intermediate_size=config.moe_shared_expert_intermediate_size,
        shared_gated=False,
        shared_bias=bool(config.mlp_bias),
        biased=v3_routing(config),
        ungated_act=ACTIVATION_OF_CONFIG[act],
    )


def load(model: CausalLM, tensors: Checkpoint) -> None:
    take = tensors.renamed("backbone.", "model.")
    load_common(model, take, embed="model.embeddings", norm="model.norm_f")
    for i, (layer, kind) in enumerate(zip(model.layers, model.shape.layer_blocks)):
        p = f"model.layers.{i}."
        if kind == "recurrent":
            load_mamba2(layer.attn, take, p + "mixer.")
        elif kind == "attention":
            a = p + "mixer."
            layer.attn.qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")))
            if layer.attn.qkv.bias is not None:
                layer.attn.qkv.bias.copy_(take.cat(*(a + f"{n}_proj.bias" for n in "qkv")))
            load_linear(layer.attn.o, take, a + "o_proj")
        elif kind == "moe":
            load_ungated_experts(layer.mlp, take, p + "mixer.")
        else:
            load_linear(layer.mlp.fc, take, p + "mixer.up_proj")
            load_linear(layer.mlp.proj, take, p + "mixer.down_proj")
        layer.input_norm.copy_(take(p + "norm.weight"))


def load_ungated_experts(block: MoEBlock, take: Checkpoint, m: str) -> None:
    """The router (`gate.weight`, `gate.e_score_correction_bias`), the experts' `up_proj` and
    `down_proj` (one module each as published, or fused [E, ...] in memory), the shared expert."""
    block.router_weight.copy_(take(m + "gate.weight"))
    block.score_bias.copy_(take(m + "gate.e_score_correction_bias"))
    if take.has(m + "experts.up_proj"):
        block.w_gate_up.copy_(take(m + "experts.up_proj"))
        block.w_down.copy_(take(m + "experts.down_proj"))
    else:
        for e in range(block.s.num_experts):
            block.w_gate_up[e].copy_(take(f"{m}experts.{e}.up_proj.weight"))
            block.w_down[e].copy_(take(f"{m}experts.{e}.down_proj.weight"))
    shared = block.shared
    load_linear(shared["gate_up"], take, m + "shared_experts.up_proj")
    load_linear(shared["down"], take, m + "shared_experts.down_proj")
