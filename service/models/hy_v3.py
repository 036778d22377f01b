"""HY V3 (Hy3-preview): Llama's pre-norm layer with an RMSNorm over each q and k head (Apertus's,
before rotary), routed experts chosen on sigmoid scores plus `e_score_correction_bias` (MiniMax-M2's
router, no groups), renormalised, times `router_scaling_factor`, beside `num_shared_experts` x
`moe_intermediate_size` of shared expert added without a gate; dense where `mlp_layer_types` says.
The next-token-prediction layer published past `num_hidden_layers` is not read."""

from __future__ import annotations

from service.models import qwen2_moe, qwen3
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_split_attention,
    load_split_mlp,
)
from service.models.moe import BiasedRouting, load_moe_block, shared_experts_shape

ARCHITECTURES = ("HYV3ForCausalLM",)


def shape(config) -> ModelShape:
    routing = BiasedRouting(scale=float(config.router_scaling_factor))
    moe = shared_experts_shape(
        config, config.num_experts, config.num_shared_experts, routing, renormalize=True
    )
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(
        config,
        qk_norm=True,
        qkv_bias=bias,
        o_bias=bias,
        moe=moe,
        moe_layers=tuple(t == "sparse" for t in config.mlp_layer_types),
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    """As published (`mlp.router.gate`, `mlp.expert_bias`, `mlp.shared_mlp`) or under transformers'
    names (`mlp.gate`, `mlp.e_score_correction_bias`, `mlp.shared_experts`)."""
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_attention(layer, take, p)
        if model.shape.moe_layers[i]:
            published = take.has(p + "mlp.router.gate.weight")
            load_moe_block(
                layer.mlp,
                take,
                p + "mlp.",
                qwen2_moe.EXPERT_NAMES,
                shared="shared_mlp." if published else "shared_experts.",
                router="router.gate.weight" if published else "gate.weight",
            )
        else:
            load_split_mlp(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
    qwen3.load_qk_norms(model, take)
