"""GPT-2: the GPT lineage's block (`layers.py` `LayerNormDecoderLayer`) one after the other, learned
absolute positions (`wpe`) instead of rotary, biases everywhere, a GELU (tanh) MLP without a gate
of `n_inner` (4 x hidden by default), tied embeddings. Its projections are published as `Conv1D`
([in, out]) and transposed at load; the hub's files name them as `GPT2Model` does (`wte`, `h.0...`),
`save_pretrained` under `transformer.`: both load. `scale_attn_by_inverse_layer_idx` is not served."""

from __future__ import annotations

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    UnsupportedModel,
    layer_norm_shape,
    load_layer_norm,
)
from service.models.rope import NO_ROPE

ARCHITECTURES = ("GPT2LMHeadModel",)


def shape(config) -> ModelShape:
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise UnsupportedModel("GPT2LMHeadModel: scale_attn_by_inverse_layer_idx is not served")
    return layer_norm_shape(
        config,
        config.layer_norm_epsilon,
        bias=True,
        intermediate_size=config.n_inner or 4 * config.hidden_size,
        learned_positions=0,
        layer_rope=(NO_ROPE,) * config.num_hidden_layers,
        attn_scale=None if getattr(config, "scale_attn_weights", True) else 1.0,
    )


def load_frame(model: CausalLM, take: Checkpoint, t: str = "transformer.") -> None:
    """What GPT-2, GPTBigCode and GPT-Neo name alike: `{t}wte`, `{t}wpe`, `{t}ln_f`, the LM head, and
    each layer's `{t}h.{i}.ln_1` / `ln_2`; the attention and MLP are each family's."""
    model.embed.weight.copy_(take(t + "wte.weight"))
    model.pos_embed.weight.copy_(take(t + "wpe.weight"))
    load_layer_norm(model.norm, take, t + "ln_f")
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        load_layer_norm(layer.input_norm, take, f"{t}h.{i}.ln_1")
        load_layer_norm(layer.post_norm, take, f"{t}h.{i}.ln_2")


def load(model: CausalLM, take: Checkpoint) -> None:
    def conv1d(linear, name: str) -> None:  # Conv1D keeps its weight as [in, out]
        linear.weight.copy_(take(name + ".weight").t())
        linear.bias.copy_(take(name + ".bias"))

    t = "transformer." if take.has("transformer.wte.weight") else ""  # the hub's files: GPT2Model's names
    load_frame(model, take, t)
    for i, layer in enumerate(model.layers):
        p = f"{t}h.{i}."
        conv1d(layer.attn.qkv, p + "attn.c_attn")
        conv1d(layer.attn.o, p + "attn.c_proj")
        conv1d(layer.mlp.fc, p + "mlp.c_fc")
        conv1d(layer.mlp.proj, p + "mlp.c_proj")
