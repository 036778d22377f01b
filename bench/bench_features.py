"""Feature-module benchmarks, in-process, each comparing configurations in one run.

    .venv/bin/python bench/bench_features.py fallback [--fraction 0.1]   # per-batch vs global fallback
    .venv/bin/python bench/bench_features.py logprobs                    # top-5 logprobs on every request vs none
    .venv/bin/python bench/bench_features.py constrained                 # JSON-schema constrained vs unconstrained

fallback: a fraction of requests (default 10%) carry the test-only "none"
feature (its batches cannot overlap); runs `--overlap-policy per-batch` (only
batches carrying it fall back), `global` (the feature turns overlap off for
everyone, as SGLang does at startup) and, for reference, no feature at all.

logprobs: the same workload without logprobs and with top-5 logprobs (and
output logprobs) on every request, both under the overlap loop; prints the
throughput ratio and the forward-busy fraction of each.

constrained: every request constrained by a JSON schema whose outputs all have
the same length (fixed-size integer array: max_new_tokens tokens with EOS), vs
the same requests unconstrained for as many tokens; one engine, the two
alternating `--repeats` times (ABBA order), under the overlap loop (`--loop` to
change it); prints the median ratio of the pairs, the process CPU time per
token of each, the mask fill time per row, grammar
compile time cold vs cached and the per-request schema costs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from features.testing import fake_features
from service.config import ServerArgs
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
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


def measure(model_dir, args, prompts, params, feats, on_client=None, **server_args) -> Measured:
    """The median of `--repeats` runs (tok/s), so that one noisy run does not decide a ratio."""
    runs = [
        measure_once(model_dir, args, prompts, params, feats, on_client, **server_args)
        for _ in range(args.repeats)
    ]
    runs.sort(key=lambda m: m.tokens_per_s)
    return runs[len(runs) // 2]


def measure_once(model_dir, args, prompts, params, feats, on_client=None, **server_args) -> Measured:
    client = SyncClient(
        ServerArgs(
            **{
                "max_running_requests": len(prompts),
                "kv_cache_tokens": len(prompts) * (args.max_new_tokens + 64),
                "dtype": args.dtype,
                "loop": args.loop,
                **server_args,
            }
        ),
        model_dir,
        features=fake_features(),
    )
    try:
        client.generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up
        start = time.perf_counter()
        outs = client.generate(prompts, params, feats)
        elapsed = time.perf_counter() - start
        tokens = sum(len(collect(o)[0]) for o in outs)
        counters = {
            r.feature: (r.batches_overlapped, r.batches_fallback, r.batches_normal_loop)
            for r in client.engine.features.matrix()
        }
        if on_client is not None:
            on_client(client, outs)
        return Measured(
            tokens / elapsed, client.engine.stats().forward_busy_fraction, client.engine.mode, counters
        )
    finally:
        client.close()


def report(name: str, m: Measured, feature: str) -> None:
    o, f, n = m.counters.get(feature, (0, 0, 0))
    print(
        f"{name:>14}: {m.tokens_per_s:7.1f} tok/s  busy={m.busy:.3f}  loop={m.mode:<8} "
        f"{feature} batches overlapped={o} fallback={f} normal-loop={n}",
        flush=True,
    )


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
    print(
        f"top-5 logprobs / none throughput: {with_lp.tokens_per_s / plain.tokens_per_s:.3f}x "
        f"(forward busy {with_lp.busy:.3f} vs {plain.busy:.3f})"
    )


# A realistic schema for the compile-time figure (nested objects, arrays, enums, patterns, $ref).
ORDER_SCHEMA = {
    "$defs": {"money": {"type": "number", "minimum": 0, "maximum": 100000}},
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 60},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"$ref": "#/$defs/money"},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "total": {"$ref": "#/$defs/money"},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "customer", "lines", "total"],
}


def bench_constrained(model_dir, args) -> None:
    import json

    n_items = max(1, (args.max_new_tokens - 2) // 2)  # "[d,d,...,d]": 2 tokens per item + brackets
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "minItems": n_items,
        "maxItems": n_items,
    }
    prompts, _ = make_workload(args.num_requests, args.max_new_tokens)
    lengths: list[int] = []
    stats: dict = {}

    def grab(client, outs):
        feature = client.engine.features.features["constrained"]
        stats["fill"] = feature.mask_fill_stats_us()
        backend = feature.backend
        text = json.dumps(ORDER_SCHEMA)
        t = time.perf_counter()
        backend.compile("json_schema", text).result()
        stats["cold"] = time.perf_counter() - t
        t = time.perf_counter()
        backend.compile("json_schema", text).result()
        stats["cached"] = time.perf_counter() - t
        # Per-request schema work: preparation (metaschema check, normalisation, capability walk,
        # validator) once per distinct schema, then the output check at finish on every request.
        from features.constrained import ConstraintSpec, prepare

        checks = sorted(feature.check_us)
        stats["check"] = (statistics.median(checks), checks[int(0.99 * (len(checks) - 1))])
        for name, schema_text in (
            (("order", text), ("travis (SchemaStore, 32 KB)", travis_schema()))
            if "prepare" not in stats
            else ()
        ):
            t = time.perf_counter()
            prepare(ConstraintSpec("json_schema", schema_text), "lenient")
            stats.setdefault("prepare", []).append((name, time.perf_counter() - t))

    constrained = [{"constrained": dict(kind="json_schema", text=json.dumps(schema))}] * len(prompts)
    greedy = [SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens) for _ in prompts]
    plain_params = [
        SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True) for _ in prompts
    ]
    # One engine; the two configurations alternate (C U, U C, C U, ...) so that a shared machine's
    # load drifts into both alike; the grammar compiles in the untimed warm-up (a cached schema).
    client = SyncClient(
        ServerArgs(
            max_running_requests=len(prompts),
            kv_cache_tokens=len(prompts) * (args.max_new_tokens + 64),
            dtype=args.dtype,
            loop=args.loop,
        ),
        model_dir,
        features=fake_features(),
    )
    try:
        client.generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=4))
        client.generate(prompts[:2], greedy[:2], constrained[:2])
        runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
        cpu: dict[str, list[float]] = {"constrained": [], "unconstrained": []}  # process CPU s per 1k tokens
        configs = [
            ("constrained", greedy, constrained),
            ("unconstrained", plain_params, [None] * len(prompts)),
        ]
        for i in range(args.repeats):
            for name, params, feats in configs if i % 2 == 0 else configs[::-1]:  # ABBA: no side always first
                start, start_cpu = time.perf_counter(), time.process_time()
                outs = client.generate(prompts, params, feats)
                elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
                if name == "constrained":
                    lengths.extend(len(collect(o)[0]) for o in outs)
                tokens = sum(len(collect(o)[0]) for o in outs)
                runs[name].append(tokens / elapsed)
                cpu[name].append(used / tokens * 1e3)
        grab(client, [])
        mode = client.engine.mode
    finally:
        client.close()
    n = round(sum(lengths) / len(lengths))
    print(
        f"workload: {len(prompts)} requests; constrained outputs average {n} tokens (incl. EOS), unconstrained "
        f"{args.max_new_tokens}; loop={mode}; {args.repeats} alternating runs each, load average {os.getloadavg()[0]:.1f}"
    )
    for name, xs in runs.items():
        print(
            f"{name:>14}: median {statistics.median(xs):7.1f} tok/s, {statistics.median(cpu[name]):.2f} CPU s per 1k tokens"
            f" (all threads); runs " + " ".join(f"{x:.1f}" for x in xs)
        )
    ratios = [c / u for c, u in zip(runs["constrained"], runs["unconstrained"])]
    print(
        f"constrained / unconstrained throughput: {statistics.median(ratios):.3f}x (median of pairs; pairs "
        + " ".join(f"{r:.3f}" for r in ratios)
        + ")"
    )
    print(
        f"mask fill per row (one call per batch): median {stats['fill'][0]:.1f} us, p99 {stats['fill'][1]:.1f} us"
    )
    print(f"grammar compile: cold {stats['cold'] * 1e3:.1f} ms, cached {stats['cached'] * 1e3:.3f} ms")
    print(
        f"output check at finish (decode + jsonschema): median {stats['check'][0]:.0f} us, p99 {stats['check'][1]:.0f} us per request"
    )
    for name, secs in stats["prepare"]:
        print(f"schema preparation (uncached, once per distinct schema): {name} {secs * 1e3:.1f} ms")


def travis_schema() -> str:
    import check_jsonschema

    return (Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "travis.json").read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["fallback", "logprobs", "constrained"])
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median is reported")
    p.add_argument(
        "--loop",
        default="overlap",
        choices=["overlap", "normal", "auto"],
        help="the scheduler loop of every configuration (auto: normal on CPU, overlap on CUDA)",
    )
    args = p.parse_args()
    model_dir = resolve_model_path(args.model)
    {"fallback": bench_fallback, "logprobs": bench_logprobs, "constrained": bench_constrained}[args.scenario](
        model_dir, args
    )


if __name__ == "__main__":
    main()
