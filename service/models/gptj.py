"""GPT-J (and GPT4All-J, the Pygmalion and Dolly v1 kin): Phi-2's block (`layers.py`
`LayerNormDecoderLayer`: attention and MLP side by side on one LayerNorm of the layer's input)
with interleaved rotary on the first `rotary_dim` dims of each head (reordered at load to the
rotate-half layout, `rotate_pairs_as_halves`), no biases on q, k, v and the output projection,
a GELU MLP without a gate (`fc_in`, `fc_out`, with biases), and a biased LM head.

CodeGen (Salesforce's codegen-350M/2B/6B/16B, mono, multi, nl) is the same model with q, v and k
fused in `qkv_proj` across the four model-parallel shards it was trained with: each shard's rows
hold its heads' q, then v, then k; they are reordered at load to all q, then k, then v."""

from __future__ import annotations

import torch

from service.models.layers import (
    CausalLM,
    Checkpoint,
    ModelShape,
    layer_norm_shape,
    load_layer_norm,
    load_linear,
    rotate_pairs_as_halves,
)

ARCHITECTURES = ("GPTJForCausalLM", "CodeGenForCausalLM")
CODEGEN_SHARDS = 4


def shape(config) -> ModelShape:
    return layer_norm_shape(
        config,
        config.layer_norm_epsilon,
        bias=True,
        qkv_bias=False,
        o_bias=False,
        intermediate_size=config.n_inner or 4 * config.hidden_size,
        parallel_blocks=True,
        shared_block_norm=True,
        lm_head_bias=True,
        tie_word_embeddings=False,  # a tied head still has its own bias: the embeddings are copied
    )


def load(model: CausalLM, take: Checkpoint) -> None:
    model.embed.weight.copy_(take("transformer.wte.weight"))
    load_layer_norm(model.norm, take, "transformer.ln_f")
    head = "lm_head.weight" if take.has("lm_head.weight") else "transformer.wte.weight"
    model.lm_head.weight.copy_(take(head))
    model.lm_head.bias.copy_(take("lm_head.bias"))
    for i, layer in enumerate(model.layers):
        p = f"transformer.h.{i}."
        load_layer_norm(layer.input_norm, take, p + "ln_1")
        if take.has(p + "attn.qkv_proj.weight"):  # CodeGen
            layer.attn.qkv.weight.copy_(codegen_qkv(take(p + "attn.qkv_proj.weight")))
        else:
            layer.attn.qkv.weight.copy_(take.cat(*(p + f"attn.{n}_proj.weight" for n in "qkv")))
        load_linear(layer.attn.o, take, p + "attn.out_proj")
        load_linear(layer.mlp.fc, take, p + "mlp.fc_in")
        load_linear(layer.mlp.proj, take, p + "mlp.fc_out")
    rotate_pairs_as_halves(model)


def codegen_qkv(w: torch.Tensor) -> torch.Tensor:
    """CodeGen's fused rows, [q v k] per model-parallel shard -> [all q | all k | all v]."""
    q, v, k = w.view(CODEGEN_SHARDS, 3, -1, w.shape[-1]).unbind(1)
    return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])
