"""The dense families (Qwen3, MiniCPM3, Youtu-LLM, HyperCLOVA X, BLOOM, MPT, Persimmon, XGLM, Gemma, Gemma-2, Gemma-3 text, Phi-3 / Phi-4-mini, SmolLM3, Granite, OLMo-2/3,
GLM / GLM-4, Apertus, HunYuan, NanoChat, OLMo, ERNIE 4.5, Helium, Ministral (and 3), Seed-OSS, Granite 4.0 (attention only), the GPT lineage: GPT-2, GPTBigCode, GPT-Neo, GPT-J, CodeGen, Falcon,
GPT-NeoX, OPT, Phi-2, StarCoder2, StableLM, Nemotron; Arcee; Cohere / Cohere2, EXAONE 4; Qwen2's sliding layers, Llama's MLP biases and activations) against
transformers, two random-init configs each (different shapes, fp32): greedy tokens equal
generate(do_sample=False) for a batch of different prompt lengths; input and output logprobs within
1e-4 of transformers' log_softmax; the overlap loop with chunked prefill (size 7), then the same
prompts again from the prefix cache, and both loops under a KV pool small enough to retract, give
what the normal loop gives on whole prompts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from service.config import ServerArgs
from service.core.request import FinishReason, SamplingParams
from service.engine.engine import SyncClient, collect
from tests.conftest import TOKENIZER_FILES
from tests.features.test_features import assert_close
from tests.helpers import need_triton
from tests.scheduler.test_overlap import assert_pools_initial, forbid_placeholders

VOCAB = 2048
N_NEW = 20  # past every window and the retraction pool (72 rows: prompts 51 + 3 x 20)
PROMPT_LENS = (5, 19, 27)  # below Phi-3 LongRoPE's original length: transformers then rotates as we do
TOL = 1e-4
LOGPROBS = {"logprobs": {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}}
OUTPUT_LOGPROBS = {"logprobs": {"return_logprob": True, "top_logprobs_num": 2}}  # reuses cached prefixes
ROOT = Path(__file__).resolve().parents[2]
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}

COMMON = dict(
    vocab_size=VOCAB,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)


def _longrope(rot_dim: int) -> dict:
    half = rot_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.7 * i for i in range(half)],
        "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.5,
    }


CONFIGS = {  # name: (transformers config class, its arguments)
    "qwen3-gqa-tied": (
        "Qwen3Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    ),
    "apertus-xielu": (
        "ApertusConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16),
    ),
    "hunyuan-norms-after-rope": (
        "HunYuanDenseV1Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16),
    ),
    "hunyuan-ntk-alpha-biases-tied": (
        "HunYuanDenseV1Config",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, head_dim=16, attention_bias=True, tie_word_embeddings=True,
             rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}),
    ),
    "nanochat": (
        "NanoChatConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, final_logit_softcapping=5.0),
    ),
    "qwen3-window-wide-heads": (
        "Qwen3Config",
        dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, head_dim=32, tie_word_embeddings=False, use_sliding_window=True,
             sliding_window=8, max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    # The defect: Qwen2 windowed every layer, ignoring max_window_layers.
    "qwen2-window-above-max-layers": (
        "Qwen2Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "gemma2-capped": (
        "Gemma2Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
             attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    ),
    "gemma2-untied-mqa": (
        "Gemma2Config",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, sliding_window=6, query_pre_attn_scalar=32,
             attn_logit_softcapping=1.5, final_logit_softcapping=3.0, tie_word_embeddings=False),
    ),
    "vaultgemma-capped-windows": (
        "VaultGemmaConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    ),
    "gemma3-local-global": (
        "Gemma3TextConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
             }),
    ),
    "gemma3-untied": (
        "Gemma3TextConfig",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=24, sliding_window=5, query_pre_attn_scalar=24,
             layer_types=["full_attention", "sliding_attention"], tie_word_embeddings=False),
    ),
    "gemma-first-mqa": (
        "GemmaConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16),
    ),
    "gemma-first-biases-untied": (
        "GemmaConfig",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=2, head_dim=24, attention_bias=True, tie_word_embeddings=False),
    ),
    # The defect: `mlp_bias` and a `hidden_act` other than SiLU were ignored (tokens diverged).
    "llama-mlp-bias-gelu": (
        "LlamaConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, mlp_bias=True, attention_bias=True, hidden_act="gelu"),
    ),
    "smollm3-nope": (
        "SmolLM3Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, no_rope_layer_interval=2),
    ),
    "smollm3-window-biases": (
        "SmolLM3Config",
        dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, head_dim=32, use_sliding_window=True, sliding_window=8,
             attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    ),
    "granite": (
        "GraniteConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, embedding_multiplier=12.0, attention_multiplier=0.0078125,
             residual_multiplier=0.22, logits_scaling=8.0),
    ),
    "granite-relu-tied": (
        "GraniteConfig",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, embedding_multiplier=6.0, attention_multiplier=0.05,
             residual_multiplier=0.5, logits_scaling=2.5, hidden_act="relu", tie_word_embeddings=True),
    ),
    # BLOOM: ALiBi (6 heads: slopes past the power of two), a LayerNorm on the embeddings, head-by-head qkv
    "bloom": (
        "BloomConfig",
        dict(hidden_size=96, n_layer=2, n_head=6),
    ),
    # MPT: ALiBi from alibi_bias_max (6 heads), no biases, q/k/v clamped, its own softmax scale
    "mpt-clip": (
        "MptConfig",
        dict(d_model=96, n_heads=6, n_layers=2, max_seq_len=256,
             attn_config={"clip_qkv": 1.5, "softmax_scale": 0.3}),
    ),
    # Persimmon: head-by-head qkv, one q/k LayerNorm for every head, relu2, half rotary
    "persimmon": (
        "PersimmonConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
    ),
    # XGLM: OPT's layer with sinusoidal positions (offset 2), scaled embeddings, GELU
    "xglm": (
        "XGLMConfig",
        dict(d_model=64, ffn_dim=96, num_layers=2, attention_heads=4, max_position_embeddings=256),
    ),
    # HyperCLOVA X: Granite's multipliers with a norm on each block's output, logits multiplied
    "hyperclovax": (
        "HyperCLOVAXConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, embedding_multiplier=3.0, attention_multiplier=0.05,
             residual_multiplier=0.4, logits_scaling=0.5, use_post_norm=True),
    ),
    # MiniCPM3: latent attention (q's bottleneck, v narrower than q/k, rotary on halves) with
    # Granite-like multipliers (embeddings, residual branches, logits divided)
    "minicpm3": (
        "MiniCPM3Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=16, v_head_dim=16, scale_emb=12, scale_depth=1.4, dim_model_base=16,
             tie_word_embeddings=True),
    ),
    # Youtu-LLM: DeepSeek-V3's latent attention (interleaved rotary, q in one projection) on Llama's
    # dense layers, v wider than q/k
    "youtu": (
        "YoutuConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=32, tie_word_embeddings=False),
    ),
    "granite4-attention-only-dense": (
        "GraniteMoeHybridConfig",
        dict(hidden_size=64, intermediate_size=96, shared_intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=0, position_embedding_type="rope",
             layer_types=["attention", "attention"], embedding_multiplier=12.0, attention_multiplier=0.0078125,
             residual_multiplier=0.22, logits_scaling=8.0),
    ),
    "olmo2": (
        "Olmo2Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2),
    ),
    "olmo3-window-rope-per-type-biases": (
        "Olmo3Config",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=3,
             num_key_value_heads=1, sliding_window=8, attention_bias=True, tie_word_embeddings=True,
             rope_parameters={
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
             }),
    ),
    "olmo-clip": (
        "OlmoConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, clip_qkv=0.6),
    ),
    "ernie4_5-mqa": (
        "Ernie4_5Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16),
    ),
    "ernie4_5-biases-untied": (
        "Ernie4_5Config",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=2, head_dim=24, use_bias=True, tie_word_embeddings=False),
    ),
    "glm-partial-interleaved": (
        "GlmConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, attention_bias=True),
    ),
    "glm4-sandwich": (
        "Glm4Config",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, head_dim=32, attention_bias=True, tie_word_embeddings=True),
    ),
    "helium-biases": (
        "HeliumConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True),
    ),
    "ministral-layer-windows": (
        "MinistralConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    ),
    "ministral3-q-scaled-yarn": (
        "Ministral3Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                              "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.3}),
    ),
    "cwm-layer-windows-llama3": (
        "CwmConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8,
             rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0,
                              "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 64}),
    ),
    "jais2": (
        "Jais2Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2),
    ),
    "seed_oss-out-bias": (
        "SeedOssConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, attention_bias=True, attention_out_bias=True),
    ),
    "gpt_neox-parallel": (
        "GPTNeoXConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
    ),
    "gpt_neox-sequential-full-rotary-tied": (
        "GPTNeoXConfig",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             use_parallel_residual=False, rotary_pct=1.0, hidden_act="gelu_new"),
    ),
    "phi-partial": (
        "PhiConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             partial_rotary_factor=0.4),
    ),
    "phi-qk-layernorm": (
        "PhiConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             partial_rotary_factor=0.5, qk_layernorm=True),
    ),
    "phi-gqa-tied": (
        "PhiConfig",
        dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "starcoder2-window": (
        "Starcoder2Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, sliding_window=8),
    ),
    "starcoder2-no-bias-untied": (
        "Starcoder2Config",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, use_bias=False, tie_word_embeddings=False),
    ),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4)),
    "gpt2-inner-unscaled": (
        "GPT2Config",
        dict(n_embd=48, n_layer=3, n_head=2, n_inner=80, scale_attn_weights=False, activation_function="relu"),
    ),
    "gptj-partial-interleaved": (
        "GPTJConfig",
        dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
    ),
    "gptj-wide-rotary-relu": (
        "GPTJConfig",
        dict(n_embd=48, n_layer=3, n_head=2, rotary_dim=24, n_inner=80, activation_function="relu"),
    ),
    "codegen-sharded-qkv": (
        "CodeGenConfig",
        dict(n_embd=64, n_layer=2, n_head=8, rotary_dim=4),
    ),
    "gpt_bigcode-mqa": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=2, n_head=4)),
    "gpt_bigcode-mha-untied-unscaled": (
        "GPTBigCodeConfig",
        dict(n_embd=48, n_layer=3, n_head=3, n_inner=80, multi_query=False, scale_attn_weights=False,
             tie_word_embeddings=False),
    ),
    "gpt_neo-local-global": (
        "GPTNeoConfig",
        dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8),
    ),
    "gpt_neo-local-first-untied": (
        "GPTNeoConfig",
        dict(hidden_size=48, num_layers=3, num_heads=2, intermediate_size=80, window_size=6,
             attention_types=[[["local", "global", "local"], 1]], tie_word_embeddings=False),
    ),
    "falcon-7b-mqa-parallel": (
        "FalconConfig",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=96),
    ),
    "falcon-40b-grouped-two-norms-biases": (
        "FalconConfig",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=80,
             new_decoder_architecture=True, bias=True, tie_word_embeddings=False),
    ),
    "falcon2-11b-grouped-one-norm": (
        "FalconConfig",
        dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, num_kv_heads=1, ffn_hidden_size=64,
             new_decoder_architecture=True, num_ln_in_parallel_attn=1),
    ),
    "falcon-sequential-mha": (
        "FalconConfig",
        dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, ffn_hidden_size=64, multi_query=False,
             parallel_attn=False, bias=True),
    ),
    "opt": (
        "OPTConfig",
        dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64),
    ),
    "opt-no-bias-gelu": (
        "OPTConfig",
        dict(hidden_size=48, ffn_dim=64, num_hidden_layers=3, num_attention_heads=2, word_embed_proj_dim=48,
             enable_bias=False, activation_function="gelu"),
    ),
    "stablelm-sequential-qkv-bias": (
        "StableLmConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, use_qkv_bias=True, partial_rotary_factor=0.25),
    ),
    "stablelm-qk-layernorm-per-head": (
        "StableLmConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, qk_layernorm=True, partial_rotary_factor=0.25),
    ),
    "stablelm-parallel-tied": (
        "StableLmConfig",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=3, use_parallel_residual=True, partial_rotary_factor=0.5,
             tie_word_embeddings=True),
    ),
    "nemotron-partial": (
        "NemotronConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16),
    ),
    "arcee-relu2": (
        "ArceeConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2),
    ),
    "arcee-biases-yarn-tied": (
        "ArceeConfig",
        dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 64}),
    ),
    "cohere-logit-scale": (
        "CohereConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, logit_scale=0.5),
    ),
    "cohere-qk-norm": (
        "CohereConfig",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, logit_scale=0.5, use_qk_norm=True),
    ),
    "cohere2-windows-rotary-on-sliding-only": (
        "Cohere2Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, logit_scale=0.25, sliding_window=8),
    ),
    "exaone4-windows": (
        "Exaone4Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=2),
    ),
    "exaone4-global-untied": (
        "Exaone4Config",
        dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
             num_key_value_heads=1, head_dim=16, sliding_window=None, layer_types=["full_attention"] * 2,
             tie_word_embeddings=False),
    ),
    "phi3-window": (
        "Phi3Config",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, sliding_window=10, tie_word_embeddings=False),
    ),
    "phi4mini-partial-longrope": (
        "Phi3Config",
        dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=128,
             rope_parameters=_longrope(16)),
    ),
}  # fmt: skip


def make_family_model(smol: Path, out: Path, name: str) -> Path:
    """A random-init checkpoint of config `name`, norms and biases perturbed so they matter."""
    import transformers

    cls_name, kwargs = CONFIGS[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **kwargs})
    torch.manual_seed(0)
    save_perturbed(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), smol, out)
    return out


def save_perturbed(model, smol: Path, out: Path) -> None:
    """`model` saved to `out` with SmolLM2's tokenizer, its norms and biases perturbed so they matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms (Gemma's are 1 + w: zeros at init), biases, per-head norms [heads, d] (Command R+'s)
            if p.dim() == 1 or name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_reference(hf, prompt: list[int]):
    """transformers' greedy tokens, their log_softmax rows and the prompt's rows."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=N_NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out_rows = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
        in_rows = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return out.sequences[0, len(prompt) :].tolist(), out_rows, in_rows


def output_entries(extras: list) -> list:
    return [e for x in extras if x for e in x.output]


def serve(model_dir: Path, runs: list[dict], **args) -> tuple[list[list], object]:
    """Per run (its features): (token ids, logprob extras of every delta) per prompt, and the
    engine's stats (prefix-cache hits, retractions); the pools end as they began."""
    base = dict(dtype="float32", kv_cache_tokens=1024, max_running_requests=4)
    c = SyncClient(ServerArgs(**{**base, **args}), model_dir)
    forbid_placeholders(c)
    try:
        results = []
        for feats in runs:
            params = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
            outs = c.generate(prompts(), params, [feats] * len(PROMPT_LENS))
            for o in outs:
                assert o[-1].error is None, o[-1].error
            results.append([(collect(o)[0], [d.extras.get("logprobs") for d in o]) for o in outs])
        stats = c.engine.stats()
        assert_pools_initial(c)
    finally:
        c.close()
    return results, stats


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, smol_dir, tmp_path_factory):
    """(model dir, the normal loop's whole-prompt results) of one config."""
    model_dir = make_family_model(smol_dir, tmp_path_factory.mktemp(request.param), request.param)
    (whole,), _ = serve(
        model_dir, [LOGPROBS], loop="normal", chunked_prefill_size=0, disable_prefix_cache=True
    )
    return model_dir, whole


def test_greedy_tokens_and_logprobs_match_transformers(family):
    from transformers import AutoModelForCausalLM

    model_dir, whole = family
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, (ids, extras) in zip(prompts(), whole):
        ref_ids, out_rows, in_rows = hf_reference(hf, prompt)
        assert ids == ref_ids
        out_entries = output_entries(extras)
        assert [e[0] for e in out_entries] == ids
        for k, (tok, lp, top, _) in enumerate(out_entries):
            assert abs(lp - float(out_rows[k, tok])) < TOL
            assert all(abs(v - float(out_rows[k, t])) < TOL for t, v in top)
        inputs = extras[0].input
        assert [e[0] for e in inputs] == prompt[1:]
        for k, (tok, lp, _, _) in enumerate(inputs):
            assert abs(lp - float(in_rows[k, tok])) < TOL


def test_overlap_chunked_and_prefix_hits_equal_whole_prompts(family):
    """The overlap loop, prompts in chunks of 7 riding with decodes: the first run (cache misses,
    input logprobs too) and the second (the same prompts, output logprobs: prefix hits) give the
    normal loop's whole-prompt results."""
    model_dir, whole = family
    (miss, hit), stats = serve(
        model_dir,
        [LOGPROBS, OUTPUT_LOGPROBS],
        loop="overlap",
        chunked_prefill_size=7,
        enable_mixed_chunk=True,
    )
    assert stats.prefix_cache.hit_tokens > 0
    for i, (a, b) in enumerate(zip(miss, whole)):
        assert a[0] == b[0], f"miss: request {i}'s tokens differ"
        assert_close(a[1], b[1], f"miss: request {i}'s logprobs")
    for i, (a, b) in enumerate(zip(hit, whole)):
        assert a[0] == b[0], f"hit: request {i}'s tokens differ"
        assert_close(output_entries(a[1]), output_entries(b[1]), f"hit: request {i}'s logprobs")


def test_retraction_re_prefills_to_the_same_tokens_and_logprobs(family):
    """A KV pool (56 rows) that holds the three prompts but not their outputs: the running ones are
    retracted and re-prefilled (prompt and kept output, chunked and mixed by default), and every
    request still gives the whole-prompt run's tokens and logprobs. The overlap loop (the normal
    loop's retraction is the same for every model: tests/scheduler/test_retraction.py)."""
    model_dir, whole = family
    (got,), stats = serve(
        model_dir, [LOGPROBS], loop="overlap", kv_cache_tokens=56, disable_prefix_cache=True
    )
    assert stats.retractions > 0
    for i, (a, b) in enumerate(zip(got, whole)):
        assert a[0] == b[0], f"request {i}'s tokens differ"
        assert_close(a[1], b[1], f"request {i}'s logprobs")


CONSTRAINTS = [  # (payload, the finished text is in its language)
    (
        {"kind": "regex", "text": r"[a-z]{2,6}( [0-9]{1,3})?"},
        lambda t: re.fullmatch(r"[a-z]{2,6}( [0-9]{1,3})?", t),
    ),
    (
        {"kind": "json_schema", "text": json.dumps(SMALL_SCHEMA)},
        lambda t: jsonschema.validate(json.loads(t), SMALL_SCHEMA) is None,
    ),
]


# One config per transformers config class: the masks meet each family's logits (soft-capped,
# scaled, divided, a head with a bias); what else the grammar does is the same for every model.
FIRST_OF_EACH_CLASS = list({cls_name: name for name, (cls_name, _) in reversed(CONFIGS.items())}.values())


@pytest.mark.parametrize("family", FIRST_OF_EACH_CLASS, indirect=True)
def test_constraints_hold_and_both_loops_agree(family):
    check_constraints(family[0])


def check_constraints(model_dir: Path) -> None:
    """A regex and a JSON schema: every output finishes in its grammar's language (constraint_result
    satisfied), and the overlap loop (masks filled while the forward runs, chunks of 7 with decodes)
    gives the normal loop's tokens."""
    pytest.importorskip("xgrammar")
    feats = [{"constrained": payload} for payload, _ in CONSTRAINTS] * 2
    by_loop = {}
    for loop, chunk in (("normal", 0), ("overlap", 7)):
        c = SyncClient(
            ServerArgs(dtype="float32", kv_cache_tokens=1024, loop=loop, chunked_prefill_size=chunk),
            model_dir,
        )
        try:
            outs = c.generate(
                (prompts() * 2)[: len(feats)], SamplingParams(temperature=0, max_new_tokens=32), feats
            )
            assert_pools_initial(c)
        finally:
            c.close()
        by_loop[loop] = [collect(o) for o in outs]
    for (payload, in_language), (_ids, text, last) in zip(CONSTRAINTS * 2, by_loop["normal"]):
        assert last.error is None and last.finish_reason is FinishReason.STOP, (payload, text, last.error)
        assert last.extras["constrained"].satisfied and in_language(text), (payload, text)
    assert [r[0] for r in by_loop["overlap"]] == [r[0] for r in by_loop["normal"]]


DEVICE_NEW = 5  # tokens per request through the interpreted Triton kernels (slow): 4 decode steps


# One config per family, each variant the device kernels have: sliding windows, soft-capping,
# local/global layers with their rope bases, partial LongRoPE, layers without rotary, residual scaling,
# norms after the blocks only, interleaved partial rotary, LayerNorm blocks side by side, learned positions.
@pytest.mark.parametrize(
    "family",
    [
        "qwen3-window-wide-heads",
        "gemma2-capped",
        "gemma3-local-global",
        "phi4mini-partial-longrope",
        "smollm3-nope",
        "granite",
        "olmo3-window-rope-per-type-biases",
        "glm4-sandwich",
        "gpt_neox-parallel",
        "gpt2",
        "bloom",
    ],
    indirect=True,
)
def test_device_path_gives_the_whole_prompt_tokens(family):
    model_dir, whole = family
    got = device_path_tokens(model_dir, prompts(), DEVICE_NEW)
    assert got == [ids[:DEVICE_NEW] for ids, _ in whole]


def device_path_tokens(model_dir: Path, prompt_ids: list[list[int]], n_new: int) -> list[list[int]]:
    """CUDA's code on CPU: the Triton attention kernels (interpreted: sliding windows and soft-capping
    included), the overlap loop with prompts in chunks of 7 beside decodes, and decode steps through
    the CUDA graphs' static buffers (replays emulated eagerly); the greedy tokens per prompt."""
    from tests.engine.test_graph_safety import emulate_graphs

    need_triton()
    args = ServerArgs(
        dtype="float32",
        kv_cache_tokens=1024,
        max_running_requests=4,
        loop="overlap",
        attention_backend="triton",
        chunked_prefill_size=7,
    )
    c = SyncClient(args, model_dir)
    try:
        assert c.engine.worker.attention.name == "triton"
        graphs = emulate_graphs(c.engine.worker, 4, c.engine.context_length, c.engine.vocab_size)
        params = SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True)
        got = [collect(o)[0] for o in c.generate(prompt_ids, params)]
        assert graphs.replays > 0
        assert_pools_initial(c)
    finally:
        c.close()
    return got


REFUSED = {  # what config.json asks for (beside a served config): what the one line names
    "architecture": (
        "qwen3-gqa-tied",
        dict(architectures=["Qwen9ForCausalLM"]),
        ["Qwen9ForCausalLM", "unsupported architecture", "LlamaForCausalLM", "Qwen3ForCausalLM",
         "Gemma2ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM"],
    ),
    "activation": ("qwen3-gqa-tied", dict(hidden_act="quick_gelu"), ["'quick_gelu' is not served", "silu"]),
    "post-norm-opt": (
        "opt",
        dict(do_layer_norm_before=False),
        ["do_layer_norm_before false (post-norm) is not served"],
    ),
    "experts-activation": (
        "qwen2-window-above-max-layers",
        dict(architectures=["MixtralForCausalLM"], hidden_act="gelu", num_local_experts=4, num_experts_per_tok=2),
        ["routed experts run SiLU only"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("refused", list(REFUSED))
def test_unsupported_model_ends_the_server_with_one_line(tmp_path, refused):
    """Refused from config.json alone, before the tokenizer or any weight is read."""
    import transformers

    base, changes, words = REFUSED[refused]
    cls_name, kwargs = CONFIGS[base]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **kwargs})
    for key, value in changes.items():
        setattr(cfg, key, value)
    model_dir = tmp_path / "m"
    cfg.save_pretrained(model_dir)
    assert_one_line_refusal(model_dir, words)


REFUSED_SHAPES = {  # a served config with these fields: what the refusal says (from the config alone, in-process)
    # xIELU carries learned scalars: served in Apertus's MLP without a gate, refused in a gated one
    "gated-xielu": (
        "llama-mlp-bias-gelu",
        "LlamaForCausalLM",
        {"hidden_act": "xielu"},
        "a gated MLP with 'xielu'",
    ),
    "granite4-sliding": (
        "granite4-attention-only-dense",
        "GraniteMoeHybridForCausalLM",
        {"layer_types": ["mamba", "sliding_attention"]},
        r"layer types sliding_attention are not served",
    ),
    "falcon-alibi": ("falcon-sequential-mha", "FalconForCausalLM", {"alibi": True}, "ALiBi"),
    "bloom-residual-after-the-norm": (
        "bloom",
        "BloomForCausalLM",
        {"apply_residual_connection_post_layernorm": True},
        "apply_residual_connection_post_layernorm",
    ),
    "mpt-qk-ln": ("mpt-clip", "MptForCausalLM", {"attn_config": {"qk_ln": True}}, "qk_ln"),
}


@pytest.mark.parametrize("case", list(REFUSED_SHAPES))
def test_a_config_the_family_does_not_serve_is_refused_naming_why(case):
    import transformers

    from service.models.families import model_shape
    from service.models.layers import UnsupportedModel

    base, arch, changes, says = REFUSED_SHAPES[case]
    cls_name, kwargs = CONFIGS[base]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **kwargs, **changes})
    cfg.architectures = [arch]
    with pytest.raises(UnsupportedModel, match=says):
        model_shape(cfg)


def assert_one_line_refusal(model_dir: Path, words: list[str], *args: str) -> None:
    """`serve` exits non-zero with one stderr line holding every word, and no traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--model", str(model_dir), "--port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if words[0] in line]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert all(w in lines[0] for w in words), lines[0]


LLAMA_CONFIG = (
    '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, '
    '"intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 49152%s}'
)
NOT_MODELS = {  # config.json's text (None: none), files of the default model beside it, flags: what the line names
    "no-config": (None, (), [], ["no config.json in it"]),
    "not-json": ("{model_type", (), [], ["config.json", "not a valid JSON file"]),
    "unknown-model-type": ('{"model_type": "qwen9"}', (), [], ["config.json", "model type `qwen9`"]),
    "no-architectures-unserved-type": (
        '{"model_type": "bert"}',
        (),
        [],
        ["unsupported architecture 'BertLMHeadModel'"],
    ),
    "beyond-learned-positions": (
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_positions": 64}',
        (),
        ["--context-length", "128"],
        ["--context-length 128", "learned 64 positions"],
    ),
    "quantized-vision-language-top-level": (
        '{"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], '
        '"quantization_config": {"quant_method": "fp8"}}',
        (),
        [],
        ["quantized weights (fp8) are not served"],
    ),
    "quantized": (
        LLAMA_CONFIG % ', "quantization_config": {"quant_method": "awq", "bits": 4}',
        (),
        [],
        ["quantized weights (awq) are not served"],
    ),
    "no-tokenizer": (LLAMA_CONFIG % "", (), [], ["no tokenizer transformers can load"]),
    "no-weights": (LLAMA_CONFIG % "", TOKENIZER_FILES, [], ["no weights in"]),
    "another-family's-weights": (
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 576, "n_layer": 2, '
        '"n_head": 9, "vocab_size": 49152}',
        (*TOKENIZER_FILES, "model.safetensors"),
        [],
        ["checkpoint lacks wte.weight", "is it a GPT2LMHeadModel checkpoint?"],
    ),
}


@pytest.mark.parametrize("case", list(NOT_MODELS))
def test_a_directory_that_is_no_model_ends_the_server_with_one_line(tmp_path, smol_dir, case):
    """The defects: these ended in a Python traceback (and a config.json without `architectures`
    whose model type is not served was taken for Llama's)."""
    text, files, args, words = NOT_MODELS[case]
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    for name in files:
        (tmp_path / name).symlink_to(smol_dir / name)
    assert_one_line_refusal(tmp_path, words, *args)


@pytest.mark.parametrize("family", ["opt"], indirect=True)
def test_pytorch_bin_weights_load_as_safetensors_do(family, tmp_path):
    """Older checkpoints (GPT-2's, OPT's, Pythia's) publish `pytorch_model.bin`, sharded with an
    index or not: read with torch.load(weights_only), they give the safetensors run's tokens."""
    from transformers import AutoModelForCausalLM

    model_dir, whole = family
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    names = sorted(state)
    for shards in (1, 2):
        out = tmp_path / f"{shards}-shards"
        out.mkdir()
        hf.config.save_pretrained(out)
        for f in TOKENIZER_FILES:
            if (model_dir / f).exists():
                shutil.copy(model_dir / f, out / f)
        if shards == 1:
            torch.save(state, out / "pytorch_model.bin")
        else:  # as transformers wrote them: pytorch_model-0000k-of-00002.bin and an index
            halves = (names[: len(names) // 2], names[len(names) // 2 :])
            files = [f"pytorch_model-0000{k + 1}-of-00002.bin" for k in range(2)]
            for part, file in zip(halves, files):
                torch.save({n: state[n] for n in part}, out / file)
            weight_map = {n: file for part, file in zip(halves, files) for n in part}
            (out / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (got,), _ = serve(out, [LOGPROBS], loop="normal", chunked_prefill_size=0, disable_prefix_cache=True)
        assert [ids for ids, _ in got] == [ids for ids, _ in whole]


def vision_language_checkpoint(kind: str, smol: Path, out: Path):
    """A random-init Gemma-3 (4B and up's layout), Mistral-3 (Mistral-Small-3.1's, Ministral 3's) or Idefics3
    (SmolVLM's) vision-language checkpoint with a tiny vision tower, norms and biases perturbed; (its dir, the transformers model)."""
    import transformers

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    if kind == "gemma3":
        text_cfg = transformers.Gemma3TextConfig(sliding_window=8, query_pre_attn_scalar=16, **text)
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14,
        )  # fmt: skip
        cfg = transformers.Gemma3Config(
            text_config=text_cfg.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=1,
            image_token_index=2000, boi_token_index=2001, eoi_token_index=2002,
        )  # fmt: skip
    elif kind in ("qwen3_vl", "qwen3_vl_moe"):
        # Qwen3's (or Qwen3-MoE's) text model with interleaved M-RoPE (equal streams on text) and
        # DeepStack; the MoE's experts are saved as published ([E, in, out]) below
        moe = kind == "qwen3_vl_moe"
        prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
        experts = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2) if moe else {}
        text_cfg = getattr(transformers, prefix + "TextConfig")(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e5,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            **experts,
            **text,
        )
        vision = getattr(transformers, prefix + "VisionConfig")(
            depth=1,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=14,
            out_hidden_size=64,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        )
        cfg = getattr(transformers, prefix + "Config")(
            text_config=text_cfg.to_dict(), vision_config=vision.to_dict(), image_token_id=2000,
            video_token_id=2001, vision_start_token_id=2002, vision_end_token_id=2003,
            **({} if moe else {"tie_word_embeddings": False}),
        )  # fmt: skip
    elif kind in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5 is published so only: hybrid layers, M-RoPE
        prefix = "Qwen3_5Moe" if kind == "qwen3_5_moe" else "Qwen3_5"
        hybrid = dict(
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        )  # fmt: skip
        experts = dict(
            moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        )
        text_cfg = getattr(transformers, prefix + "TextConfig")(
            **hybrid, **(experts if kind == "qwen3_5_moe" else {}), **text
        )
        vision = getattr(transformers, prefix + "VisionConfig")(
            depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, out_hidden_size=64,
            num_position_embeddings=16,
        )  # fmt: skip
        cfg = getattr(transformers, prefix + "Config")(
            text_config=text_cfg.to_dict(), vision_config=vision.to_dict(), image_token_id=2000,
            video_token_id=2001, vision_start_token_id=2002, vision_end_token_id=2003,
        )  # fmt: skip
    elif kind == "lfm2_vl":  # LFM2-VL: LFM2's short convolutions and attention
        text_cfg = transformers.Lfm2Config(
            layer_types=["conv", "full_attention", "conv"], norm_eps=1e-5, conv_bias=False, **text
        )
        vision = transformers.Siglip2VisionConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
            num_patches=16,
        )  # fmt: skip
        cfg = transformers.Lfm2VlConfig(
            text_config=text_cfg.to_dict(), vision_config=vision.to_dict(), image_token_id=2000,
            projector_hidden_size=32,
        )  # fmt: skip
    elif kind == "idefics3":
        text_cfg = transformers.LlamaConfig(**text)
        vision = transformers.Idefics3VisionConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14,
        )  # fmt: skip
        cfg = transformers.Idefics3Config(
            text_config=text_cfg.to_dict(),
            vision_config=vision.to_dict(),
            image_token_id=2000,
            scale_factor=1,
        )
    else:  # Mistral-Small-3.1's text model, Ministral 3's (q scaled by position past 8 here), or
        # Mistral Small 4's (latent attention and experts, q scaled so too)
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.3}  # fmt: skip
        mla = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, first_k_dense_replace=1)  # fmt: skip
        text_cfg = (
            transformers.MistralConfig(sliding_window=None, **text)
            if kind == "mistral3"
            else transformers.Mistral4Config(
                rope_parameters=rope, **{k: v for k, v in {**text, **mla}.items() if k != "head_dim"}
            )
            if kind == "mistral4"
            else transformers.Ministral3Config(
                sliding_window=None,
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                 "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.3},
                **text,
            )
        )  # fmt: skip
        vision = transformers.PixtralVisionConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14, head_dim=16,
        )  # fmt: skip
        cfg = transformers.Mistral3Config(
            text_config=text_cfg.to_dict(), vision_config=vision.to_dict(), image_token_index=2000,
            spatial_merge_size=1,
        )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(cfg).eval()
    save_perturbed(model, smol, out)
    if kind == "qwen3_vl_moe":
        from safetensors.torch import load_file, save_file

        tensors = load_file(out / "model.safetensors")
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out, model


@pytest.mark.parametrize(
    "kind",
    [
        "gemma3",
        "mistral3",
        "ministral3",
        "mistral4",
        "idefics3",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "lfm2_vl",
    ],
)
def test_a_vision_language_checkpoint_serves_its_language_model(kind, smol_dir, tmp_path):
    """Gemma-3 4B and up, Mistral-Small-3.1, Ministral 3, Mistral Small 4, SmolVLM, Qwen3-VL and Qwen3.5 are published as vision-language checkpoints only:
    their language model is served for text (greedy tokens equal transformers' on text prompts),
    and an image is refused naming why."""
    from service.core.request import RequestError

    model_dir, hf = vision_language_checkpoint(kind, smol_dir, tmp_path / kind)
    (got,), _ = serve(model_dir, [{}], loop="normal", chunked_prefill_size=0, disable_prefix_cache=True)
    for prompt, (ids, _) in zip(prompts(), got):
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=N_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert ids == want
    c = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=256), model_dir)
    try:
        with pytest.raises(RequestError) as e:
            c.engine.build_request("x", [5, 6], SamplingParams(), {"multimodal": object()})
        assert e.value.code == "FAILED_PRECONDITION" and "vision tower is not served" in e.value.message
    finally:
        c.close()


@pytest.mark.parametrize(
    "family, prefix, hub",
    [("gpt2", "transformer.", ""), ("opt", "model.decoder.", "decoder."), ("bloom", "transformer.", "")],
    indirect=["family"],
)
def test_the_hubs_tensor_names_load_as_save_pretrained_s(family, prefix, hub, tmp_path):
    """GPT-2's and OPT's files on the hub were saved from their base models (`wte.weight`,
    `decoder.layers.0...`), not under `save_pretrained`'s prefixes: both load, to the same tokens."""
    from safetensors.torch import load_file, save_file

    model_dir, whole = family
    out = tmp_path / "hub"
    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    renamed = {hub + k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(out / "model.safetensors"))
    (got,), _ = serve(out, [LOGPROBS], loop="normal", chunked_prefill_size=0, disable_prefix_cache=True)
    assert [ids for ids, _ in got] == [ids for ids, _ in whole]


def test_weight_files_are_the_transformers_layout_first(tmp_path):
    """A Mistral repo carries `consolidated.safetensors` (its own names) beside the transformers
    files: only the latter are read; safetensors before `.bin`; an index names the shards."""
    from service.models.checkpoint import NoWeights, checkpoint_files

    with pytest.raises(NoWeights):
        checkpoint_files(tmp_path)
    for name in ("consolidated.safetensors", "pytorch_model.bin", "model-00001-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert [f.name for f in checkpoint_files(tmp_path)] == ["model-00001-of-00002.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "x.safetensors"}}')
    assert [f.name for f in checkpoint_files(tmp_path)] == ["x.safetensors"]
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (tmp_path / name).unlink()
    assert [f.name for f in checkpoint_files(tmp_path)] == ["consolidated.safetensors"]
    (tmp_path / "consolidated.safetensors").unlink()
    assert [f.name for f in checkpoint_files(tmp_path)] == ["pytorch_model.bin"]


@pytest.mark.parametrize(
    "family",
    [
        "gpt2",
        "gpt_neox-parallel",
        "stablelm-parallel-tied",
        "cohere-logit-scale",
        "olmo2",
        "glm4-sandwich",
        "granite",
        "smollm3-nope",
        "arcee-relu2",
        "nemotron-partial",
        "nanochat",
        "apertus-xielu",
        "falcon-40b-grouped-two-norms-biases",
        "cohere-qk-norm",
        "olmo-clip",
        "mpt-clip",
    ],
    indirect=True,
)
def test_bf16_engine_tracks_the_float32_run_and_both_loops_agree(family):
    """bf16, the default where the CPU has native bf16 (AMX, AVX-512 BF16), through each block kind
    of the families added last: LayerNorm blocks (learned positions, side by side, without a bias),
    norms after the blocks, sandwich norms, Granite's multipliers, layers without rotary. The
    prompts' logprobs stay within bf16's reach of the float32 run's, and the overlap loop gives the
    normal loop's tokens."""
    model_dir, whole = family
    runs = [
        serve(
            model_dir,
            [LOGPROBS],
            dtype="bfloat16",
            loop=loop,
            chunked_prefill_size=0,
            disable_prefix_cache=True,
        )[0][0]
        for loop in ("normal", "overlap")
    ]
    assert [ids for ids, _ in runs[0]] == [ids for ids, _ in runs[1]]
    worst = 0.0
    for (_, extras), (_, want) in zip(runs[0], whole):
        got, ref = ([e[1] for e in x[0].input] for x in (extras, want))
        assert len(got) == len(ref)
        worst = max(worst, *(abs(a - b) for a, b in zip(got, ref)))
    assert worst < 0.4, worst
