"""Prefix-cache benchmark: the same chat workloads with the cache on and off, in one run.

    .venv/bin/python bench/bench_prefix_cache.py [--model DIR] [--dtype auto] [--loop auto]

multi-turn: 8 conversations x 6 turns, each conversation sending its next turn (the whole
history: a shared system prompt, the earlier user turns and the model's answers, plus a new user
message) when the previous answer arrived; conversations run concurrently.
shared-system: 64 chat requests with the same system prompt and different questions, arriving
every `--gap-ms` (default 20 ms).

Per workload and configuration: TTFT p50/p99 (submit to first token, in-process engine, no
gRPC), requests/s over the whole workload, and the cache's hit rate. Prints the load average,
since on a shared machine the figures move with other work.
"""

from __future__ import annotations

import argparse
import os
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

SYSTEM = (
    "You are a helpful, precise assistant for a software company. Answer the user's questions about "
    "programming, databases, networking and operating systems. Keep answers short and concrete, give "
    "one example when it helps, never invent APIs, and say so when you do not know. Use plain text."
)
QUESTIONS = [
    "What is a mutex?",
    "How does TCP slow start work?",
    "Explain a B-tree index.",
    "What is a race condition?",
    "Why use connection pooling?",
    "What does fsync do?",
    "How do hash maps resize?",
    "What is a deadlock?",
    "Explain copy-on-write.",
    "What is an inode?",
    "How does DNS caching work?",
    "What is a memory barrier?",
    "Explain MVCC.",
    "What is a page fault?",
    "How does a CPU cache line work?",
    "What is backpressure?",
]


@dataclass
class Timings:
    submitted: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    done: dict[str, threading.Event] = field(default_factory=dict)
    ids: dict[str, list[int]] = field(default_factory=dict)


class Harness:
    """An engine whose sink records each request's first-token time and output ids."""

    def __init__(self, args: ServerArgs, model_dir: str):
        self.t = Timings()
        self.lock = threading.Lock()
        self.engine = Engine(args, model_dir, self._sink)

    def _sink(self, outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        with self.lock:
            for o in outs:
                if o.token_ids and o.rid not in self.t.first:
                    self.t.first[o.rid] = now
                self.t.ids.setdefault(o.rid, []).extend(o.token_ids)
                if o.finish_reason is not None:
                    self.engine.on_finished(o.rid)
                    self.t.done[o.rid].set()

    def submit(self, rid: str, prompt: list[int], max_new: int) -> threading.Event:
        ev = threading.Event()
        with self.lock:
            self.t.done[rid] = ev
            self.t.submitted[rid] = time.perf_counter()
        params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
        self.engine.submit(self.engine.build_request(rid, prompt, params))
        return ev

    def ttfts(self) -> list[float]:
        return [self.t.first[r] - self.t.submitted[r] for r in self.t.submitted]

    def close(self) -> None:
        self.engine.shutdown()


def multi_turn(h: Harness, convs: int, turns: int, max_new: int) -> None:
    tok = h.engine.tokenizer

    def conversation(c: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[(c * turns + t) % len(QUESTIONS)]})
            prompt = tok.encode_chat(messages, True)[1]
            rid = f"mt-{c}-{t}"
            h.submit(rid, prompt, max_new).wait(600)
            messages.append({"role": "assistant", "content": tok.decode(h.t.ids[rid], True)})

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(convs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def shared_system(h: Harness, n: int, max_new: int, gap_s: float) -> None:
    tok = h.engine.tokenizer
    events = []
    for i in range(n):
        q = f"{QUESTIONS[i % len(QUESTIONS)]} (question {i})"
        prompt = tok.encode_chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], True
        )[1]
        events.append(h.submit(f"ss-{i}", prompt, max_new))
        time.sleep(gap_s)
    for ev in events:
        ev.wait(600)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(workload: str, cache: bool, model_dir: str, a: argparse.Namespace) -> dict:
    args = ServerArgs(
        dtype=a.dtype,
        loop=a.loop,
        disable_prefix_cache=not cache,
        kv_cache_tokens=a.kv_tokens,
        max_running_requests=64,
        state_snapshots=a.state_snapshots,
    )
    h = Harness(args, model_dir)
    try:
        h.submit("warmup", [5, 6, 7, 8], 2).wait(120)
        h.engine.flush_prefix_cache()
        h.t = Timings()
        start = time.perf_counter()
        if workload == "multi-turn":
            multi_turn(h, a.convs, a.turns, a.max_new)
        else:
            shared_system(h, a.requests, a.max_new, a.gap_ms / 1000)
        wall = time.perf_counter() - start
        info = h.engine.stats().prefix_cache
        ttft = h.ttfts()
        return {
            "p50": pct(ttft, 0.5),
            "p99": pct(ttft, 0.99),
            "rps": len(ttft) / wall,
            "hit": info.hit_rate,
            "ids": dict(h.t.ids),
            "mode": h.engine.mode,
            "dtype": str(h.engine.dtype).removeprefix("torch."),
        }
    finally:
        h.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--loop", default="auto")
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument(
        "--state-snapshots", type=int, default=None, help="models with recurrent layers (default: auto)"
    )
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--gap-ms", type=float, default=20.0)
    p.add_argument("--workloads", default="multi-turn,shared-system")
    a = p.parse_args()
    model_dir = str(resolve_model_path(a.model))
    print(f"load average before: {os.getloadavg()}")
    for workload in a.workloads.split(","):
        res = {cache: run(workload, cache, model_dir, a) for cache in (False, True)}
        off, on = res[False], res[True]
        same = sum(off["ids"][r] == on["ids"].get(r) for r in off["ids"]) / max(len(off["ids"]), 1)
        print(f"\n{workload} ({off['mode']} loop, {off['dtype']}):")
        print(f"  {'cache':6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'req/s':>8} {'hit rate':>9}")
        for name, r in (("off", off), ("on", on)):
            print(f"  {name:6} {r['p50'] * 1e3:12.1f} {r['p99'] * 1e3:12.1f} {r['rps']:8.2f} {r['hit']:9.2f}")
        print(
            f"  on/off: TTFT p50 {off['p50'] / on['p50']:.2f}x better, p99 {off['p99'] / on['p99']:.2f}x, "
            f"req/s {on['rps'] / off['rps']:.2f}x; identical outputs: {same:.0%}"
        )
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
