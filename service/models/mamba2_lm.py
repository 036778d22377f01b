"""Mamba language models: `Mamba2ForCausalLM` (Codestral Mamba, the state-spaces Mamba-2
checkpoints), `MambaForCausalLM` (state-spaces Mamba) and `FalconMambaForCausalLM` (its B, C and dt
RMS-normed): every layer one pre-norm block (mamba2.py, mamba1.py; `layers.py` `BlockLayer`), no
attention; norms `norm` per block and `norm_f` at the end. The engine's KV pool keeps no K/V rows for it, only its
token bookkeeping; each request's state is its slots' (recurrent.py).

Checkpoint: `backbone.embeddings`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f`, `lm_head`."""

from __future__ import annotations

from service.models.layers import CausalLM, Checkpoint, ModelShape, architecture, base_shape, load_common
from service.models.mamba1 import Mamba1, load_mamba1, mamba1_shape
from service.models.mamba2 import Mamba2Shape, load_mamba2

ARCHITECTURES = ("Mamba2ForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM")


def shape(config) -> ModelShape:
    arch = architecture(config)
    if arch != "Mamba2ForCausalLM":
        eps = float(config.mixer_rms_eps) if arch == "FalconMambaForCausalLM" else None
        return _blocks(config, mamba1_shape(config, bcdt_norm_eps=eps))
    inner = int(config.expand * config.hidden_size)
    limit = getattr(config, "time_step_limit", None)
    mixer = Mamba2Shape(
        hidden_size=config.hidden_size,
        inner=inner,
        heads=config.num_heads,
        head_dim=config.head_dim,
        groups=config.n_groups,
        d_state=config.state_size,
        conv_kernel=config.conv_kernel,
        conv_bias=bool(config.use_conv_bias),
        proj_bias=bool(config.use_bias),
        norm_eps=config.layer_norm_epsilon,
        dt_limit=(float(limit[0]), float(limit[1])) if limit else (0.0, float("inf")),
    )
    return _blocks(config, mixer)


def _blocks(config, mixer) -> ModelShape:
    """Every layer one recurrent block of `mixer`, no attention."""
    n = config.num_hidden_layers
    return base_shape(
        config,
        num_q_heads=1,  # no attention: the KV pool's shape is never used for rows
        num_kv_heads=1,
        head_dim=1,
        intermediate_size=0,
        norm_eps=config.layer_norm_epsilon,
        layer_blocks=("recurrent",) * n,
        recurrent=mixer,
    )


def load(model: CausalLM, tensors: Checkpoint) -> None:
    take = tensors.renamed("backbone.", "model.")
    load_common(model, take, embed="model.embeddings", norm="model.norm_f")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if isinstance(layer.attn, Mamba1):
            load_mamba1(layer.attn, take, p + "mixer.")
        else:
            load_mamba2(layer.attn, take, p + "mixer.")
        layer.input_norm.copy_(take(p + "norm.weight"))
