"""One layer's extend attention on CPU: the native extend kernel against one SDPA per request.

Per case (a prompt whole, a chunk over a prefix, several prompts in one batch), both paths of
the `torch` attention backend are timed alternately in one process (so a busy machine moves
both alike): `TorchAttention(use_kernel=True)` (the extend kernel over the pool in place) and
`use_kernel=False` (gather the request's rows, repeat the kv heads, ATen's flash kernel).
Prints the median per call, the ratio and the kernel's attention FLOP rate (causal work only).

Usage:
    .venv/bin/python bench/bench_extend_attention.py [--dtype bfloat16] [--heads 9,3,64]
        [--repeats 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from service.models import cpu_kernels  # noqa: E402
from service.models.attention import TorchAttention  # noqa: E402
from service.models.cpu_features import cpu_features  # noqa: E402

# name -> [(kv length, new tokens)] per request
CASES = {
    "prompt 1x1265": [(1265, 1265)],
    "prompt 1x512": [(512, 512)],
    "chunk 256 over 1024": [(1280, 256)],
    "chunk 256 over 256": [(512, 256)],
    "4 prompts x 300": [(300, 300)] * 4,
    "turn 22 over 1000": [(1022, 22)],
}


def batch(reqs: list[tuple[int, int]], hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    pool = sum(length for length, _ in reqs) * 2 + 1
    table = torch.zeros(len(reqs), max(length for length, _ in reqs), dtype=torch.int64)
    perm = torch.randperm(pool - 1, generator=gen) + 1  # scattered rows, as a busy pool has them
    at = 0
    for r, (length, _) in enumerate(reqs):
        table[r, :length] = perm[at : at + length]
        at += length
    lens = [n for _, n in reqs]
    t = sum(lens)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat([torch.arange(length - n, length) for length, n in reqs]),
        out_cache_loc=torch.cat([table[r, length - n : length] for r, (length, n) in enumerate(reqs)]),
        kv_indices=table,
        q_positions=torch.zeros(1),
        logits_index=torch.zeros(1),
        sampling=None,  # type: ignore[arg-type]
        seq_lens=torch.tensor([length for length, _ in reqs]),
        extend_lens=lens,
        extend_prefix_lens=torch.tensor([length - n for length, n in reqs]),
        extend_prefix_lens_cpu=[length - n for length, n in reqs],
    )
    k_cache = torch.randn(pool, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(pool, hkv, d, generator=gen).to(dtype)
    return fb, k_cache, v_cache, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head_dim (SmolLM2: 9,3,64)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    gen = torch.Generator().manual_seed(0)
    print(
        f"CPU: {cpu_features().describe()}; extend kernel ISA {cpu_kernels.extend_isa()}; {args.dtype}; "
        f"heads {hq}/{hkv} x {d}; {args.threads} threads"
    )
    print(f"{'case':<22} {'kernel ms':>10} {'sdpa ms':>10} {'ratio':>7} {'kernel GFLOP/s':>15}")
    for name in args.cases.split(","):
        reqs = CASES[name]
        fb, k_cache, v_cache, t = batch(reqs, hkv, d, dtype, gen)
        q = torch.randn(t, hq, d, generator=gen).to(dtype)
        k = torch.randn(t, hkv, d, generator=gen).to(dtype)
        v = torch.randn(t, hkv, d, generator=gen).to(dtype)
        paths = {  # as the server builds it: the team and dtype pick which kernel takes a short extend
            name: TorchAttention(use_kernel=use, team=args.threads, dtype=dtype)
            for name, use in (("kernel", True), ("sdpa", False))
        }
        metas = {p: b.prepare(fb, hq, hkv, None) for p, b in paths.items()}
        times: dict[str, list[float]] = {p: [] for p in paths}
        outs = {}
        for i in range(args.repeats + 2):
            for p, b in paths.items():
                t0 = time.perf_counter()
                outs[p] = b.forward(q, k, v, k_cache, v_cache, metas[p], d**-0.5)
                if i >= 2:  # warm-up
                    times[p].append(time.perf_counter() - t0)
        err = (outs["kernel"].float() - outs["sdpa"].float()).abs().max().item()
        ms = {p: statistics.median(x) * 1e3 for p, x in times.items()}
        # causal work: each new row at position p attends p + 1 keys; q.k and p.v, 2 flops a MAC
        macs = sum(sum(length - n + j + 1 for j in range(n)) for length, n in reqs) * hq * d * 2
        print(
            f"{name:<22} {ms['kernel']:>10.2f} {ms['sdpa']:>10.2f} {ms['sdpa'] / ms['kernel']:>6.2f}x "
            f"{2 * macs / ms['kernel'] / 1e6:>15.1f}   (max |diff| {err:.1e})"
        )


if __name__ == "__main__":
    main()
