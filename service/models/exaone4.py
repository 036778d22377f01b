"""EXAONE 4.0: OLMo-2's norm placement (no norm before a block, each block's output normed before
its residual add) with Qwen3's per-head q/k norms, sliding-window layers as `layer_types` names
them, and, where the config has a window, rotary on the sliding layers only (the global layers
have none)."""

from __future__ import annotations

import dataclasses

from service.models import olmo2
from service.models.layers import ModelShape, base_shape
from service.models.rope import DEFAULT_LAYER, NO_ROPE

ARCHITECTURES = ("Exaone4ForCausalLM",)
load = olmo2.load  # the same tensor names


def shape(config) -> ModelShape:
    s = base_shape(config, qk_norm=True, post_norms=True)
    if getattr(config, "sliding_window", None):
        rope = tuple(DEFAULT_LAYER if la.window is not None else NO_ROPE for la in s.layer_attention)
        s = dataclasses.replace(s, layer_rope=rope)
    return s
