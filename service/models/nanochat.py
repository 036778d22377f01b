"""NanoChat (Karpathy's nanochat d20/d32 and their fine-tunes): Llama's layer with every RMSNorm
weightless (their weights are set to 1 at load), the final norm applied to the embeddings as well
before the first layer (`embed_norm`), q and k normed per head after rotary, an MLP without a gate
(`fc1`, `fc2`; ReLU squared as published), and the logits soft-capped (`final_logit_softcapping`).

Its rotary turns the other way (transformers' `rotate_half` with flipped signs: each pair by -angle).
That is the usual rotation of q and k with the second half of their rotary dims negated, then
negated back; the scores never see the negation (q and k alike). So the rows of that second half
are negated in the q and k projections at load and the usual kernels serve it exactly (the
weightless per-head norms after rotary do not mind a sign)."""

from __future__ import annotations

import torch

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    base_shape,
    load_linear,
    load_split_attention,
)
from service.models.rope import rotary_dim

ARCHITECTURES = ("NanoChatForCausalLM",)


def shape(config) -> ModelShape:
    bias = bool(getattr(config, "attention_bias", False))
    return base_shape(
        config,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        qk_norm_after_rope=True,
        mlp_gated=False,
        embed_norm=True,
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    model.embed.weight.copy_(take("model.embed_tokens.weight"))
    model.norm.fill_(1.0)  # built on the meta device: nothing there yet
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_split_attention(layer, take, p)
        load_linear(layer.mlp.fc, take, p + "mlp.fc1")
        load_linear(layer.mlp.proj, take, p + "mlp.fc2")
        for norm in (layer.input_norm, layer.post_norm, layer.attn.q_norm, layer.attn.k_norm):
            norm.fill_(1.0)
    negate_rotary_second_halves(model)


def negate_rotary_second_halves(model: CausalLM) -> None:
    """q's and k's rows (and biases) of each head's second rotary half negated: the usual rotation
    then turns them as NanoChat's reversed one does, up to a sign the scores cancel."""
    s = model.shape
    d = s.head_dim
    r = rotary_dim(model.config, d)
    sign = torch.ones(d)
    sign[r // 2 : r] = -1.0
    rows = sign.repeat(s.num_q_heads + s.num_kv_heads)
    for layer in model.layers:
        for p in (layer.attn.qkv.weight, layer.attn.qkv.bias):
            if p is not None:
                n = rows.numel()
                p[:n] *= rows.view(-1, *([1] * (p.dim() - 1))).to(p.dtype)
