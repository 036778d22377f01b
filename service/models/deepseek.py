"""DeepSeek-V2 / V3 (V2-Lite, V2.5, V3, R1, Moonlight) and GLM-4.7-Flash (Glm4MoeLite):
multi-head latent attention (`mla.py`) with routed experts beside ungated shared experts
(`n_shared_experts` x `moe_intermediate_size`), the first `first_k_dense_replace` layers dense
(GLM-4.7-Flash: those `mlp_layer_types` calls "dense"), and Mistral 4 (Mistral Small 4's
language model). Youtu-LLM: V3's attention on Llama's dense layers.

The routers (`moe.py` `BiasedRouting`, the router in float32):
- V3 and GLM-4.7-Flash: sigmoid scores, the choice on the scores plus `e_score_correction_bias`
  within the best `topk_group` of `n_group` groups (a group ranked by its two best), renormalised
  where `norm_topk_prob`, times `routed_scaling_factor`;
- V2: softmax scores, the top-k (`topk_method` "greedy"), or within the best `topk_group` of
  `n_group` groups ranked by their best ("group_limited_greedy"); never renormalised, times
  `routed_scaling_factor`;
- Mistral 4: softmax scores, the choice within the best `topk_group` of `n_group` groups (ranked
  by their two best), renormalised where `norm_topk_prob`, times `routed_scaling_factor`; its q
  is scaled by position as Ministral 3's (`llama_4_scaling_beta`).

Rotary turns interleaved pairs (V2 always, V3 and GLM-4.7-Flash where `rope_interleave`); the
loader lays those rows out for the rotate-half kernels. The next-token-prediction layers V3
publishes past `num_hidden_layers` are not read."""

from __future__ import annotations

import dataclasses

from service.models import llama, qwen2_moe
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    architecture,
    base_shape,
    load_common,
    load_split_mlp,
)
from service.models.mla import MLAShape, attention_scale, load_latent_attention
from service.models.moe import BiasedRouting, load_moe_block, shared_experts_shape, v3_routing

ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Mistral4ForCausalLM",
    "YoutuForCausalLM",
)


def _routing(config) -> tuple[BiasedRouting, bool]:
    """(the router, renormalised or not) of a V2, V3 or Mistral 4 config."""
    v3 = v3_routing(config)
    if architecture(config) == "Mistral4ForCausalLM":  # softmax scores, no correction bias
        return dataclasses.replace(v3, scoring="softmax", correction=False), bool(config.norm_topk_prob)
    if architecture(config) != "DeepseekV2ForCausalLM":
        return v3, bool(config.norm_topk_prob)
    grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
    v2 = dataclasses.replace(v3, scoring="softmax", correction=False, group_rank="max")
    return (v2 if grouped else dataclasses.replace(v2, n_group=1, topk_group=1)), False


def _sparse_layers(config) -> tuple[bool, ...]:
    n = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None)
    if types is not None:
        return tuple(t == "sparse" for t in types[:n])
    dense = config.first_k_dense_replace or 0
    return tuple(i >= dense for i in range(n))


def mla_shape(config) -> MLAShape:
    return MLAShape(
        q_lora_rank=config.q_lora_rank or None,
        kv_lora_rank=config.kv_lora_rank,
        nope_dim=config.qk_nope_head_dim,
        rope_dim=config.qk_rope_head_dim,
        v_dim=config.v_head_dim,
        bias=bool(getattr(config, "attention_bias", False)),
    )


def dense_shape(config, **overrides) -> ModelShape:
    """A model with latent attention and Llama's dense MLP in every layer (Youtu, MiniCPM3)."""
    mla = mla_shape(config)
    return base_shape(
        config,
        num_kv_heads=config.num_attention_heads,
        head_dim=mla.head_dim,
        attn_scale=attention_scale(config, mla.qk_dim),
        mla=mla,
        **overrides,
    )


def shape(config) -> ModelShape:
    if architecture(config) == "YoutuForCausalLM":
        return dense_shape(config)
    mla = mla_shape(config)
    routing, renormalize = _routing(config)
    moe = shared_experts_shape(config, config.n_routed_experts, config.n_shared_experts, routing, renormalize)
    heads = config.num_attention_heads
    return base_shape(
        config,
        num_kv_heads=heads,
        head_dim=mla.head_dim,
        attn_scale=attention_scale(config, mla.qk_dim),
        q_position_scale=llama.q_position_scale(config),
        mla=mla,
        moe=moe,
        moe_layers=_sparse_layers(config),
    )


def load(model: CausalLM, take: Checkpoint, interleaved: bool | None = None) -> None:
    """interleaved: the checkpoint's rotary turns pairs (None: V2's always do, the others' where
    `rope_interleave`, true unless set)."""
    load_common(model, take)
    if interleaved is None:
        interleaved = architecture(model.config) == "DeepseekV2ForCausalLM" or bool(
            getattr(model.config, "rope_interleave", True)
        )
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_latent_attention(layer.attn, take, p, interleaved)
        if model.shape.moe is not None and model.shape.moe_layers[i]:
            load_moe_block(layer.mlp, take, p + "mlp.", qwen2_moe.EXPERT_NAMES, shared="shared_experts.")
        else:
            load_split_mlp(layer, take, p)
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
