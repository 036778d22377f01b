"""Rotary position tables, as transformers computes them for each family.

A table is (cos, sin) [max_positions, rotary_dim] in float32, indexed by position. `rotary_dim`
is below head_dim where the config asks for partial rotary (Phi-4-mini); the rest of each head
passes through unrotated. Families with per-layer rope bases (Gemma-3: local and global layers)
get one table per layer type; a layer without rotary (SmolLM3's NoPE layers) gets the identity.

LongRoPE (Phi-3 `longrope`, also spelt `su`): transformers switches between the short and the
long factors by the sequence's length, for all of its positions at once. A served token keeps the
rotation its K was cached with, so here the choice is per position: short factors below
`original_max_position_embeddings`, long ones from it on. That is what transformers' generate
computes for a prompt below that length (its cached keys keep the short rotation as the sequence
grows past it); a longer prompt is rotated with long factors there from its first token on.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

DEFAULT_LAYER = "default"  # the table key of families with one rope for every layer
NO_ROPE = "no_rope"  # the table key of a layer without rotary (SmolLM3's NoPE layers): the identity


def rope_params(config, layer_type: str | None = None) -> dict:
    """The rope parameters of a layer type (or of the model), with the old top-level spellings."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    rope_scaling = getattr(config, "rope_scaling", None)
    if isinstance(rope_scaling, dict) and "rope_type" not in params and "type" not in params:
        params.update(rope_scaling)
    return params


def rotary_dim(config, head_dim: int, layer_type: str | None = None) -> int:
    """The dims of each head that turn: GPT-J's `rotary_dim`, multi-head latent attention's
    `qk_rope_head_dim`, else `partial_rotary_factor` of them."""
    if getattr(config, "rotary_dim", None):
        return int(config.rotary_dim)
    if getattr(config, "qk_rope_head_dim", None):
        return int(config.qk_rope_head_dim)
    return int(head_dim * rope_params(config, layer_type).get("partial_rotary_factor", 1.0))


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _table(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float):
    freqs = torch.outer(positions.to(torch.float64), inv_freq.to(torch.float64)).float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _longrope(config, params: dict, dim: int, max_positions: int):
    import math

    original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = params.get("factor") or config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = _inv_freq(params["rope_theta"], dim)
    short, long = (
        base / torch.tensor(params[k], dtype=torch.float64) for k in ("short_factor", "long_factor")
    )
    pos = torch.arange(max_positions)
    cs, ss = _table(short, pos, attention)
    cl, sl = _table(long, pos, attention)
    far = (pos >= original).view(-1, 1)
    return torch.where(far, cl, cs), torch.where(far, sl, ss)


def rope_table(
    config, head_dim: int, max_positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, rotary_dim] for one layer type (None: the model's one rope)."""
    if layer_type == NO_ROPE:  # cos 1, sin 0: q and k pass unrotated, through the same kernels
        return torch.ones(max_positions, head_dim), torch.zeros(max_positions, head_dim)
    params = rope_params(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = rotary_dim(config, head_dim, layer_type)
    if rope_type == "default":
        return _table(_inv_freq(params["rope_theta"], dim), torch.arange(max_positions), 1.0)
    if rope_type in ("longrope", "su"):
        return _longrope(config, params, dim, max_positions)
    if rope_type == "dynamic" and params.get("alpha"):  # HunYuan's NTK alpha: a fixed, larger base
        base = params["rope_theta"] * params["alpha"] ** (dim / (dim - 2))
        return _table(_inv_freq(base, dim), torch.arange(max_positions), 1.0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return _table(inv_freq, torch.arange(max_positions), scaling)


def mrope_section(config: Any) -> list[int] | None:
    """The bands per position stream of an M-RoPE text config (Qwen2-VL; None: plain RoPE)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None) or {}
        if "mrope_section" in params:
            return [int(n) for n in params["mrope_section"]]
    return None


def mrope_cos_sin(
    cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, section: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos/sin [T, head_dim] for M-RoPE: frequency band i (of `section`, over half the head)
    turns by the position of stream i % 3 (time, height, width); the second half repeats the first."""
    col = torch.arange(sum(section), device=positions.device)  # no host copy: scalar comparisons only
    band = sum((col >= edge).long() for edge in itertools.accumulate(section[:-1]))
    stream = torch.cat([band % 3, band % 3])
    t, d = positions.shape[1], stream.shape[0]
    pick = stream.view(1, 1, d).expand(1, t, d)
    return (
        cos_table[positions].gather(0, pick).squeeze(0),
        sin_table[positions].gather(0, pick).squeeze(0),
    )
