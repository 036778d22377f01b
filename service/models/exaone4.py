"""EXAONE 4.0: OLMo-2's norm placement (no norm before a block, each block's output normed before
its residual add) with Qwen3's per-head q/k norms, sliding-window layers as `layer_types` names
them, and, where the config has a window, rotary on the sliding layers only (the global layers
have none).

K-EXAONE (ExaoneMoe): the same attention in Llama's pre-norm layer, with DeepSeek-V3's experts
(`moe.py` `BiasedRouting`: sigmoid scores plus `e_score_correction_bias` in `n_group` groups,
`routed_scaling_factor`) beside ungated shared experts (`num_shared_experts` x
`moe_intermediate_size`), dense where `mlp_layer_types` says so."""

from __future__ import annotations

import dataclasses

from service.models import olmo2, qwen2_moe, qwen3
from service.models.layers import CausalLM, Checkpoint, ModelShape, architecture, base_shape
from service.models.moe import shared_experts_shape, v3_routing
from service.models.rope import DEFAULT_LAYER, NO_ROPE

ARCHITECTURES = ("Exaone4ForCausalLM", "ExaoneMoeForCausalLM")


def _layout(config) -> dict:
    """EXAONE 4.0's norms after the blocks, or K-EXAONE's experts (pre-norm layers)."""
    if architecture(config) != "ExaoneMoeForCausalLM":
        return dict(post_norms=True)
    moe = shared_experts_shape(
        config, config.num_experts, config.num_shared_experts, v3_routing(config), bool(config.norm_topk_prob)
    )
    return dict(moe=moe, moe_layers=tuple(t == "sparse" for t in config.mlp_layer_types))


def shape(config) -> ModelShape:
    s = base_shape(config, qk_norm=True, **_layout(config))
    if getattr(config, "sliding_window", None):
        rope = tuple(DEFAULT_LAYER if la.window is not None else NO_ROPE for la in s.layer_attention)
        s = dataclasses.replace(s, layer_rope=rope)
    return s


def load(model: CausalLM, take: Checkpoint) -> None:
    if model.shape.moe is None:
        olmo2.load(model, take)  # the same tensor names
        return
    qwen2_moe.load(model, take, shared="shared_experts.")
    qwen3.load_qk_norms(model, take)
