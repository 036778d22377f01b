"""What an attention kind costs end to end: random-init models of one hidden size and head count
(`random_checkpoint.py`: Llama's attention, BLOOM's ALiBi through `eager_attention.py`, latent
attention expanded per head), served in process, the same prompts through each in one run.

    flock /tmp/zg-heavy.lock .venv/bin/python bench/bench_attention_kinds.py --layers 24

Recurrent layers too (`--kinds qwen3.5-0.8b,granite4-h-1536,mamba-790m`); `--torch-recurrent` runs
them in their torch forms instead of the CPU kernels (`csrc/recurrent.c`), for a before/after.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

KINDS = ("llama-1024", "bloom-560m", "youtu-1024")


def run(model_dir: Path, dtype: str, requests: int, prompt: int, new: int) -> tuple[float, float]:
    """(seconds for `requests` at once, seconds for one), after a warm-up request."""
    import torch

    from service.config import ServerArgs
    from service.core.request import SamplingParams
    from service.engine.engine import SyncClient

    client = SyncClient(ServerArgs(dtype=dtype, kv_cache_tokens=16384, disable_prefix_cache=True), model_dir)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, 40000, (prompt,), generator=g).tolist() for _ in range(requests)]
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        client.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        t = time.perf_counter()
        client.generate(prompts, params)
        many = time.perf_counter() - t
        t = time.perf_counter()
        client.generate(prompts[:1], params)
        return many, time.perf_counter() - t
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    from random_checkpoint import make

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--new", type=int, default=32)
    p.add_argument(
        "--torch-recurrent",
        action="store_true",
        help="recurrent layers in their torch forms (as on a GPU), not the CPU kernels: the before side",
    )
    args = p.parse_args(argv)
    if args.torch_recurrent:
        from service.models import cpu_kernels

        for name in ("gated_delta_rule", "ssm_scan", "ssm1_scan"):
            setattr(cpu_kernels, name, lambda *a, **k: None)
    print(f"| model | {args.requests} x ({args.prompt} + {args.new}) | out tok/s | one request |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            model_dir = make(kind, args.layers, Path(tmp) / kind)
            many, one = run(model_dir, args.dtype, args.requests, args.prompt, args.new)
            rate = args.requests * args.new / many
            print(f"| {kind} | {many:.2f} s | {rate:.1f} | {one:.2f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
