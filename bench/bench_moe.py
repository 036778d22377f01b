"""A small mixture-of-experts model on CPU: serving vs transformers, and what a MoE step costs.

1. serving: a random-init Qwen3-MoE of ~0.5B parameters in total (8 layers, hidden 1024, 32
   experts of 512, top-4: ~0.1B active per token; SmolLM2's tokenizer and vocabulary) through
   gRPC at 1 and 32 concurrent streams, against transformers `generate` on the same prompts
   (`bench_serving.py` does both; greedy, ignore_eos, exactly --max-new-tokens each).
2. profile: one MoE block's decode step (32 tokens) with the router forced onto n distinct
   experts, n = 4 .. 32, for 32 and 128 experts in total, in the torch form (float32, bf16) and
   the native bf16 kernel (CPUs with AVX-512 BF16): the step's cost follows the experts the
   tokens chose, not how many the model has (and the dense reference that computes all experts,
   for scale).

    .venv/bin/python bench/bench_moe.py [--parts serving,profile]
        [--num-prompts 32] [--max-new-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SMALL_MOE = dict(  # ~0.47B total, ~0.12B active (embeddings tied)
    vocab_size=49152,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.02,
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def make_small_moe(out: Path) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from service.model_prep import prepare_default_model

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL_MOE)).to(torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    smol = prepare_default_model()
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    print(f"[bench_moe] {total / 1e9:.2f}B parameters in {out}", file=sys.stderr, flush=True)
    return out


def serving(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    import bench_serving

    rows = []
    for concurrency, prompts in ((1, max(2, args.num_prompts // 8)), (32, args.num_prompts)):
        out = Path(tempfile.mkdtemp()) / "serving.json"
        argv = ["--model", str(model_dir), "--concurrency", str(concurrency), "--num-prompts", str(prompts)]
        argv += ["--max-new-tokens", str(args.max_new_tokens), "--configs", args.configs, "--json", str(out)]
        bench_serving.main(argv)
        rows.append(dict(concurrency=concurrency, **json.loads(out.read_text())))
    return rows


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile(args: argparse.Namespace) -> list[dict]:
    """One MoE block (30B-A3B-like experts at hidden 1024: I = 512, top-4) on a 32-token decode step:
    the torch form in float32 and bf16, and the native bf16 kernel where this CPU has it."""
    import torch

    from service.models import cpu_kernels
    from service.models.moe import experts_dense_reference, experts_torch

    torch.manual_seed(0)
    hidden, inter, tokens, top_k = 1024, 512, 32, 4
    x = torch.randn(tokens, hidden)
    kernel = cpu_kernels.has_moe_kernel(x.bfloat16())
    rows = []
    for total in (32, 128):
        w_gate_up = torch.randn(total, 2 * inter, hidden) * 0.02
        w_down = torch.randn(total, hidden, inter) * 0.02
        bf = (x.bfloat16(), w_gate_up.bfloat16(), w_down.bfloat16())
        for active in (top_k, 8, 16, 32):
            # token t's k experts: k consecutive ones of the first `active`, so exactly `active` are used
            ids = (torch.arange(tokens).view(-1, 1) * top_k + torch.arange(top_k)) % active
            weights = torch.full((tokens, top_k), 1.0 / top_k)
            row = dict(total_experts=total, active_experts=active)
            row["torch_f32_ms"] = _median_ms(
                lambda: experts_torch(x, w_gate_up, w_down, weights, ids), args.repeat
            )
            row["torch_bf16_ms"] = _median_ms(lambda: experts_torch(*bf, weights, ids), args.repeat)
            if kernel:
                row["kernel_bf16_ms"] = _median_ms(
                    lambda: cpu_kernels.moe_experts(*bf, weights, ids), args.repeat
                )
            rows.append(row)
            print(
                f"  {total:>3} experts, {active:>3} active: "
                + ", ".join(f"{k[:-3]} {v:7.2f} ms" for k, v in row.items() if k.endswith("_ms")),
                flush=True,
            )
        dense = _median_ms(lambda: experts_dense_reference(x, w_gate_up, w_down, weights, ids), 3)
        rows.append(dict(total_experts=total, active_experts=total, dense_reference_ms=dense))
        print(f"  {total:>3} experts, dense reference (all experts, f32): {dense:7.2f} ms", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="serving,profile")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--configs", default="normal", help="zerogap loops to serve with (bench_serving --configs)"
    )
    p.add_argument("--repeat", type=int, default=20, help="profile: timed repeats per point")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    results: dict = {}
    if "profile" in parts:
        print("profile: one MoE block, 32-token decode step, by experts used", flush=True)
        results["profile"] = profile(args)
    if "serving" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            results["serving"] = serving(make_small_moe(Path(tmp) / "small-moe"), args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
