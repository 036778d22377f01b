"""Optimistic admission with retraction vs reserve admission, on the same KV pool.

    .venv/bin/python bench/bench_retraction.py [--n 48] [--max-new-tokens 256] [--kv-tokens 4096]
    .venv/bin/python bench/bench_retraction.py --n 32 --median-len 160 --kv-tokens 2048 --low-ratio 0.05 --only low-normal,low-overlap

Every request declares the same long `max_new_tokens` (what the scheduler sees),
while its actual length is drawn from a long-tailed distribution (log-normal,
median `--median-len`, capped at max_new_tokens). The request stops there the way
EOS would stop it: a bench-only feature module sets `feature_stop` once the
request has that many tokens, so admission never knows the length in advance and
sampling is untouched. All requests arrive at once (a burst that oversubscribes
the pool). Reported per configuration: requests/s (n / makespan), completion
tokens/s, p50 and p99 latency (arrival to last token), retractions, most
requests running at once, the final new-token ratio. Configurations:
reserve; optimistic with the default ratio (0.7 decaying to 0.1); optimistic
starting at `--low-ratio` (0.2: retraction pressure) in the normal and the
overlap loop.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from service.config import ServerArgs
from service.core.feature import Feature, OverlapSupport
from service.core.request import RequestOutput, SamplingParams
from service.engine.engine import SyncClient, collect
from service.model_prep import resolve_model_path


class StopAtLength(Feature):
    """Bench only: stops a request after the number of tokens in its payload (like an EOS would)."""

    name = "bench_stop_at"
    support = OverlapSupport.FULL
    reads_raw_logits = False
    reason = "bench only: sets feature_stop on the host"

    def on_result(self, batch: Any, row: int, req: Any, extras: Any) -> None:
        if len(req.output_ids) >= req.features[self.name]:
            req.feature_stop = True
        return None


class TimedClient(SyncClient):
    """Records when each request's last output arrived."""

    def __init__(self, *a, **k):
        self.done_at: dict[str, float] = {}
        super().__init__(*a, **k)

    def _sink(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for o in outputs:
            if o.finish_reason is not None:
                self.done_at[o.rid] = now
        super()._sink(outputs)


def make_workload(n: int, max_new: int, median: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(16, 64))] for _ in range(n)]
    lengths = [max(1, min(max_new, round(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(n)]
    return prompts, lengths


def run(model_dir: Path, args, prompts, lengths, **server_args) -> dict[str, Any]:
    client = TimedClient(
        ServerArgs(
            **{
                "max_running_requests": len(prompts),
                "kv_cache_tokens": args.kv_tokens,
                "dtype": args.dtype,
                **server_args,
            }
        ),
        model_dir,
        features=[StopAtLength()],
    )
    try:
        client.generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up
        e = client.engine
        reqs = [
            e.build_request(
                f"b-{i}",
                p,
                SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True),
                {"bench_stop_at": n},
            )
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        start = time.perf_counter()
        e.submit_all(reqs)
        outs = [client.wait(r.rid, timeout=3600) for r in reqs]
        lat = sorted(client.done_at[r.rid] - start for r in reqs)
        makespan = lat[-1]
        tokens = sum(len(collect(o)[0]) for o in outs)
        assert [len(collect(o)[0]) for o in outs] == lengths, "a request did not stop at its length"
        st = e.scheduler.admission.stats
        return dict(
            req_s=len(reqs) / makespan,
            tok_s=tokens / makespan,
            p50=lat[len(lat) // 2],
            p99=lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)],
            retractions=st.retractions,
            sync_points=st.sync_points,
            peak=st.peak_running,
            reprefill=st.reprefill_tokens,
            ratio=e.stats().new_token_ratio,
            busy=e.stats().forward_busy_fraction,
        )
    finally:
        client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--median-len", type=int, default=40)
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument(
        "--low-ratio",
        type=float,
        default=0.2,
        help="initial new-token ratio of the configurations that run under retraction pressure",
    )
    p.add_argument(
        "--only",
        default="reserve,optimistic,low-normal,low-overlap",
        help="configurations to run (comma list of reserve, optimistic, low-normal, low-overlap)",
    )
    args = p.parse_args()
    model_dir = resolve_model_path(args.model)
    prompts, lengths = make_workload(args.n, args.max_new_tokens, args.median_len)
    s = sorted(lengths)
    print(
        f"{args.n} requests, prompts 16-63 tokens, max_new_tokens {args.max_new_tokens}, actual lengths: "
        f"median {s[len(s) // 2]}, p90 {s[int(0.9 * len(s))]}, max {s[-1]}, total {sum(s)}; KV pool {args.kv_tokens} tokens"
    )
    low = dict(init_new_token_ratio=args.low_ratio, min_new_token_ratio=min(0.1, args.low_ratio))
    configs = [
        ("reserve", "reserve, normal", dict(admission_policy="reserve", loop="normal")),
        ("optimistic", "optimistic, normal", dict(admission_policy="optimistic", loop="normal")),
        (
            "low-normal",
            f"optimistic {args.low_ratio:g}, normal",
            dict(admission_policy="optimistic", loop="normal", **low),
        ),
        (
            "low-overlap",
            f"optimistic {args.low_ratio:g}, overlap",
            dict(admission_policy="optimistic", loop="overlap", **low),
        ),
    ]
    configs = [c for c in configs if c[0] in args.only.split(",")]
    print(
        f"{'admission, loop':26} {'req/s':>6} {'tok/s':>7} {'p50 s':>6} {'p99 s':>6} {'retract':>7} {'syncs':>5} "
        f"{'peak':>4} {'re-prefill':>10} {'ratio':>5} {'busy':>5}"
    )
    results = {}
    for key, name, cfg in configs:
        r = results[key] = run(model_dir, args, prompts, lengths, **cfg)
        print(
            f"{name:26} {r['req_s']:6.2f} {r['tok_s']:7.1f} {r['p50']:6.1f} {r['p99']:6.1f} {r['retractions']:7d} "
            f"{r['sync_points']:5d} {r['peak']:4d} {r['reprefill']:10d} {r['ratio']:5.2f} {r['busy']:5.2f}",
            flush=True,
        )
    for a, b, what in (
        ("optimistic", "reserve", "optimistic / reserve"),
        ("low-normal", "reserve", f"optimistic {args.low_ratio:g} / reserve"),
        ("low-overlap", "low-normal", f"overlap / normal at ratio {args.low_ratio:g}"),
    ):
        if a in results and b in results:
            x, y = results[a], results[b]
            print(f"{what}: {x['req_s'] / y['req_s']:.2f}x req/s, p99 latency {x['p99'] / y['p99']:.2f}x")


if __name__ == "__main__":
    main()
