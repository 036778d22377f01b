"""Feature-module benchmarks, in-process, each comparing configurations in one run.

    .venv/bin/python bench/bench_features.py fallback [--fraction 0.1]   # per-batch vs global fallback
    .venv/bin/python bench/bench_features.py logprobs                    # top-5 logprobs on every request vs none

fallback: a fraction of requests (default 10%) carry the test-only "none"
feature (its batches cannot overlap); runs `--overlap-policy per-batch` (only
batches carrying it fall back), `global` (the feature turns overlap off for
everyone, as SGLang does at startup) and, for reference, no feature at all.

logprobs: the same workload without logprobs and with top-5 logprobs (and
output logprobs) on every request, both under the overlap loop; prints the
throughput ratio and the forward-busy fraction of each.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from features.testing import fake_features
from service.config import ServerArgs
from service.engine.engine import SyncClient, collect
from service.engine.request import SamplingParams
from service.model_prep import resolve_model_path


@dataclass
class Measured:
    tokens_per_s: float
    busy: float
    mode: str
    counters: dict


def make_workload(n: int, max_new: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(16, 48))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True) for _ in range(n)]
    return prompts, params


def measure(model_dir, args, prompts, params, feats, **server_args) -> Measured:
    client = SyncClient(
        ServerArgs(max_running_requests=len(prompts), kv_cache_tokens=len(prompts) * (args.max_new_tokens + 64),
                   dtype=args.dtype, **server_args),
        model_dir,
        features=fake_features(),
    )
    try:
        client.generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up
        start = time.perf_counter()
        outs = client.generate(prompts, params, feats)
        elapsed = time.perf_counter() - start
        tokens = sum(len(collect(o)[0]) for o in outs)
        counters = {r.feature: (r.batches_overlapped, r.batches_fallback, r.batches_normal_loop)
                    for r in client.engine.features.matrix()}
        return Measured(tokens / elapsed, client.engine.stats().forward_busy_fraction, client.engine.mode, counters)
    finally:
        client.close()


def report(name: str, m: Measured, feature: str) -> None:
    o, f, n = m.counters.get(feature, (0, 0, 0))
    print(f"{name:>14}: {m.tokens_per_s:7.1f} tok/s  busy={m.busy:.3f}  loop={m.mode:<8} "
          f"{feature} batches overlapped={o} fallback={f} normal-loop={n}", flush=True)


def bench_fallback(model_dir, args) -> None:
    prompts, params = make_workload(args.num_requests, args.max_new_tokens)
    users = set(random.Random(1).sample(range(len(prompts)), max(1, round(len(prompts) * args.fraction))))
    feats = [{"test_none": i} if i in users else None for i in range(len(prompts))]
    print(f"workload: {len(prompts)} requests x {args.max_new_tokens} tokens, {len(users)} carry test_none")
    per_batch = measure(model_dir, args, prompts, params, feats, overlap_policy="per-batch")
    report("per-batch", per_batch, "test_none")
    glob = measure(model_dir, args, prompts, params, feats, overlap_policy="global")
    report("global", glob, "test_none")
    none = measure(model_dir, args, prompts, params, [None] * len(prompts))
    report("no feature", none, "test_none")
    print(f"per-batch / global throughput: {per_batch.tokens_per_s / glob.tokens_per_s:.3f}x")
    print(f"per-batch / no-feature throughput: {per_batch.tokens_per_s / none.tokens_per_s:.3f}x")


def bench_logprobs(model_dir, args) -> None:
    prompts, params = make_workload(args.num_requests, args.max_new_tokens)
    print(f"workload: {len(prompts)} requests x {args.max_new_tokens} tokens, overlap loop")
    plain = measure(model_dir, args, prompts, params, [None] * len(prompts))
    report("no logprobs", plain, "logprobs")
    top5 = [{"logprobs": dict(return_logprob=True, top_logprobs_num=5)}] * len(prompts)
    with_lp = measure(model_dir, args, prompts, params, top5)
    report("top-5 logprobs", with_lp, "logprobs")
    print(f"top-5 logprobs / none throughput: {with_lp.tokens_per_s / plain.tokens_per_s:.3f}x "
          f"(forward busy {with_lp.busy:.3f} vs {plain.busy:.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["fallback", "logprobs"])
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    model_dir = resolve_model_path(args.model)
    {"fallback": bench_fallback, "logprobs": bench_logprobs}[args.scenario](model_dir, args)


if __name__ == "__main__":
    main()
