"""HunYuan dense (Hunyuan-0.5B to 7B) and MoE (Hunyuan-A13B): Llama's layer with an RMSNorm over
each q and k head after rotary (`query_layernorm`, `key_layernorm`), `attention_bias` on all four
projections, and its rope base stretched by a fixed NTK alpha where the rope parameters say
`dynamic` with an `alpha` (`rope.py`). The MoE's layers route every token to `moe_topk` of
`num_experts` (softmax in float32, renormalised), experts of `intermediate_size`, beside a shared
MLP of that size added without a gate."""

from __future__ import annotations

from service.models import llama, qwen2_moe
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    architecture,
    base_shape,
    load_common,
    load_split_attention,
)
from service.models.moe import MoEShape, load_moe_block

ARCHITECTURES = ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")


def _uniform(config, name: str) -> int:
    """A MoE field the config may give per layer: served where every layer has the same."""
    value = getattr(config, name)
    if isinstance(value, int):
        return value
    if len(set(value)) != 1:
        raise UnsupportedModel(f"{architecture(config)}: {name} differs between layers ({value}); not served")
    return int(value[0])


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    moe = None
    if architecture(config) == "HunYuanMoEV1ForCausalLM":
        moe = MoEShape(
            hidden_size=config.hidden_size,
            num_experts=_uniform(config, "num_experts"),
            top_k=_uniform(config, "moe_topk"),
            intermediate_size=config.intermediate_size,
            renormalize=True,
            shared_intermediate_size=config.intermediate_size,
            shared_gated=False,
        )
    return base_shape(
        config,
        qk_norm=True,
        qk_norm_after_rope=True,
        qkv_bias=bias,
        o_bias=bias,
        moe=moe,
        moe_layers=(moe is not None,) * config.num_hidden_layers,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    if model.shape.moe is None:
        llama.load(model, take)
    else:
        load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if model.shape.moe is not None:
            load_split_attention(layer, take, p)
            load_moe_block(
                layer.mlp,
                take,
                p + "mlp.",
                qwen2_moe.EXPERT_NAMES,
                shared="shared_mlp.",
                router="gate.wg.weight",
            )
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
        layer.attn.q_norm.copy_(take(p + "self_attn.query_layernorm.weight"))
        layer.attn.k_norm.copy_(take(p + "self_attn.key_layernorm.weight"))
