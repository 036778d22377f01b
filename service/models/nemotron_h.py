"""Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2): one pre-norm block per layer (`layers.py`
`BlockLayer`), as `layers_block_type` (or the older `hybrid_override_pattern`) says: Mamba-2
(`linear_attention`, mamba2.py), attention without rotary (`full_attention`), or an MLP without a
gate (`mlp`: `up_proj`, `mlp_hidden_act` (ReLU squared), `down_proj`). Norms `norm` per block and
`norm_f` at the end. Its mixture-of-experts blocks (`moe`, Nemotron 3) have ungated ReLU-squared
experts, which are not served.

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
from service.models.rope import NO_ROPE

ARCHITECTURES = ("NemotronHForCausalLM",)
BLOCKS = {"linear_attention": "recurrent", "full_attention": "attention", "mlp": "mlp"}


def shape(config) -> ModelShape:
    types = list(config.layers_block_type)
    other = sorted(set(types) - set(BLOCKS))
    if other:
        raise UnsupportedModel(
            f"NemotronHForCausalLM: blocks {', '.join(other)} are not served (its experts are ungated ReLU squared)"
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
        recurrent_layers=tuple(t == "linear_attention" for t in types),
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
        else:
            load_linear(layer.mlp.fc, take, p + "mixer.up_proj")
            load_linear(layer.mlp.proj, take, p + "mixer.down_proj")
        layer.input_norm.copy_(take(p + "norm.weight"))
