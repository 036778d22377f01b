"""Decode attention on CPU: the paged kernel over a whole model's KV pools, one step at a time.

Decode rows (one query row per request) over their requests' keys, through every layer's own pool,
as a served step reads them: with SmolLM2's 30 layers a request of 1,000 tokens holds 46 MB of K
and V, so the pools outgrow the caches and the kernel streams its rows from memory (the one-layer
figures of `bench_extend_attention.py` stay in cache). A request's rows are consecutive in the pool
(a prompt's rows, allocated at once) or scattered (`--scattered`: a busy pool's). Prints the median
time of a step (all layers) and the K/V bytes read per second. Nothing here asserts a duration.

    .venv/bin/python bench/bench_paged_attention.py [--dtype bfloat16] [--threads 1] [--rows 1,3,8]
        [--keys 1000] [--layers 30] [--heads 9,3,64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.models import cpu_kernels  # noqa: E402
from service.models.cpu_features import cpu_features  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,3,8", help="decode rows per step (one per request)")
    ap.add_argument("--keys", type=int, default=1000, help="keys per request")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head_dim (SmolLM2: 9,3,64)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    rows = [int(x) for x in args.rows.split(",")]
    pool = max(rows) * args.keys + 1
    gen = torch.Generator().manual_seed(0)
    ks = [torch.randn(pool, hkv, d, generator=gen).to(dtype) for _ in range(args.layers)]
    vs = [torch.randn(pool, hkv, d, generator=gen).to(dtype) for _ in range(args.layers)]
    print(
        f"CPU: {cpu_features().describe()}; {args.dtype}; heads {hq}/{hkv} x {d}; {args.layers} layers; "
        f"{args.threads} threads"
    )
    print(f"{'rows':>4} {'keys':>6} {'layout':>10} {'ms a step':>10} {'GB/s':>6}")
    for n in rows:
        for scattered in (False, True):
            perm = torch.randperm(pool - 1, generator=gen) + 1 if scattered else torch.arange(1, pool)
            table = perm[: n * args.keys].view(n, args.keys)
            kernel = cpu_kernels.PagedAttention(
                table, torch.arange(n), torch.full((n,), args.keys - 1), None, team=args.threads
            )
            q = torch.randn(n, hq, d, generator=gen).to(dtype)
            times = []
            for _ in range(args.repeats + 2):
                t0 = time.perf_counter()
                for k, v in zip(ks, vs):
                    kernel(q, k, v, d**-0.5)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times[2:])
            gb = n * args.keys * hkv * d * 2 * ks[0].element_size() * args.layers / s / 1e9
            layout = "scattered" if scattered else "in a run"
            print(f"{n:>4} {args.keys:>6} {layout:>10} {s * 1e3:>10.2f} {gb:>6.1f}")


if __name__ == "__main__":
    main()
