"""Per-batch fallback vs global fallback, in one run (issue: feature framework).

A workload where a fraction of requests (default 10%) carry the test-only
"none" feature (its batches cannot overlap). Runs it in-process under
`--overlap-policy per-batch` (only those batches fall back), `global` (the
feature turns overlap off for everyone, as SGLang does at startup) and, for
reference, overlap with no feature at all; prints throughput and the ratios.

    .venv/bin/python bench/bench_features.py [--num-requests 64] [--max-new-tokens 32] [--fraction 0.1]
"""

from __future__ import annotations

import argparse
import random
import time

from features.testing import fake_features
from service.config import ServerArgs
from service.engine.engine import SyncClient, collect
from service.engine.request import SamplingParams
from service.model_prep import resolve_model_path


def workload(n: int, max_new: int, fraction: float, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(16, 48))] for _ in range(n)]
    users = set(rng.sample(range(n), max(1, round(n * fraction))))
    feats = [{"test_none": i} if i in users else None for i in range(n)]
    params = [SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True) for _ in range(n)]
    return prompts, params, feats


def run(model_dir, policy: str, with_feature: bool, args) -> tuple[float, dict]:
    prompts, params, feats = workload(args.num_requests, args.max_new_tokens, args.fraction)
    if not with_feature:
        feats = [None] * len(prompts)
    client = SyncClient(
        ServerArgs(overlap_policy=policy, max_running_requests=args.num_requests,
                   kv_cache_tokens=args.num_requests * (args.max_new_tokens + 64), dtype=args.dtype),
        model_dir,
        features=fake_features(),
    )
    try:
        client.generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up
        t = time.perf_counter()
        outs = client.generate(prompts, params, feats)
        elapsed = time.perf_counter() - t
        tokens = sum(len(collect(o)[0]) for o in outs)
        row = {r.feature: r for r in client.engine.features.matrix()}["test_none"]
        return tokens / elapsed, {"mode": client.engine.mode, "overlapped": row.batches_overlapped,
                                  "fallback": row.batches_fallback, "normal_loop": row.batches_normal_loop}
    finally:
        client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    model_dir = resolve_model_path(args.model)
    print(f"workload: {args.num_requests} requests x {args.max_new_tokens} tokens, {args.fraction:.0%} carry test_none")
    results = {}
    for name, policy, feat in (("per-batch", "per-batch", True), ("global", "global", True), ("no feature", "per-batch", False)):
        tps, info = run(model_dir, policy, feat, args)
        results[name] = tps
        print(f"{name:>11}: {tps:7.1f} tok/s  loop={info['mode']:<8} test_none batches: overlapped={info['overlapped']} "
              f"fallback={info['fallback']} normal-loop={info['normal_loop']}", flush=True)
    print(f"per-batch / global throughput: {results['per-batch'] / results['global']:.3f}x")
    print(f"per-batch / no-feature throughput: {results['per-batch'] / results['no feature']:.3f}x")


if __name__ == "__main__":
    main()
