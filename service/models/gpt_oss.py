"""gpt-oss (gpt-oss-20b, -120b, as their bf16 checkpoints; the published MXFP4 ones are refused as
quantized): Llama's pre-norm layer with biases on q/k/v/o, a learned sink per head in each
softmax's denominator (`eager_attention.py`: no kernel takes it), sliding and full layers as
`layer_types` says, YaRN; experts in every layer, chosen as the top `num_experts_per_tok` of the
router's logits (its linear has a bias), weighted by the softmax over those, each expert's
gate_up and down with biases and gpt-oss's clamped SwiGLU (`ops.clamped_swiglu`), run by the
grouped torch form.

Checkpoint: `mlp.router.*`, and the experts fused as transformers keeps them, `gate_up_proj`
[E, H, 2I] with gate and up interleaved (columns 2i and 2i + 1), turned and de-interleaved at load,
`down_proj` [E, I, H], their biases; `self_attn.sinks`."""

from __future__ import annotations

import torch

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_common,
    load_split_attention,
)
from service.models.moe import MoEShape

ARCHITECTURES = ("GptOssForCausalLM",)


def shape(config) -> ModelShape:
    moe = MoEShape(
        hidden_size=config.hidden_size,
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=True,  # a softmax over the top-k logits
        router_bias=True,
        expert_bias=True,
        clamped_swiglu=(float(config.swiglu_alpha), float(config.swiglu_limit)),
    )
    bias = bool(getattr(config, "attention_bias", True))
    return base_shape(
        config,
        qkv_bias=bias,
        o_bias=bias,
        attn_sinks=True,
        moe=moe,
        moe_layers=(True,) * config.num_hidden_layers,
    )


def _gate_then_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up interleaved (rows 2i, 2i + 1) -> all gate rows, then all up."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def load(model: CausalLM, take: Checkpoint) -> None:
    load_common(model, take)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_attention(layer, take, p)
        layer.attn.sinks.copy_(take(p + "self_attn.sinks"))
        moe, m = layer.mlp, p + "mlp."
        moe.router.weight.copy_(take(m + "router.weight"))
        moe.router.bias.copy_(take(m + "router.bias"))
        moe.w_gate_up.copy_(_gate_then_up(take(m + "experts.gate_up_proj").transpose(1, 2)))
        moe.b_gate_up.copy_(_gate_then_up(take(m + "experts.gate_up_proj_bias")))
        moe.w_down.copy_(take(m + "experts.down_proj").transpose(1, 2))
        moe.b_down.copy_(take(m + "experts.down_proj_bias"))
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
