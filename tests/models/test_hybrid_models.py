"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers beside gated attention) end to end
against transformers (fp32, random-init, norms and decays perturbed).

Their linear-attention layers keep a state per request slot instead of K/V rows. Greedy tokens (ignore_eos,
prompts of 1 to 150 tokens in one batch: several of the rule's 64-token chunks) equal transformers'
`generate`; prompt logprobs are within 3e-4 of its forward over the prompt, and output logprobs of
the logits its `generate` saw (its step-by-step path, as ours). Why 3e-4, not the 1e-4 of the other
families: the chunked and the step-by-step forms of the rule differ by up to 2.4e-4 in fp32 on these
sharp random models in transformers itself (its whole-sequence forward against its own generate),
and a prompt cut in chunks of 7 mixes the two; the typical error is 1e-6 to 1e-5. Checked in the normal loop with whole prompts, in the overlap loop with prompts cut in chunks
of 7 beside decodes (each chunk from the state the last one left), and under retraction (states
restart from zeros, or from the snapshot taken at the retraction while the cache holds it). The prefix cache keeps snapshots of the states
beside the K/V rows: a second turn starts from the first turn's, and gives transformers' tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from service.config import ServerArgs
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from service.models import cpu_kernels
from tests.conftest import TOKENIZER_FILES
from tests.helpers import greedy_with_logprobs
from tests.models.test_families import check_constraints

N_NEW = 24
TOL = 3e-4  # see above
PROMPTS = [[5 + 13 * i + 7 * j for j in range(3 + 11 * i)] for i in range(4)] + [
    [7 + 3 * j for j in range(150)],
    [9],  # a prompt of one token: a chunk of one, from zeroed states
]

# The state-space LMs' configs name no attention heads (state-spaces/mamba-130m-hf's config.json,
# Mamba2Config's fields): COMMON's are left out of theirs, as a real checkpoint would have them
NO_ATTENTION = dict(num_attention_heads=None, num_key_value_heads=None)
COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=2,
    bos_token_id=1,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two v heads per q/k head
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
EXPERTS = dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2
)
CONFIGS = {
    # dense, partial rotary (a quarter of head_dim), tied embeddings
    "qwen3_5": ("Qwen3_5TextConfig", dict(intermediate_size=96, tie_word_embeddings=True)),
    # routed experts and a gated shared expert in every layer, a qkv bias-free attention first
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        dict(
            EXPERTS, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]
        ),
    ),
    # one dense layer (mlp_only_layers), top-k not renormalised, one v head per q/k head
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            EXPERTS, intermediate_size=96, mlp_only_layers=[2], norm_topk_prob=False, linear_num_value_heads=2
        ),
    ),
    # short convolutions (biases on) in three layers of four, the MLP's width adjusted (multiplier 1.5)
    "lfm2": (
        "Lfm2Config",
        dict(
            intermediate_size=144,
            block_ffn_dim_multiplier=1.5,
            block_multiple_of=32,
            conv_bias=True,
            layer_types=["conv", "conv", "full_attention", "conv"],
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    # Granite 4.0-H: Mamba-2 (8 heads of 16 in 2 groups, d_state 16, conv biases) beside NoPE attention,
    # Granite's multipliers, the shared MLP alone
    "granite4_h": (
        "GraniteMoeHybridConfig",
        dict(
            intermediate_size=96,
            shared_intermediate_size=80,
            num_local_experts=0,
            position_embedding_type="nope",
            layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_expand=2,
            mamba_d_conv=4,
            embedding_multiplier=12.0,
            attention_multiplier=0.03,
            residual_multiplier=0.22,
            logits_scaling=8.0,
        ),
    ),  # fmt: skip
    # ... with routed experts beside the shared MLP, rotary, one group, projection biases
    "granite4_h_moe": (
        "GraniteMoeHybridConfig",
        dict(
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            position_embedding_type="rope",
            layer_types=["attention", "mamba", "mamba", "attention"],
            mamba_n_heads=4,
            mamba_n_groups=1,
            mamba_d_state=24,
            mamba_expand=1,
            mamba_proj_bias=True,
            embedding_multiplier=6.0,
            attention_multiplier=0.05,
            residual_multiplier=0.3,
            logits_scaling=4.0,
        ),
    ),  # fmt: skip
    # Bamba: Mamba-2 and attention with rotary on half of each head, MLP biases
    "bamba": (
        "BambaConfig",
        dict(
            intermediate_size=96,
            attn_layer_indices=[2],
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_expand=2,
            layer_types=None,  # Bamba's come from attn_layer_indices
            mlp_bias=True,
        ),
    ),  # fmt: skip
    # Nemotron-H: one block per layer, Mamba-2, NoPE attention and ReLU-squared MLPs
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            layer_types=None,
            num_hidden_layers=None,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
            intermediate_size=96,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            use_bias=True,
            mlp_bias=True,
            time_step_min=0.5,  # the chunked form's floor on dt (the step has none): reached here
        ),
    ),
    # Falcon-H1: Mamba-2 beside attention in every layer, muP multipliers everywhere, the Mamba's
    # norm before its gate; and without a norm, biases on
    "falcon_h1": (
        "FalconH1Config",
        dict(
            layer_types=None,
            intermediate_size=96,
            mamba_d_ssm=96,
            mamba_n_heads=6,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            embedding_multiplier=3.0,
            lm_head_multiplier=0.5,
            mlp_multipliers=[0.8, 1.3],
            key_multiplier=0.7,
            attention_in_multiplier=1.2,
            attention_out_multiplier=0.9,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.5],
            ssm_in_multiplier=0.6,
            ssm_out_multiplier=1.4,
        ),
    ),  # fmt: skip
    "falcon_h1-no-norm": (
        "FalconH1Config",
        dict(
            layer_types=None,
            num_hidden_layers=2,
            intermediate_size=96,
            mamba_n_heads=4,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_rms_norm=False,
            mamba_proj_bias=True,
            attention_bias=True,
            mlp_bias=True,
            mamba_expand=1,
            key_multiplier=0.5,
            ssm_multipliers=[0.5, 2.0, 1.0, 1.0, 0.7],
        ),
    ),  # fmt: skip
    # Mamba-2 alone (Codestral Mamba's layout): no attention at all
    "mamba2": (
        "Mamba2Config",
        dict(
            layer_types=None,
            num_heads=8,
            head_dim=16,
            n_groups=2,
            state_size=16,
            expand=2,
            use_bias=True,
            **NO_ATTENTION,
        ),
    ),  # fmt: skip
    # LFM3: sliding (window 8) and full attention with a rope each (proportional, half the head, on
    # the full ones), a gate per head, sandwich norms, a conv of 7 taps
    "lfm3": (
        "Lfm3Config",
        dict(
            intermediate_size=96,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            sliding_window=8,
            conv_L_cache=7,
            tie_word_embeddings=False,
            pad_token_id=0,
        ),
    ),  # fmt: skip
    # OLMo hybrid: Gated DeltaNet (beta doubled) pre-norm, OLMo-2's attention post-norm, no rotary as
    # released
    "olmo_hybrid": ("OlmoHybridConfig", dict(intermediate_size=96, pad_token_id=0)),
    # ... with rotary, beta as is
    "olmo_hybrid-rope": (
        "OlmoHybridConfig",
        dict(
            intermediate_size=96,
            pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            linear_allow_neg_eigval=False,
            num_hidden_layers=2,
            layer_types=["full_attention", "linear_attention"],
        ),
    ),  # fmt: skip
    # Mamba (the first): a selective scan per channel and state, dt of rank 5
    "mamba": (
        "MambaConfig",
        dict(
            layer_types=None,
            state_size=8,
            expand=2,
            time_step_rank=5,
            use_bias=True,
            tie_word_embeddings=True,
            head_dim=None,
            **NO_ATTENTION,
        ),
    ),
    # FalconMamba: B, C and dt RMS-normed
    "falcon_mamba": (
        "FalconMambaConfig",
        dict(layer_types=None, state_size=8, expand=2, mixer_rms_eps=1e-6, head_dim=None, **NO_ATTENTION),
    ),
    # Jamba: Mamba with weighted dt/B/C norms, attention without positions at layer 2, experts at
    # the odd layers (softmax top-2 of 4, not renormalised)
    "jamba": (
        "JambaConfig",
        dict(
            layer_types=None,
            intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=4,
            attn_layer_offset=2,
            mamba_d_state=8,
            mamba_expand=2,
            use_mamba_kernels=False,
        ),
    ),  # fmt: skip
    # Nemotron 3: ... with routed experts (sigmoid choice plus a bias, scaled by 2) and a shared expert,
    # all without a gate
    "nemotron_h-moe": (
        "NemotronHConfig",
        dict(
            layer_types=None,
            num_hidden_layers=None,
            layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            routed_scaling_factor=2.0,
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
        ),
    ),  # fmt: skip
    # two dense layers, then experts chosen on sigmoid scores plus a bias, scaled by 2
    "lfm2_moe": (
        "Lfm2MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_dense_layers=2,
            routed_scaling_factor=2.0,
            conv_L_cache=4,
            layer_types=["conv", "full_attention", "conv", "conv"],
        ),
    ),  # fmt: skip
}


def perturb(model) -> None:
    """Routers sharp enough that the choice of experts matters; norms off 1 (plain ones) or off 0
    (Qwen's zero-centred ones); decays, time steps, skips and biases spread."""
    plain_norms = not type(model).__name__.startswith("Qwen")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".gate.weight"):
                p.normal_(0, 1.0)
            elif n.endswith(("norm.weight", "norm.gate")) and p.dim() == 1:
                p.normal_(1.0 if plain_norms else 0.0, 0.3)
            elif n.endswith(("A_log", "dt_bias", ".D", "dt_proj.bias", "dt_layernorm.weight")):
                p.normal_(0, 0.3)
            elif n.endswith(("conv.bias", "conv1d.bias", "proj.bias")):
                p.normal_(0, 0.1)
        for n, b in list(model.named_parameters()) + list(model.named_buffers()):
            if n.endswith(("expert_bias", "e_score_correction_bias")):
                b.normal_(0, 0.3)


def make_tiny_hybrid(smol: Path, out: Path, name: str):
    import transformers

    config_class, extra = CONFIGS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        **{k: v for k, v in {**COMMON, **extra}.items() if v is not None}
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb(model)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    return model


def reference(hf, prompt: list[int]) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy tokens, its prompt logprobs (one forward) and output logprobs (the
    logits its generate saw)."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=N_NEW,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        ids = out.sequences[0, len(prompt) :].tolist()
        outputs = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, ids)]
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    return ids, [float(lp[k - 1, prompt[k]]) for k in range(1, len(prompt))], outputs


@pytest.fixture(scope="module", params=list(CONFIGS))
def hybrid_case(request, smol_dir, tmp_path_factory):
    """(model dir, per prompt transformers' (tokens, prompt logprobs, output logprobs))."""
    out = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_hybrid(smol_dir, out, request.param)
    return out, [reference(hf, p) for p in PROMPTS]


def _run(model_dir: Path, prompts=PROMPTS, **args) -> tuple[list, int]:
    """Each prompt's outputs, and the run's retractions."""
    return greedy_with_logprobs(model_dir, prompts, N_NEW, **args)


def _check(outs_per_request, refs) -> None:
    for outs, (ids, want_in, want_out) in zip(outs_per_request, refs):
        assert collect(outs)[0] == ids
        fields = [f for f in (o.extras.get("logprobs") for o in outs) if f is not None]
        inputs = [e[1] for f in fields for e in f.input or []]
        outputs = [e[1] for f in fields for e in f.output]
        assert len(inputs) == len(want_in) and len(outputs) == len(want_out)
        assert max(abs(a - b) for a, b in zip(inputs + outputs, want_in + want_out)) < TOL


def test_greedy_and_logprobs_match_transformers_whole_prompts_normal_loop(hybrid_case):
    model_dir, refs = hybrid_case
    _check(_run(model_dir, loop="normal")[0], refs)


def test_chunks_of_7_in_overlap_loop_match_transformers(hybrid_case):
    model_dir, refs = hybrid_case
    _check(_run(model_dir, loop="overlap", chunked_prefill_size=7, enable_mixed_chunk=True)[0], refs)


@pytest.mark.parametrize("hybrid_case", ["qwen3_5", "qwen3_next"], indirect=True)
def test_retraction_restarts_the_states_and_matches_transformers(hybrid_case):
    """A pool that holds two requests' prompts but not their outputs: retracted requests re-prefill
    (prompt and kept output) into slots other requests used meanwhile, from zeroed states (the pool
    is too small to keep the snapshot's K/V rows until then)."""
    model_dir, refs = hybrid_case
    outs, retractions = _run(model_dir, PROMPTS[:4], loop="overlap", kv_cache_tokens=60)
    assert retractions > 0
    _check(outs, refs[:4])


TAIL = [11, 12, 13]  # a second turn: the first turn's prompt and output, and these


def _second_turns(model_dir: Path, **args) -> tuple[list[list[int]], list, list[int], object]:
    """Each prompt, then (all at once) each prompt with its greedy output and TAIL, then each prompt with
    TAIL twice (an answer edited away): both kinds of second turns' prompts, outputs (output logprobs)
    and cached tokens, and the prefix cache's info."""
    client = SyncClient(
        ServerArgs(
            **dict(
                dict(dtype="float32", kv_cache_tokens=4096, max_running_requests=8, state_snapshots=32),
                **args,
            )
        ),
        model_dir,
    )
    sp = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
    try:
        first = client.generate(PROMPTS, sp)
        turns = [p + collect(o)[0] + TAIL for p, o in zip(PROMPTS, first)]
        turns += [p + TAIL + TAIL for p in PROMPTS]
        second = client.generate(
            turns[: len(PROMPTS)], sp, [{"logprobs": dict(return_logprob=True)}] * len(PROMPTS)
        )
        second += client.generate(
            turns[len(PROMPTS) :], sp, [{"logprobs": dict(return_logprob=True)}] * len(PROMPTS)
        )
        info = client.engine.scheduler.prefix_cache.info()
        client.engine.scheduler.prefix_cache.tree.check()
        assert client.engine.kv_all_free()
    finally:
        client.close()
    return turns, second, [collect(o)[2].cached_tokens for o in second], info


@pytest.mark.parametrize("hybrid_case", ["qwen3_5_moe", "falcon_h1", "jamba"], indirect=True)
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_second_turn_starts_from_a_snapshot_of_the_states(hybrid_case, loop):
    """A conversation's second turn matches the first turn's prompt and output: its K/V rows and a
    snapshot of the recurrent layers' states after them (taken when the first turn ended). One whose
    history lost the answer (as a chat template that drops reasoning does) matches the first prompt, and
    the snapshot taken after its prefill. Their tokens and logprobs are transformers' on the whole second
    prompt. The overlap loop cuts prompts in chunks of 7 beside decodes."""
    import transformers

    model_dir, _ = hybrid_case
    chunks = dict(chunked_prefill_size=7, enable_mixed_chunk=True) if loop == "overlap" else {}
    turns, outs, cached, info = _second_turns(model_dir, loop=loop, **chunks)
    assert all(c >= len(p) + N_NEW - 1 for c, p in zip(cached, PROMPTS)), cached
    assert cached[len(PROMPTS) :] == [len(p) for p in PROMPTS]
    assert all(c < len(t) for c, t in zip(cached, turns))
    assert info.state_snapshot_rows > 0 and info.hit_requests == 2 * len(PROMPTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, got in zip(turns, outs):
        ids, _, want_out = reference(hf, prompt)
        assert collect(got)[0] == ids
        lps = [e[1] for o in got if o.extras.get("logprobs") for e in o.extras["logprobs"].output]
        assert max(abs(a - b) for a, b in zip(lps, want_out)) < TOL


@pytest.mark.parametrize("hybrid_case", ["qwen3_5_moe", "granite4_h"], indirect=True)
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_turns_whose_history_keeps_part_of_the_answer_find_the_last_prompt(hybrid_case, loop):
    """Each turn keeps 5 tokens of the last answer, then new ones: its match's K/V goes 5 tokens past
    the last prompt's snapshot, where it starts. When its own prompt is cached, the tree's rows for
    those 5 tokens stand in for its own; the next turn finds its prompt whole. Every turn answers as
    transformers; no KV row leaks."""
    import transformers

    model_dir, _ = hybrid_case
    client = SyncClient(
        ServerArgs(dtype="float32", kv_cache_tokens=4096, loop=loop, chunked_prefill_size=7), model_dir
    )
    sp = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
    turns, outs = [PROMPTS[2]], []
    try:
        for t in range(3):
            (out,) = client.generate([turns[-1]], sp)
            outs.append(out)
            turns.append(turns[-1] + collect(out)[0][:5] + [11 + t, 12, 13])
        client.engine.scheduler.prefix_cache.tree.check()
        assert client.engine.kv_all_free()
    finally:
        client.close()
    assert [collect(o)[2].cached_tokens for o in outs] == [0, len(turns[0]), len(turns[1])]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert [collect(o)[0] for o in outs] == [reference(hf, p)[0] for p in turns[:3]]


@pytest.mark.parametrize("hybrid_case", ["qwen3_5_moe", "jamba"], indirect=True)
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_shared_system_prompt_gets_a_snapshot_where_prompts_part(hybrid_case, loop):
    """Three chats with one 40-token system prompt, one after the other: the second finds the first's
    rows but no snapshot where they part, so its prompt is cut there (chunked prefill) and a snapshot
    kept after the system prompt; the third starts from it. All three answer as transformers."""
    import transformers

    model_dir, _ = hybrid_case
    system = [100 + 3 * j for j in range(40)]
    prompts = [system + [7000 + 11 * i + j for j in range(9 + i)] for i in range(3)]
    client = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=4096, loop=loop), model_dir)
    sp = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
    try:
        outs = [client.generate([p], sp)[0] for p in prompts]
        client.engine.scheduler.prefix_cache.tree.check()
        assert client.engine.kv_all_free()
    finally:
        client.close()
    assert [collect(o)[2].cached_tokens for o in outs] == [0, 0, len(system)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert [collect(o)[0] for o in outs] == [reference(hf, p)[0] for p in prompts]


@pytest.mark.parametrize("hybrid_case", ["qwen3_5_moe"], indirect=True)
def test_few_snapshots_are_shared_out_least_recently_used_first(hybrid_case):
    """Two snapshot rows for six conversations run one after the other: each ending conversation's
    snapshot takes the row of the least recently used one (and the K/V rows only it made useful go
    with it). The last conversation's second turn hits, the first one's recomputes, and both answer as
    with the cache off. With --state-snapshots 0 the matrix marks the prefix cache unavailable, saying why."""
    model_dir, _ = hybrid_case
    sp = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
    args = dict(dtype="float32", kv_cache_tokens=4096, max_running_requests=1, loop="normal")
    client = SyncClient(ServerArgs(**args, state_snapshots=2), model_dir)
    try:
        first = client.generate(PROMPTS, sp)
        turns = [p + collect(o)[0] + TAIL for p, o in zip(PROMPTS, first)]
        cache = client.engine.scheduler.prefix_cache
        assert cache.info().state_snapshots == 2 and cache.states.free_count == 0
        last, first_again = (client.generate([turns[i]], sp)[0] for i in (-1, 0))
        cache.tree.check()
        assert collect(last)[2].cached_tokens >= len(PROMPTS[-1]) + N_NEW - 1
        assert collect(first_again)[2].cached_tokens == 0
        assert client.engine.kv_all_free()
    finally:
        client.close()
    off = SyncClient(ServerArgs(**args, state_snapshots=0), model_dir)
    try:
        plain = off.generate([turns[-1], turns[0]], sp)
        row = next(r for r in off.engine.features.matrix() if r.feature == "prefix_cache")
        assert not off.engine.scheduler.prefix_cache.enabled
    finally:
        off.close()
    assert [collect(last)[0], collect(first_again)[0]] == [collect(o)[0] for o in plain]
    assert not row.available and "--state-snapshots 0" in row.unavailable_reason


@pytest.mark.parametrize("hybrid_case", ["qwen3_5"], indirect=True)
def test_a_snapshot_follows_the_late_step_unless_that_step_fails(hybrid_case):
    """Overlap loop: a first turn that ends on a stop token ends while the step that runs that token late
    is in flight; its snapshot follows that token too, so the second turn finds all of the first turn
    cached. When that late step fails, that snapshot goes: a second turn that started from it already
    fails (it is told why), and one sent after finds only the snapshot taken after the first prompt,
    which the failure did not touch. Both answer as transformers."""
    import transformers

    from service.core.forward_batch import ForwardMode
    from tests.helpers import before_each_forward

    model_dir, refs = hybrid_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    client = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=4096, loop="overlap"), model_dir)
    try:
        for i, fail in ((1, False), (2, True)):
            prompt, want = PROMPTS[i], refs[i][0]
            stop = want[10]
            want = want[: want.index(stop) + 1]
            sp = SamplingParams(temperature=0, max_new_tokens=N_NEW, stop_token_ids=[stop])

            late = len(prompt) + len(want) - 1  # the position of the stop token's own step

            def fail_the_late_step(fb, late=late, fail=fail) -> None:
                if fail and fb.mode is ForwardMode.DECODE and int(fb.positions.max()) == late:
                    raise RuntimeError("injected fault")

            turn = prompt + want + TAIL
            again = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
            with before_each_forward(client.engine.worker, fail_the_late_step):  # (it may run after the
                (first,) = client.generate([prompt], sp)  # first turn's answer is out)
                assert collect(first)[0] == want
                (second,) = client.generate([turn], again)
                if fail and collect(second)[2].error is not None:  # it started from the snapshot before
                    assert "spoiled" in collect(second)[2].error  # the failure was seen: it fails too, and
                    (second,) = client.generate([turn], again)  # sent again, it recomputes
            assert collect(second)[2].cached_tokens == len(prompt) + (0 if fail else len(want))
            assert collect(second)[0] == reference(hf, turn)[0]
        client.engine.scheduler.prefix_cache.tree.check()
        assert client.engine.kv_all_free()
    finally:
        client.close()


@pytest.mark.parametrize("hybrid_case", ["qwen3_next"], indirect=True)
def test_constraints_hold_and_both_loops_agree(hybrid_case):
    check_constraints(hybrid_case[0])


@pytest.mark.parametrize("hybrid_case", ["qwen3_5", "granite4_h", "lfm2"], indirect=True)
def test_bf16_engine_tracks_transformers_and_both_loops_agree(hybrid_case):
    """bf16 weights and activations (states float32, as transformers keeps them): the prompts'
    logprobs stay within bf16's reach of transformers' float32 ones, on average no further than
    transformers' own bf16 run on the same prompts (its single worst token moves by 0.1 to 0.3 on
    these sharp random models, ours alike: the mean is what says whether a path loses precision),
    and the overlap loop (chunks of 7) gives the normal loop's tokens."""
    import transformers

    model_dir, refs = hybrid_case
    normal, _ = _run(model_dir, dtype="bfloat16", loop="normal")
    overlap, _ = _run(model_dir, dtype="bfloat16", loop="overlap", chunked_prefill_size=7)
    assert [collect(o)[0] for o in normal] == [collect(o)[0] for o in overlap]
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ours, theirs = [], []
    for p, outs, (_, want, _) in zip(PROMPTS, normal, refs):
        got = [e[1] for f in (o.extras.get("logprobs") for o in outs) if f is not None for e in f.input or []]
        assert len(got) == len(want)
        with torch.inference_mode():
            lp = torch.log_softmax(hf16(torch.tensor([p])).logits[0].float(), -1)
        theirs += [abs(float(lp[k - 1, p[k]]) - w) for k, w in zip(range(1, len(p)), want)]
        ours += [abs(a - b) for a, b in zip(got, want)]
    mean_ours, mean_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert mean_ours < 1.25 * mean_theirs + 0.01 and max(ours) < 0.5, (mean_ours, mean_theirs, max(ours))


def test_the_chunked_rule_equals_the_step_by_step_rule():
    """Padded rows, a starting state and several chunks: chunked_rule gives recurrent_step's outputs
    and final state token by token, and padding leaves a row's state as its last real token left it."""
    from service.models.gated_delta import chunked_rule, l2_normalise, recurrent_step

    torch.manual_seed(0)
    b, h, n, dk, dv = 3, 2, 150, 8, 12
    q, k = (l2_normalise(torch.randn(b, h, n, dk, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(b, h, n, dv, dtype=torch.float64)
    g = -torch.rand(b, h, n, dtype=torch.float64)
    beta = torch.rand(b, h, n, dtype=torch.float64)
    lens = [150, 70, 1]
    for i, m in enumerate(lens):  # right padding: no decay, no update
        g[i, :, m:], beta[i, :, m:] = 0, 0
    start = torch.randn(b, h, dk, dv, dtype=torch.float64)
    out, final = chunked_rule(q, k, v, g, beta, start.clone(), chunk=64)
    state = start.clone()
    for t in range(n):
        o, state = recurrent_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
        for i, m in enumerate(lens):
            if t < m:
                torch.testing.assert_close(out[i, :, t], o[i], rtol=1e-9, atol=1e-9)
            if t == m - 1:
                torch.testing.assert_close(final[i], state[i], rtol=1e-9, atol=1e-9)


def _native_case(kind: str):
    """One recurrent CPU kernel's case: (call(per-token inputs, states, slots, keep[, lens]), its
    per-token float32 inputs for 3 requests padded to 40 tokens, a slot's state shape, step(i, t,
    state): request i's token t by the layer's torch step in float64). Head and state sizes fill no
    vector; q/k heads (delta rule) and b/c groups (Mamba-2) serve two heads each; Mamba-1's channels
    run past one work item's block."""
    from service.models import gated_delta, mamba1, mamba2

    gen = torch.Generator().manual_seed(0)
    m, n = 3, 40
    if kind == "delta_rule":
        hk, hv, dk, dv = 2, 4, 16, 24
        q = gated_delta.l2_normalise(torch.randn(m, n, hk, dk, generator=gen)) * dk**-0.5
        k = gated_delta.l2_normalise(torch.randn(m, n, hk, dk, generator=gen))
        v = torch.randn(m, n, hv, dv, generator=gen)
        g, beta = -torch.rand(m, n, hv, generator=gen), torch.rand(m, n, hv, generator=gen)
        inputs = [q, k, v, g, beta]

        def rule_step(i, t, state):
            qt, kt = (x[i : i + 1, t].double().repeat_interleave(hv // hk, dim=1) for x in (q, k))
            return gated_delta.recurrent_step(
                qt, kt, *(x[i : i + 1, t].double() for x in (v, g, beta)), state
            )

        return (lambda xs, *rest: cpu_kernels.gated_delta_rule(*xs, *rest)), inputs, (hv, dk, dv), rule_step
    if kind == "mamba2":
        h, groups, p, d = 4, 2, 6, 20
        shape, per, module = (h, p), h // groups, mamba2
        a = -torch.rand(h, generator=gen) - 0.1
        call = lambda xs, *rest: cpu_kernels.ssm_scan(xs[0], xs[1], a, xs[2], xs[3], *rest)  # noqa: E731
        bc_shape = (groups, d)
    else:  # mamba1: a decay per channel and state
        d, k = cpu_kernels.SSM1_BLOCK + 13, 12
        shape, per, module = (d,), 1, mamba1
        a = -torch.rand(d, k, generator=gen) - 0.1
        call = lambda xs, *rest: cpu_kernels.ssm1_scan(xs[0], xs[1], a, xs[2], xs[3], *rest)  # noqa: E731
        bc_shape = (k,)
    x, dt = torch.randn(m, n, *shape, generator=gen), torch.rand(m, n, shape[0], generator=gen)
    b, c = (torch.randn(m, n, *bc_shape, generator=gen) for _ in range(2))

    def scan_step(i, t, state):
        xt, dtt = (y[i : i + 1, t].double() for y in (x, dt))
        bt, ct = (y[i : i + 1, t].double() for y in (b, c))
        if per > 1:
            bt, ct = (y.repeat_interleave(per, dim=1) for y in (bt, ct))
        return module.ssm_step(xt, dtt, a.double(), bt, ct, state)

    return call, [x, dt, b, c], (*shape, bc_shape[-1]), scan_step


NATIVE_KINDS = ["delta_rule", "mamba2", "mamba1"]
needs_cc = pytest.mark.skipif(
    not cpu_kernels.available(), reason="needs cc (the native kernels are built with it)"
)


@needs_cc
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_native_recurrent_kernels_equal_their_step_forms(kind):
    """Each CPU kernel (token by token, in place on the slots' states) against the layer's torch
    step in float64: padded requests of several lengths in scattered slots, one starting from
    zeros; the other slots are left alone."""
    call, inputs, state_shape, step = _native_case(kind)
    lens, keep, slots = torch.tensor([40, 17, 1]), torch.tensor([True, False, True]), torch.tensor([5, 0, 3])
    states = torch.randn(7, *state_shape, generator=torch.Generator().manual_seed(1))
    before = states.clone()
    out = call(inputs, states, slots, keep, lens)
    assert out is not None
    untouched = [i for i in range(7) if i not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])
    for i in range(3):
        state = before[slots[i]].double().unsqueeze(0) * keep[i]
        for t in range(int(lens[i])):
            want, state = step(i, t, state)
            torch.testing.assert_close(out[i, t].double(), want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slots[i]].double(), state[0], rtol=1e-5, atol=1e-5)


@needs_cc
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_native_recurrent_kernels_give_a_request_the_same_bits_in_any_chunk_and_any_batch(kind):
    """A prompt whole, cut in two chunks, or run token by token as decode steps, alone or beside
    other requests: the same output bits and the same final state (the overlap and normal loops,
    chunk sizes and neighbours never change a request's tokens)."""
    call, inputs, state_shape, _ = _native_case(kind)
    n = inputs[0].shape[1]
    zero = torch.zeros(3, *state_shape)

    def alone(states, slot, lo, hi, continues):  # request 0's tokens lo..hi-1
        return call([x[:1, lo:hi] for x in inputs], states, torch.tensor([slot]), torch.tensor([continues]))

    whole_states = zero.clone()
    whole = alone(whole_states, 0, 0, n, False)
    cut_states = zero.clone()
    cut = torch.cat([alone(cut_states, 1, 0, 13, False), alone(cut_states, 1, 13, n, True)], dim=1)
    step_states = zero.clone()
    steps = torch.cat([alone(step_states, 2, t, t + 1, t > 0) for t in range(n)], dim=1)
    batch_states = zero.clone()
    slots, fresh, lens = torch.tensor([2, 0, 1]), torch.tensor([False] * 3), torch.tensor([n, 9, 21])
    batch = call(inputs, batch_states, slots, fresh, lens)
    alike = ((cut, cut_states, 1), (steps, step_states, 2), (batch[:1], batch_states, 2))
    for other, other_states, slot in alike:
        assert torch.equal(other, whole)
        assert torch.equal(other_states[slot], whole_states[0])


@pytest.mark.parametrize("hybrid_case", ["qwen3_5", "granite4_h", "jamba"], indirect=True)
def test_the_torch_forms_serve_where_the_native_kernels_do_not(hybrid_case, monkeypatch):
    """Without the CPU kernels (a GPU, no C compiler) the delta rule and the Mamba-2 and Mamba-1
    scans run their torch forms, chunked and step by step, and still give transformers' tokens and logprobs, in
    both loops."""
    monkeypatch.setattr(cpu_kernels, "gated_delta_rule", lambda *args, **kwargs: None)
    monkeypatch.setattr(cpu_kernels, "ssm_scan", lambda *args, **kwargs: None)
    monkeypatch.setattr(cpu_kernels, "ssm1_scan", lambda *args, **kwargs: None)
    model_dir, refs = hybrid_case
    _check(_run(model_dir, loop="normal")[0], refs)
    _check(_run(model_dir, loop="overlap", chunked_prefill_size=7, enable_mixed_chunk=True)[0], refs)


def test_the_chunked_scan_equals_the_step_by_step_scan():
    """Mamba-2's chunked form against its step: padded rows, a starting state, several chunks, heads
    sharing B and C by group (repeated), as test_the_chunked_rule_equals_the_step_by_step_rule."""
    from service.models.mamba2 import chunked_scan, ssm_step

    torch.manual_seed(0)
    m, n, h, p, k = 3, 150, 4, 6, 5
    x = torch.randn(m, n, h, p, dtype=torch.float64)
    dt = torch.rand(m, n, h, dtype=torch.float64)
    a = -torch.rand(h, dtype=torch.float64) - 0.1
    b, c = (torch.randn(m, n, 2, k, dtype=torch.float64).repeat_interleave(2, dim=2) for _ in range(2))
    lens = [150, 70, 1]
    for i, ln in enumerate(lens):  # right padding: dt 0, no decay, no update
        dt[i, ln:] = 0
    start = torch.randn(m, h, p, k, dtype=torch.float64)
    out, final = chunked_scan(x, dt, a, b, c, start.clone(), chunk=64)
    state = start.clone()
    for t in range(n):
        y, state = ssm_step(x[:, t], dt[:, t], a, b[:, t], c[:, t], state)
        for i, ln in enumerate(lens):
            if t < ln:
                torch.testing.assert_close(out[i, t], y[i], rtol=1e-9, atol=1e-9)
            if t == ln - 1:
                torch.testing.assert_close(final[i], state[i], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("hybrid_case", ["qwen3_next"], indirect=True)
def test_served_over_grpc_both_contracts(hybrid_case):
    """The server on a hybrid model: the SMG worker contract's Generate and zerogap.v1's give
    transformers' tokens, and the KV event stream (cache-aware routing's) tells what the cache took."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc

    from service.server import BackgroundServer
    from tests.helpers import wait_until
    from tests.server.test_kv_events import Subscriber
    from zerogap.v1 import generation_pb2 as pb2
    from zerogap.v1 import generation_pb2_grpc as pb2_grpc

    model_dir, refs = hybrid_case
    prompt, want = PROMPTS[3], refs[3][0][:8]
    srv = BackgroundServer(ServerArgs(model=str(model_dir), port=0, dtype="float32", kv_cache_tokens=2048))
    try:
        with grpc.insecure_channel(srv.address) as ch:
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            req = vpb.GenerateRequest(
                request_id="h1",
                tokenized=vpb.TokenizedInput(input_ids=prompt),
                sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            )
            got = [
                t for r in vllm.Generate(req, timeout=60) for t in r.chunk.token_ids or r.complete.output_ids
            ]
            assert got[:8] == want
            out = pb2_grpc.GenerationStub(ch).Generate(
                pb2.GenerateRequest(
                    token_ids=pb2.TokenIds(ids=prompt),
                    sampling=pb2.SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True),
                ),
                timeout=60,
            )
            assert list(out.token_ids) == want
            events = Subscriber(vllm)
            try:
                assert wait_until(
                    lambda: tuple(prompt[:16]) in {p[:16] for p in events.replay.prefixes()}, 30
                )
                assert events.error is None
            finally:
                events.stop()
    finally:
        srv.stop()
