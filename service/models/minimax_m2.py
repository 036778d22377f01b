"""MiniMax-M2: Mixtral's layer with OLMo-2's q/k norms over the whole projections, partial rotary
(the checkpoints' `rotary_dim`), and experts in every layer chosen on sigmoid scores plus
`e_score_correction_bias` (`moe.py` `BiasedRouting`, no groups), the chosen scores renormalised.

Checkpoint: Mixtral's names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`) with
the correction bias under the block (`block_sparse_moe.e_score_correction_bias`), or
transformers' (`mlp.`)."""

from __future__ import annotations

import dataclasses

from service.models import mixtral, qwen3
from service.models.layers import CausalLM, Checkpoint, ModelShape, base_shape
from service.models.moe import BiasedRouting

ARCHITECTURES = ("MiniMaxM2ForCausalLM",)


def shape(config) -> ModelShape:
    moe = dataclasses.replace(mixtral.moe_shape(config), biased=BiasedRouting())
    return base_shape(
        config,
        qk_norm=True,
        qk_norm_whole=True,
        moe=moe,
        moe_layers=(True,) * config.num_hidden_layers,
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    mixtral.load(model, take)
    qwen3.load_qk_norms(model, take)  # the whole-projection weights, under the same names
