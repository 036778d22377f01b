"""Mixtral, Qwen3-MoE, Qwen2-MoE (a gated shared expert), Granite MoE (an ungated one), OLMoE, FlexOlmo, HunYuan MoE, MiniMax-M2, K-EXAONE, HY V3, Mellum 2, gpt-oss, GLM-4.5, dots.llm1 and Solar Open (DeepSeek-V3's grouped sigmoid routing), ERNIE 4.5 MoE (a biased softmax choice), DeepSeek-V2/V3, GLM-4.7-Flash and Mistral 4 (multi-head latent attention) end to end against transformers (fp32, random-init, one or two configs each).

Greedy tokens (32, ignore_eos, prompts of different lengths in one batch) equal transformers'
`generate(do_sample=False)`, and input/output logprobs are within 1e-4 of its log_softmax: in the
normal loop with whole prompts, in the overlap loop with prompts cut in chunks of 7 (mixed with
the decodes), and in the overlap loop with whole prompts, where the same prompts again hit the
prefix cache and give the same tokens and logprobs; the later router and layout variants of a
family (`LAYOUT_VARIANTS`) run the normal loop's check only. (The suite's time.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from service.config import ServerArgs
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from tests.conftest import TOKENIZER_FILES, hf_greedy
from tests.helpers import greedy_with_logprobs
from tests.models.test_families import DEVICE_NEW, check_constraints, device_path_tokens

N_NEW = 32
TOL = 1e-4
PROMPTS = [[5 + 13 * i + 7 * j for j in range(3 + 11 * i)] for i in range(4)]  # 3 .. 36 tokens

COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=2,
    bos_token_id=1,
)
GRANITE = dict(
    embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.3, logits_scaling=4.0
)
CONFIGS = {
    # 8 experts, top-2, no window, 2 layers
    "mixtral": ("mixtral", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=8)),
    # 6 experts, top-3, sliding window 8, 3 layers, tied embeddings, wider heads
    "mixtral-window": (
        "mixtral",
        dict(
            num_hidden_layers=3,
            intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=8,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
    # 8 experts, top-2, not renormalised, head_dim 32 != hidden / heads, layer 1 dense (mlp_only_layers)
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            head_dim=32,
            mlp_only_layers=[1],
        ),
    ),
    # 16 experts, top-4, renormalised, every other layer sparse (decoder_sparse_step 2), window 8, tied
    "qwen3_moe-sparse-step": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            use_sliding_window=True,
            sliding_window=8,
            tie_word_embeddings=True,
        ),
    ),
    # 6 experts, top-2, not renormalised, a shared expert (48) behind its gate, layer 1 dense
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
    ),
    # 8 experts, top-3, renormalised, MQA, Qwen2-MoE's sliding layers (odd ones below max_window_layers), tied
    "qwen2_moe-window": (
        "qwen2_moe",
        dict(
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            num_key_value_heads=1,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
            tie_word_embeddings=True,
        ),
    ),
    # 4 experts, top-2 (softmax over the chosen), Granite's multipliers
    "granitemoe": (
        "granitemoe",
        dict(
            num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **GRANITE
        ),
    ),
    # 6 experts, top-3, an ungated shared expert, MQA, tied
    "granitemoeshared": (
        "granitemoeshared",
        dict(
            num_hidden_layers=3,
            intermediate_size=24,
            shared_intermediate_size=40,
            num_local_experts=6,
            num_experts_per_tok=3,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            **GRANITE,
        ),
    ),
    # 8 experts, top-3, not renormalised, q/k normed whole, q/k/v clamped
    "olmoe-clip": (
        "olmoe",
        dict(num_hidden_layers=2, intermediate_size=32, num_experts=8, num_experts_per_tok=3, clip_qkv=0.8),
    ),
    # 6 experts, top-2, renormalised, attention biases, MQA, tied
    "olmoe-biases-tied": (
        "olmoe",
        dict(
            num_hidden_layers=3,
            intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            attention_bias=True,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        ),
    ),
    # 16 experts in 4 groups (the best 2 chosen), top-4 renormalised, scaled 2.5, a shared expert,
    # layer 0 dense, partial rotary, q/k/v biases, per-head q/k norms
    "glm4_moe-grouped": (
        "glm4_moe",
        dict(
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=24,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=1,
            attention_bias=True,
            use_qk_norm=True,
            head_dim=32,
        ),
    ),
    # dots.llm1: 8 experts, top-2 not renormalised, two shared experts, every layer sparse, Qwen3's attention
    "dots1": (
        "dots1",
        dict(
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    # ERNIE 4.5 MoE: 8 experts top-3 (softmax, the choice biased), layer 0 dense, a biased shared expert,
    # interleaved rotary, biases everywhere
    "ernie4_5_moe": (
        "ernie4_5_moe",
        dict(
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=24,
            moe_num_experts=8,
            moe_k=3,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
            use_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3: latent attention with q's bottleneck, v wider than q/k (padded), YaRN with its
    # mscale on the scores, interleaved rotary, biases; 16 experts in 4 groups (the best 2), top-4
    # renormalised, scaled 2.5, a shared expert, layer 0 dense
    "deepseek_v3-yarn": (
        "deepseek_v3",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=24,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=32,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    # DeepSeek-V2-Lite's layout: q in one projection, v narrower than q/k; softmax routing within
    # the best 2 of 4 groups ranked by their best expert, not renormalised, scaled 1.5; two shared experts
    "deepseek_v2-lite": (
        "deepseek_v2",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            n_shared_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
        ),
    ),
    # GLM-4.7-Flash: DeepSeek-V3's layout, q/k and v of one width (no padding), rotary not
    # interleaved, the dense and sparse layers as `mlp_layer_types` says, one group
    "glm4_moe_lite": (
        "glm4_moe_lite",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            mlp_layer_types=["sparse", "dense", "sparse"],
            q_lora_rank=16,
            kv_lora_rank=24,
            qk_nope_head_dim=24,
            qk_rope_head_dim=8,
            v_head_dim=32,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    ),
    # Mistral 4: DeepSeek-V3's layout with softmax routing (no correction bias) within the best 2 of
    # 4 groups, renormalised, and q scaled by position (Llama 4's beta, a short period: it turns
    # within the prompts); YaRN with mscale on the scores
    "mistral4": (
        "mistral4",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=32,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=32,
                beta_slow=1,
                llama_4_scaling_beta=0.3,
            ),
        ),
    ),
    # Solar Open: GLM-4.5's experts (two groups, the best one) in every layer under Llama's attention
    # with q/k/v biases, full rotary
    "solar_open": (
        "solar_open",
        dict(
            num_hidden_layers=2,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            n_shared_experts=1,
            attention_bias=True,
            head_dim=32,
        ),
    ),
    # FlexOlmo: OLMoE's experts in OLMo-2's layer (norms after the blocks only)
    "flex_olmo": (
        "flex_olmo",
        dict(
            num_hidden_layers=2,
            intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            pad_token_id=0,
        ),
    ),
    # HunYuan MoE (Hunyuan-A13B): q/k norms after rotary, softmax top-2 of 6 renormalised, a shared
    # MLP beside the experts, biases on the attention
    "hunyuan_v1_moe": (
        "hunyuan_v1_moe",
        dict(
            num_hidden_layers=2,
            intermediate_size=24,
            num_experts=6,
            moe_topk=2,
            attention_bias=True,
            head_dim=16,
            pad_token_id=0,
        ),
    ),
    # MiniMax-M2: sigmoid scores plus a correction bias (on the block), renormalised; whole-projection
    # q/k norms, partial rotary by `rotary_dim`
    "minimax_m2": (
        "minimax_m2",
        dict(
            num_hidden_layers=2,
            intermediate_size=24,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            rotary_dim=8,
        ),
    ),
    # K-EXAONE: EXAONE 4's attention (sliding layers with rotary, a global one without) in pre-norm
    # layers, DeepSeek-V3's experts in 2 groups beside a shared expert, layer 0 dense
    "exaone_moe": (
        "exaone_moe",
        dict(
            num_hidden_layers=3,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            num_shared_experts=1,
            first_k_dense_replace=1,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            head_dim=16,
        ),
    ),
    # HY V3: MiniMax-M2's router (a block-level correction bias), scaled, beside a shared expert,
    # per-head q/k norms, layer 0 dense
    "hy_v3": (
        "hy_v3",
        dict(
            num_hidden_layers=3,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            router_scaling_factor=2.5,
            head_dim=16,
        ),
    ),
    # Mellum 2: Qwen3-MoE's layer with sliding and full layers, a rope base each, layer 1 dense
    "mellum": (
        "mellum",
        dict(
            num_hidden_layers=3,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=6,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_layer_types=["sparse", "dense", "sparse"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    # gpt-oss: attention sinks, sliding and full layers, biases on q/k/v/o; experts with biases and
    # the clamped SwiGLU (a low limit: it clamps here), a router with a bias
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_hidden_layers=2,
            intermediate_size=24,
            num_local_experts=6,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            swiglu_limit=1.5,
        ),
    ),
    # Granite 4.0's hybrid layout, attention in every layer, no rotary (NoPE), experts and a shared MLP
    "granitemoehybrid-nope": (
        "granitemoehybrid",
        dict(
            num_hidden_layers=2,
            intermediate_size=24,
            shared_intermediate_size=40,
            num_local_experts=4,
            num_experts_per_tok=2,
            position_embedding_type="nope",
            layer_types=["attention", "attention"],
            **GRANITE,
        ),
    ),
}
CONFIG_CLASSES = {
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "granitemoe": "GraniteMoeConfig",
    "granitemoeshared": "GraniteMoeSharedConfig",
    "olmoe": "OlmoeConfig",
    "glm4_moe": "Glm4MoeConfig",
    "dots1": "Dots1Config",
    "ernie4_5_moe": "Ernie4_5_MoeConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "deepseek_v3": "DeepseekV3Config",
    "deepseek_v2": "DeepseekV2Config",
    "glm4_moe_lite": "Glm4MoeLiteConfig",
    "mistral4": "Mistral4Config",
    "solar_open": "SolarOpenConfig",
    "flex_olmo": "FlexOlmoConfig",
    "hunyuan_v1_moe": "HunYuanMoEV1Config",
    "minimax_m2": "MiniMaxM2Config",
    "exaone_moe": "ExaoneMoeConfig",
    "hy_v3": "HYV3Config",
    "mellum": "MellumConfig",
    "gpt_oss": "GptOssConfig",
}


def causal_lm(model_dir_or_config, dtype: torch.dtype = torch.float32):
    """transformers' causal LM of a config or a saved model; Mistral 4's by its class (transformers
    has it, but no AutoModelForCausalLM entry: it ships as Mistral Small 4's language model)."""
    import transformers

    if isinstance(model_dir_or_config, Path):
        config = transformers.AutoConfig.from_pretrained(model_dir_or_config)
        if config.model_type == "mistral4":
            return transformers.Mistral4ForCausalLM.from_pretrained(model_dir_or_config, dtype=dtype)
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir_or_config, dtype=dtype)
    if model_dir_or_config.model_type == "mistral4":
        return transformers.Mistral4ForCausalLM(model_dir_or_config).to(dtype)
    return transformers.AutoModelForCausalLM.from_config(model_dir_or_config, dtype=dtype)


def make_tiny_moe(smol: Path, out: Path, name: str) -> Path:
    import transformers

    family, extra = CONFIGS[name]
    torch.manual_seed(0)
    config = getattr(transformers, CONFIG_CLASSES[family])(**{**COMMON, **extra})
    model = causal_lm(config)
    with torch.no_grad():  # routers sharp enough that the choice of experts matters
        for n, p in model.named_parameters():
            if n.endswith(".gate.weight"):
                p.normal_(0, 1.0)
        for n, b in model.named_buffers():  # DeepSeek-V3's correction bias: zeros at init
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
        for n, p in model.named_parameters():  # ERNIE's (a parameter; on softmax scores)
            if n.endswith("e_score_correction_bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe_case(request, smol_dir, tmp_path_factory):
    """(model dir, greedy references, transformers' log_softmax over prompt + reference)."""
    model_dir = make_tiny_moe(smol_dir, tmp_path_factory.mktemp(request.param), request.param)
    hf = causal_lm(model_dir).eval()
    refs = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    with torch.inference_mode():
        lps = [
            torch.log_softmax(hf(torch.tensor([p + r])).logits[0].float(), -1) for p, r in zip(PROMPTS, refs)
        ]
    return model_dir, refs, lps


def _run(model_dir: Path, prompts=PROMPTS, retracts: bool = False, **args) -> list:
    """retracts: the run must retract some request (a pool too small for every output)."""
    outs, retractions = greedy_with_logprobs(model_dir, prompts, N_NEW, **args)
    assert (retractions > 0) == retracts
    return outs


def _logprobs(outs) -> tuple[list[float], list[float]]:
    """(input logprobs, output logprobs) of one request's deltas."""
    fields = [f for f in (o.extras.get("logprobs") for o in outs) if f is not None]
    return (
        [e[1] for f in fields for e in f.input or []],
        [e[1] for f in fields for e in f.output],
    )


def _check_against_reference(outs_per_request, refs, lps):
    for p, outs, ref, lp in zip(PROMPTS, outs_per_request, refs, lps):
        ids = collect(outs)[0]
        assert ids == ref
        inputs, outputs = _logprobs(outs)
        want_in = [float(lp[k - 1, p[k]]) for k in range(1, len(p))]
        want_out = [float(lp[len(p) - 1 + k, t]) for k, t in enumerate(ids)]
        assert len(inputs) == len(want_in) and len(outputs) == len(want_out)
        assert max((abs(a - b) for a, b in zip(inputs + outputs, want_in + want_out)), default=0) < TOL


def test_greedy_and_logprobs_match_transformers_whole_prompts_normal_loop(moe_case):
    model_dir, refs, lps = moe_case
    _check_against_reference(_run(model_dir, loop="normal"), refs, lps)


# Chunked overlap batches, retraction and prefix hits work the scheduler and the pool, the same
# whatever the experts or the layer around them: they run on the first configs, on latent attention
# and on sinks (their pool use differs); the later variants of a router or a layer layout run
# tokens and logprobs, and constraints per family (the suite's time).
LAYOUT_VARIANTS = (
    "deepseek_v2-lite",
    "glm4_moe_lite",
    "mistral4",
    "solar_open",
    "flex_olmo",
    "hunyuan_v1_moe",
    "minimax_m2",
    "exaone_moe",
    "hy_v3",
    "mellum",
)
POOL_CHECKS = [name for name in CONFIGS if name not in LAYOUT_VARIANTS]


@pytest.mark.parametrize("moe_case", POOL_CHECKS, indirect=True)
def test_chunks_of_7_in_overlap_loop_match_transformers(moe_case):
    model_dir, refs, lps = moe_case
    outs = _run(model_dir, loop="overlap", chunked_prefill_size=7, enable_mixed_chunk=True)
    _check_against_reference(outs, refs, lps)


@pytest.mark.parametrize("moe_case", POOL_CHECKS, indirect=True)
def test_retraction_re_prefills_to_transformers_tokens(moe_case):
    """A pool that holds two requests' prompts but not their outputs: requests are retracted and
    re-prefilled (prompt and kept output), and every one still matches transformers (the overlap
    loop; the normal loop's retraction is the same for every model)."""
    model_dir, refs, lps = moe_case
    _check_against_reference(_run(model_dir, retracts=True, loop="overlap", kv_cache_tokens=70), refs, lps)


@pytest.mark.parametrize(
    "moe_case",
    list({family: name for name, (family, _) in reversed(CONFIGS.items()) if name in POOL_CHECKS}.values()),
    indirect=True,
)
def test_constraints_hold_and_both_loops_agree(moe_case):
    """One config per family but the later layout variants: the masks meet its logits."""
    check_constraints(moe_case[0])


@pytest.mark.parametrize("moe_case", POOL_CHECKS, indirect=True)
def test_prefix_cache_hit_equals_miss_overlap_loop(moe_case):
    """The same prompts twice: the first run (a miss) matches transformers, the second hits the cache
    (all but each prompt's last token) and gives the same tokens and output logprobs."""
    model_dir, refs, lps = moe_case
    client = SyncClient(
        ServerArgs(dtype="float32", loop="overlap", kv_cache_tokens=2048, max_running_requests=8), model_dir
    )
    sp = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
    payload = [{"logprobs": dict(return_logprob=True, logprob_start_len=0)}] * len(PROMPTS)
    try:
        miss = client.generate(PROMPTS, sp, payload)
        hit = client.generate(PROMPTS, sp, [{"logprobs": dict(return_logprob=True)}] * len(PROMPTS))
    finally:
        client.close()
    _check_against_reference(miss, refs, lps)
    assert [collect(o)[2].cached_tokens for o in hit] == [len(p) - 1 for p in PROMPTS]
    assert [collect(o)[0] for o in hit] == refs
    for a, b in zip(miss, hit):
        assert max(abs(x - y) for x, y in zip(_logprobs(a)[1], _logprobs(b)[1])) < TOL


@pytest.mark.parametrize(
    "moe_case",
    ["mixtral", "qwen3_moe", "qwen2_moe", "granitemoeshared", "deepseek_v2-lite", "gpt_oss"],
    indirect=True,
)
def test_device_path_gives_transformers_tokens(moe_case):
    model_dir, refs, _ = moe_case
    assert device_path_tokens(model_dir, PROMPTS, DEVICE_NEW) == [r[:DEVICE_NEW] for r in refs]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_fused_expert_layout_loads_the_same_weights(name, smol_dir, tmp_path):
    """A checkpoint with transformers' in-memory layout (experts fused as 3-D tensors under
    `mlp.experts`) loads the same model as the per-expert layout `save_pretrained` writes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from service.models.loader import load_model

    per_expert = make_tiny_moe(smol_dir, tmp_path / "per-expert", name)
    fused = tmp_path / "fused"
    fused.mkdir()
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(fused / "model.safetensors"))
    hf.config.save_pretrained(fused)
    a, b = (load_model(d, torch.float32, 64, pack=False).state_dict() for d in (per_expert, fused))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    moe = next(
        m for m in load_model(fused, torch.float32, 64, pack=False).modules() if hasattr(m, "w_gate_up")
    )
    assert (
        moe.w_gate_up.shape[0] == CONFIGS[name][1]["num_experts" if "qwen" in name else "num_local_experts"]
    )


@pytest.mark.parametrize(
    "moe_case", ["qwen3_moe-sparse-step", "glm4_moe-grouped", "deepseek_v3-yarn"], indirect=True
)
def test_bf16_engine_tracks_transformers_and_both_loops_agree(moe_case):
    """bf16 (the native experts kernel where the CPU has AVX-512 BF16, the torch matmuls elsewhere):
    the prompts' logprobs stay within bf16's reach of transformers' float32 ones (0.25, or no
    further than transformers' own bf16 run where a token's experts change with the rounding, as
    DeepSeek-V3's grouped choice makes likelier), and the overlap loop gives the normal loop's tokens."""
    model_dir, _, lps = moe_case
    normal, overlap = (_run(model_dir, dtype="bfloat16", loop=loop) for loop in ("normal", "overlap"))
    assert [collect(o)[0] for o in normal] == [collect(o)[0] for o in overlap]
    hf16 = causal_lm(model_dir, torch.bfloat16).eval()
    for p, outs, lp in zip(PROMPTS, normal, lps):
        want = [float(lp[k - 1, p[k]]) for k in range(1, len(p))]
        got = _logprobs(outs)[0]
        with torch.inference_mode():
            theirs = torch.log_softmax(hf16(torch.tensor([p])).logits[0].float(), -1)
        their_dev = max(
            (abs(float(theirs[k - 1, p[k]]) - w) for k, w in zip(range(1, len(p)), want)), default=0
        )
        our_dev = max((abs(a - b) for a, b in zip(got, want)), default=0)
        assert len(got) == len(want) and our_dev < max(0.25, 1.1 * their_dev), (our_dev, their_dev)


def test_expert_counts_that_differ_between_layers_are_refused_naming_them():
    """HunYuan's config may give `moe_topk` per layer: served where every layer has the same, else
    refused with one line naming the field."""
    import transformers

    from service.models.families import model_shape
    from service.models.layers import UnsupportedModel

    family, extra = CONFIGS["hunyuan_v1_moe"]
    uniform = transformers.HunYuanMoEV1Config(**{**COMMON, **extra, "moe_topk": [2, 2]})
    uniform.architectures = ["HunYuanMoEV1ForCausalLM"]
    assert model_shape(uniform).moe.top_k == 2
    mixed = transformers.HunYuanMoEV1Config(**{**COMMON, **extra, "moe_topk": [1, 2]})
    mixed.architectures = ["HunYuanMoEV1ForCausalLM"]
    with pytest.raises(UnsupportedModel, match=r"moe_topk differs between layers"):
        model_shape(mixed)
