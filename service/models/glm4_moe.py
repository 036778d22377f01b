"""GLM-4.5 / 4.6 / 4.7 (Glm4Moe, Air included), dots.llm1 (Dots1) and Solar Open: DeepSeek-V3's mixture of
experts under a plain attention. The experts (`moe.py` `BiasedRouting`): sigmoid scores, the choice
on the scores plus `e_score_correction_bias` within the best `topk_group` of `n_group` groups, top
`num_experts_per_tok` of `n_routed_experts`, weights renormalised where `norm_topk_prob`, times
`routed_scaling_factor`; `n_shared_experts` x `moe_intermediate_size` of shared expert added
without a gate; the first `first_k_dense_replace` layers dense (a GatedMLP of `intermediate_size`).

The attention: GLM-4.5's is Llama's with rotary on the first `partial_rotary_factor` (half as
published), q/k/v biases where `attention_bias` (never o), per-head q/k norms where
`use_qk_norm`; dots.llm1's is Qwen3's (per-head q/k norms, its sliding layers as `layer_types`
says); Solar Open's is Llama's (full rotary, q/k/v biases where `attention_bias`), with experts in
every layer. The next-token-prediction layers GLM-4.5 publishes past `num_hidden_layers` are not read."""

from __future__ import annotations

from service.models import qwen2_moe, qwen3
from service.models.layers import CausalLM, Checkpoint, ModelShape, architecture, base_shape
from service.models.moe import shared_experts_shape, v3_routing

ARCHITECTURES = ("Glm4MoeForCausalLM", "Dots1ForCausalLM", "SolarOpenForCausalLM")


def shape(config) -> ModelShape:
    moe = shared_experts_shape(
        config,
        config.n_routed_experts,
        config.n_shared_experts,
        v3_routing(config),
        bool(config.norm_topk_prob),
    )
    dense = getattr(config, "first_k_dense_replace", None) or 0  # Solar Open: none, every layer sparse
    moe_layers = tuple(i >= dense for i in range(config.num_hidden_layers))
    bias = bool(getattr(config, "attention_bias", False))
    if architecture(config) == "Dots1ForCausalLM":
        return base_shape(config, qk_norm=True, qkv_bias=bias, o_bias=bias, moe=moe, moe_layers=moe_layers)
    qk_norm = bool(getattr(config, "use_qk_norm", False))
    return base_shape(config, qk_norm=qk_norm, qkv_bias=bias, moe=moe, moe_layers=moe_layers)


def load(model: CausalLM, take: Checkpoint) -> None:
    qwen2_moe.load(model, take, shared="shared_experts.")
    if model.shape.qk_norm:
        qwen3.load_qk_norms(model, take)
