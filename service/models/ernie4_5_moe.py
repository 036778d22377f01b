"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, -300B-A47B, their text parts of the VL models): ERNIE 4.5's
attention (`ernie4_5.py`: interleaved rotary, biases where `use_bias`) with routed experts in the
layers from `moe_layer_start_index` to `moe_layer_end_index` every `moe_layer_interval` (a dense
GatedMLP of `intermediate_size` elsewhere): softmax scores in float32, the choice on the scores plus
`moe_statics.e_score_correction_bias`, top `moe_k` of `moe_num_experts`, the chosen scores
renormalised over `moe_norm_min` (`moe.py` `BiasedRouting`), and `moe_num_shared_experts` x
`moe_intermediate_size` of shared expert added without a gate (biased where `use_bias`)."""

from __future__ import annotations

from service.models import qwen2_moe
from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    base_shape,
    rotate_pairs_as_halves,
)
from service.models.moe import BiasedRouting, MoEShape

ARCHITECTURES = ("Ernie4_5_MoeForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "use_bias", False))
    moe = MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.moe_num_experts,
        top_k=config.moe_k,
        intermediate_size=config.moe_intermediate_size,
        renormalize=True,
        shared_intermediate_size=config.moe_intermediate_size * (config.moe_num_shared_experts or 0),
        shared_gated=False,
        shared_bias=bias,
        biased=BiasedRouting(scoring="softmax", norm_floor=float(config.moe_norm_min)),
    )
    start, end, every = config.moe_layer_start_index, config.moe_layer_end_index, config.moe_layer_interval
    if isinstance(start, (list, tuple)) or isinstance(
        end, (list, tuple)
    ):  # the VL models' text and image experts
        raise UnsupportedModel("Ernie4_5_MoeForCausalLM: several expert groups per layer are not served")
    moe_layers = tuple((i + 1) % every == 0 and start <= i <= end for i in range(config.num_hidden_layers))
    return base_shape(config, qkv_bias=bias, o_bias=bias, mlp_bias=bias, moe=moe, moe_layers=moe_layers)


def load(model: CausalLM, take: Checkpoint) -> None:
    qwen2_moe.load(model, take, shared="shared_experts.")
    rotate_pairs_as_halves(model)
