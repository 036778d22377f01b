"""Greedy output equals transformers' generate(do_sample=False), token for token."""

from __future__ import annotations

import pytest

from service.config import ServerArgs
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from tests.conftest import hf_greedy

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
    "Translate to French: I like apples.",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
]
N_NEW = 24


# Session-scoped: pytest groups the tests by `smol_client`'s loop (a session fixture), interleaving
# this module with others that use it; a module fixture was torn down in between and recomputed.
@pytest.fixture(scope="session")
def prompts_and_refs(hf_smol, hf_tokenizer):
    prompts = [hf_tokenizer.encode(p) for p in PLAIN_PROMPTS]
    prompts += [
        hf_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in CHAT_PROMPTS
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]
    return prompts, [hf_greedy(hf_smol, p, N_NEW) for p in prompts]


def _check(outputs, refs):
    for outs, ref in zip(outputs, refs):
        ids, _, last = collect(outs)
        # Our request may stop at EOS where generate() pads afterwards.
        assert ids == ref[: len(ids)], f"got {ids}\nref {ref}"
        assert len(ids) == N_NEW or ids[-1] == 2


def test_smollm2_greedy_alone_matches_transformers(smol_client, prompts_and_refs):
    prompts, refs = prompts_and_refs
    greedy = SamplingParams(temperature=0, max_new_tokens=N_NEW)
    for p, ref in zip(prompts, refs):
        _check(smol_client.generate([p], greedy), [ref])


def test_smollm2_greedy_concurrent_matches_transformers(smol_client, prompts_and_refs):
    prompts, refs = prompts_and_refs
    outs = smol_client.generate(prompts, SamplingParams(temperature=0, max_new_tokens=N_NEW))
    _check(outs, refs)
    assert smol_client.engine.kv_all_free()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("mode", ["normal", "overlap"])
def test_tiny_models_greedy_match_transformers(kind, mode, request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[5 + i * 7 + j for j in range(3 + 5 * i)] for i in range(6)]
    refs = [hf_greedy(hf, p, 16) for p in prompts]
    client = SyncClient(
        ServerArgs(dtype="float32", loop=mode, kv_cache_tokens=2048, max_running_requests=8), model_dir
    )
    try:
        outs = client.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
        assert [collect(o)[0] for o in outs] == refs
    finally:
        client.close()
