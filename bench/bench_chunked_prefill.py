"""Chunked prefill benchmark: a long prompt arrives while streams decode.

    .venv/bin/python bench/bench_chunked_prefill.py [--streams 16] [--long 2000] [--sizes 256] [--loop overlap]

For each configuration — chunking off, chunked (`--chunked-prefill-size N`), chunked
+ mixed (`--enable-mixed-chunk`) — in the same run and process: `--streams` requests
start decoding; once each has `--warm-tokens` tokens a `--long`-token prompt arrives.
Printed per configuration:

- ITL p50 / p99 / max of the running streams while the newcomer prefills (from its
  arrival to its first token; gaps that end in that window), and over the whole run;
- the newcomer's TTFT;
- total throughput (all output tokens / wall time from the first submit to the last
  finish) and its ratio to chunking off.

Tokens are timed as the scheduler emits them (in-process, no gRPC), so the figures
are the engine's. The default model is SmolLM2-135M; `--loop overlap` is explicit
because the CPU default is the normal loop.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from service.config import ServerArgs
from service.core.request import RequestOutput, SamplingParams
from service.engine.engine import Engine
from service.model_prep import resolve_model_path


@dataclass
class Recorder:
    """Output sink: when each request's tokens came out (scheduler thread)."""

    times: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    cv: threading.Condition = field(default_factory=threading.Condition)

    def __call__(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        with self.cv:
            for o in outputs:
                if o.token_ids:
                    self.times.setdefault(o.rid, []).append((now, len(o.token_ids)))
                if o.finish_reason is not None:
                    self.done.add(o.rid)
            self.cv.notify_all()

    def wait(self, pred, timeout: float = 600.0) -> None:
        with self.cv:
            if not self.cv.wait_for(pred, timeout):
                raise TimeoutError("benchmark request did not finish")


@dataclass
class Result:
    name: str
    itl_window: list[float]
    itl_all: list[float]
    ttft: float
    tokens: int
    wall: float
    counters: dict


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_config(name: str, model_dir: Path, a: argparse.Namespace, **server_args) -> Result:
    rng = random.Random(0)
    rec = Recorder()
    args = ServerArgs(
        dtype=a.dtype,
        loop=a.loop,
        max_running_requests=a.streams + 2,
        kv_cache_tokens=(a.streams + 1) * (a.long + a.max_new_tokens + 64),
        **server_args,
    )
    engine = Engine(args, model_dir, rec)
    try:

        def submit(rid: str, n: int, max_new: int) -> None:
            prompt = [rng.randrange(3, 49000) for _ in range(n)]
            engine.submit(
                engine.build_request(
                    rid, prompt, SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
                )
            )

        submit("warmup", a.long, 2)  # kernels, allocator and the long-prompt path, before timing
        rec.wait(lambda: "warmup" in rec.done)
        streams = [f"s{i}" for i in range(a.streams)]
        start = time.perf_counter()
        for rid in streams:
            submit(rid, rng.randrange(16, 48), a.max_new_tokens)

        def warm() -> bool:
            return all(sum(n for _, n in rec.times.get(r, [])) >= a.warm_tokens for r in streams)

        rec.wait(warm)
        arrival = time.perf_counter()
        submit("long", a.long, a.long_new_tokens)
        rec.wait(lambda: "long" in rec.times)
        first = rec.times["long"][0][0]
        rec.wait(lambda: all(r in rec.done for r in streams + ["long"]))
        wall = time.perf_counter() - start
        itl_window, itl_all = [], []
        for r in streams:
            ts = [t for t, _ in rec.times[r]]
            for t0, t1 in zip(ts, ts[1:]):
                itl_all.append(t1 - t0)
                if arrival < t1 <= first or (t0 < first <= t1):
                    itl_window.append(t1 - t0)
        tokens = sum(n for r in streams + ["long"] for _, n in rec.times[r])
        counters = next(r.counters for r in engine.features.matrix() if r.feature == "chunked_prefill")
        return Result(name, itl_window, itl_all, first - arrival, tokens, wall, counters)
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--loop", choices=["overlap", "normal"], default="overlap")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--long", type=int, default=2000, help="tokens of the arriving prompt")
    p.add_argument("--max-new-tokens", type=int, default=160, help="per decoding stream")
    p.add_argument("--long-new-tokens", type=int, default=32)
    p.add_argument(
        "--warm-tokens", type=int, default=16, help="tokens each stream has before the long prompt arrives"
    )
    p.add_argument("--sizes", default="256", help="comma list of --chunked-prefill-size values to run")
    a = p.parse_args()
    model_dir = resolve_model_path(a.model)
    configs: list[tuple[str, dict]] = [("off", dict(chunked_prefill_size=0, enable_mixed_chunk=False))]
    for size in (int(s) for s in a.sizes.split(",")):
        configs.append((f"chunked {size}", dict(chunked_prefill_size=size, enable_mixed_chunk=False)))
        configs.append((f"chunked {size} + mixed", dict(chunked_prefill_size=size, enable_mixed_chunk=True)))
    print(
        f"model={model_dir.name} dtype={a.dtype} loop={a.loop} streams={a.streams} long={a.long} "
        f"max_new={a.max_new_tokens} load={os.getloadavg()[0]:.2f}"
    )
    results = [run_config(name, model_dir, a, **kw) for name, kw in configs]
    base = results[0]
    print(
        f"{'config':<22} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'ITL max ms':>10} {'p99 all ms':>10} "
        f"{'TTFT s':>7} {'tok/s':>7} {'x off':>6} {'p99 gain':>8}  counters"
    )
    for r in results:
        print(
            f"{r.name:<22} {1e3 * statistics.median(r.itl_window or [float('nan')]):>10.1f} "
            f"{1e3 * pct(r.itl_window, 0.99):>10.1f} {1e3 * max(r.itl_window or [float('nan')]):>10.1f} "
            f"{1e3 * pct(r.itl_all, 0.99):>10.1f} {r.ttft:>7.2f} {r.tokens / r.wall:>7.1f} "
            f"{(r.tokens / r.wall) / (base.tokens / base.wall):>6.2f} "
            f"{pct(base.itl_window, 0.99) / pct(r.itl_window, 0.99):>8.2f}  {r.counters}"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
