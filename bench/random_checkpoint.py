"""A random-init checkpoint of a dense family at a real model's layer shapes (fewer layers), with
SmolLM2's tokenizer and vocabulary, for benchmarks (`bench_serving.py --model DIR`).

    .venv/bin/python bench/random_checkpoint.py qwen3-0.6b --layers 8 --out /tmp/qwen3-8l
    flock /tmp/zg-heavy.lock .venv/bin/python bench/bench_serving.py --model /tmp/qwen3-8l \\
        --concurrency 32 --num-prompts 32 --max-new-tokens 64 --configs normal
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMON = dict(vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
SHAPES = {  # name: (transformers config class, the real model's layer shapes)
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
             head_dim=128, tie_word_embeddings=True),
    ),
    "gemma2-2b": (
        "Gemma2Config",
        dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
             head_dim=256, query_pre_attn_scalar=256, sliding_window=4096),
    ),
    "gemma3-1b": (
        "Gemma3TextConfig",
        dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1,
             head_dim=256, query_pre_attn_scalar=256, sliding_window=512),
    ),
    "phi4-mini": (
        "Phi3Config",
        dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
             partial_rotary_factor=0.75, tie_word_embeddings=True),
    ),
    # the same hidden size and heads three ways: plain attention, ALiBi, latent attention
    "llama-1024": (
        "LlamaConfig",
        dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=16),
    ),
    "bloom-560m": ("BloomConfig", dict(hidden_size=1024, num_attention_heads=16)),
    "qwen3.5-0.8b": (  # Gated DeltaNet in three layers of four, gated attention in the fourth
        "Qwen3_5TextConfig",
        dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
             head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
             linear_value_head_dim=128, tie_word_embeddings=True),
    ),
    "granite4-h-1536": (  # Granite 4.0-H's layer kinds: Mamba-2 (48 heads of 64, d_state 128), NoPE
        "GraniteMoeHybridConfig",  # attention in one layer of eight, a shared MLP, no routed experts
        dict(hidden_size=1536, intermediate_size=4096, shared_intermediate_size=4096, num_local_experts=0,
             num_attention_heads=12, num_key_value_heads=4, position_embedding_type="nope",
             mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_expand=2,
             mamba_d_conv=4, layer_pattern=("mamba",) * 7 + ("attention",), tie_word_embeddings=True),
    ),
    "mamba-790m": (  # Mamba (the first): a selective scan per channel and state
        "MambaConfig",
        dict(hidden_size=1536, state_size=16, expand=2, conv_kernel=4, time_step_rank=96,
             tie_word_embeddings=True),
    ),
    "youtu-1024": (  # DeepSeek-V3's latent attention (V2-Lite's head dims) on dense layers
        "YoutuConfig",
        dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=16,
             q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128),
    ),
}  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def make(name: str, layers: int, out: Path) -> Path:
    import torch
    import transformers

    from service.model_prep import prepare_default_model

    cls, shape = SHAPES[name]
    shape = dict(shape)
    if pattern := shape.pop("layer_pattern", None):  # a hybrid's layer kinds, repeated over `layers`
        shape["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    cfg = getattr(transformers, cls)(**COMMON, **shape, num_hidden_layers=layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    smol = prepare_default_model()
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    total = sum(p.numel() for p in model.parameters())
    print(f"{name}, {layers} layers: {total / 1e9:.2f}B parameters in {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    print(make(args.shape, args.layers, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
