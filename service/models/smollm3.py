"""SmolLM3: Llama's layer with no rotary in the layers `no_rope_layers` marks 0 (every
`no_rope_layer_interval`-th as published: NoPE, attention over the unrotated q and k), biases as
Llama's `attention_bias` and `mlp_bias`, and a sliding window only where `use_sliding_window` is
set and `layer_types` names the layer sliding."""

from __future__ import annotations

import dataclasses

from service.models import llama
from service.models.layers import LayerAttention, ModelShape
from service.models.rope import DEFAULT_LAYER, NO_ROPE

ARCHITECTURES = ("SmolLM3ForCausalLM",)
load = llama.load


def shape(config) -> ModelShape:
    s = llama.shape(config)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    types = getattr(config, "layer_types", None) or ("full_attention",) * s.num_layers
    uses_rope = getattr(config, "no_rope_layers", None) or (1,) * s.num_layers
    return dataclasses.replace(
        s,
        layer_attention=tuple(
            LayerAttention(int(window) if window and t == "sliding_attention" else None) for t in types
        ),
        layer_rope=tuple(DEFAULT_LAYER if use else NO_ROPE for use in uses_rope),
    )
