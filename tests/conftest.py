"""Shared fixtures: the default model, tiny random models, servers, HF references."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The Python client is its own distribution (clients/python). Where this checkout's copy is not the
# installed one (a shared venv), the tests and the servers they start import it from the tree.
CLIENT_SRC = str(Path(__file__).resolve().parent.parent / "clients" / "python")
if CLIENT_SRC not in sys.path:
    sys.path.insert(0, CLIENT_SRC)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (CLIENT_SRC, os.environ.get("PYTHONPATH")) if p)

import torch

# Triton reads this when first imported: without a GPU its kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil

import pytest

from service.config import ServerArgs
from service.engine.engine import SyncClient
from service.model_prep import prepare_default_model
from tests.helpers import NEEDS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    return prepare_default_model()


def make_tiny_model(smol: Path, out: Path, kind: str, vocab_size: int = 49152) -> Path:
    """A small random-init Llama or Qwen2 with SmolLM2's tokenizer (vocab 49152)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
        model = LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = MistralConfig(**common, tie_word_embeddings=False, sliding_window=8)
        model = MistralForCausalLM(cfg)
    else:
        cfg = Qwen2Config(
            **common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the qkv biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(smol_dir, tmp_path_factory) -> Path:
    return make_tiny_model(smol_dir, tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(smol_dir, tmp_path_factory) -> Path:
    return make_tiny_model(smol_dir, tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(smol_dir, tmp_path_factory) -> Path:
    return make_tiny_model(smol_dir, tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session")
def hf_smol(smol_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session", params=["normal", "overlap"])
def smol_client(request, smol_dir):
    """An in-process engine on SmolLM2 fp32, for each scheduler loop."""
    client = SyncClient(
        ServerArgs(dtype="float32", loop=request.param, kv_cache_tokens=16384, max_running_requests=32),
        smol_dir,
    )
    yield client
    client.close()


TINY_LLAVA_IMAGE_TOKEN = 49152  # "<image>", added to SmolLM2's tokenizer


def make_tiny_llava(
    smol: Path,
    out: Path,
    feature_layer=-2,
    strategy: str = "default",
    act: str = "gelu",
    projector_bias: bool = True,
    tie: bool = False,
) -> Path:
    """A small random-init LLaVA: CLIP vision tower (32x32 images, 8x8 patches: 16 image tokens,
    17 with strategy "full"), projector, Llama language model; SmolLM2's tokenizer plus "<image>",
    a CLIPImageProcessorPil config (resize shortest edge to 32, centre crop 32x32)."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=TINY_LLAVA_IMAGE_TOKEN + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=tie,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=TINY_LLAVA_IMAGE_TOKEN,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act=act,
        multimodal_projector_bias=projector_bias,
        tie_word_embeddings=tie,
        image_seq_length=16 + (strategy == "full"),
    )
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # random weights large enough that the image changes the output
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == TINY_LLAVA_IMAGE_TOKEN
    tok.save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        out
    )
    return out


@pytest.fixture(scope="session")
def tiny_llava_dir(smol_dir, tmp_path_factory) -> Path:
    return make_tiny_llava(smol_dir, tmp_path_factory.mktemp("tiny-llava"))


# ---- the forward's CPU team keeps its size in tests -------------------------------------------------


@pytest.fixture(autouse=True)
def fixed_cpu_team(request, monkeypatch):
    """Engines built in a test keep their OpenMP team's size: the adaptive team's choice depends on how
    loaded the machine is, and bf16 results (not fp32's) on the team size, so tests comparing two runs
    would see the machine's load. Tests of the adaptation itself are marked `adaptive_team`."""
    if request.node.get_closest_marker("adaptive_team") is None:
        from service.engine import engine as engine_module

        monkeypatch.setattr(engine_module, "AdaptiveTeam", lambda threads: None)


# ---- missing tools: one line per group on a plain machine, a failure under CI ---------------------

_MISSING: dict[str, int] = {}  # skip reason -> tests skipped for it (this run's, printed at its end)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    reason = _skip_reason(report) if report.skipped else ""
    if reason.startswith(NEEDS):
        if os.environ.get("CI"):  # CI installs every tool (.ci/run): a missing one fails the run
            report.outcome, report.longrepr = (
                "failed",
                f"{reason} (under CI nothing is skipped for a missing tool)",
            )
        else:
            _MISSING[reason] = _MISSING.get(reason, 0) + 1
    return report


def pytest_terminal_summary(terminalreporter):
    if _MISSING:
        terminalreporter.section("skipped for a missing tool: install it to run them (.ci/run does)")
        for reason, n in sorted(_MISSING.items()):
            terminalreporter.line(f"{n:4d} test{'s' if n > 1 else ' '} skipped: {reason}")
