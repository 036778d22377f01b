"""A conversation's next turn on a busy one-core replica: how long until its first token.

One server pinned to one CPU (a replica of issue 25's routing bench), `--neighbours` streams that
each send a fresh `--history`-token prompt and decode `--neighbour-tokens` tokens, again and again
(so a long prefill is under way now and then), and meanwhile `--turns` turns of one conversation:
its history (cached: sent once before) plus `--new` new tokens, one at a time with a pause of
0.5-1.5 s between them. Token ids in, greedy, EOS ignored; seeded, so two runs send the same ids.

Reported: the turns' TTFT (client side, to the first streamed token) sorted, p50, p90 and max, and
how many waited more than twice the p50 (a turn queued behind a neighbour's long prefill instead of
overtaking it). `--breakdown` also runs the server with a trace and splits each turn's TTFT along
the forward thread's spans (its clock origin lines them up with the client's perf_counter): what
was left of the step in flight when the turn was sent, the wait from then to the start of the
turn's own step, that step (its rows and tokens), and the delivery from its end to the client.
`--root DIR` runs the server of another checkout (a worktree of an older commit) for a
before/after on the same machine. Nothing here asserts a duration.

    flock /tmp/zg-heavy.lock .venv/bin/python bench/bench_cached_turn.py [--cpu 0] [--neighbours 3]
        [--history 1000] [--new 22] [--turns 16] [--root DIR] [--server-args '...'] [--breakdown]
        [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "clients" / "python"))

import grpc
from bench_serving import ServerProcess, free_port, pct
from forward_trace import PARTS, breakdown

from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc


def start_server(root: Path, cpu: int | None, extra: list[str]) -> ServerProcess:
    """The server of the checkout `root`, pinned to `cpu` (taskset) unless None."""
    port = free_port()
    pin = [] if cpu is None else ["taskset", "-c", str(cpu)]
    cmd = [*pin, sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    return ServerProcess(cmd, port, cwd=root)


def generate(stub, ids: list[int], max_tokens: int) -> float:
    """Seconds to the first streamed token."""
    req = pb2.GenerateRequest(
        token_ids=pb2.TokenIds(ids=ids),
        sampling=pb2.SamplingParams(temperature=0, max_new_tokens=max_tokens, ignore_eos=True),
    )
    t0 = time.perf_counter()
    first = None
    for msg in stub.GenerateStream(req, timeout=900):
        if first is None and msg.token_ids:
            first = time.perf_counter() - t0
    assert first is not None, "no token came back"
    return first


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)

    def ids(n: int, r: random.Random = rng) -> list[int]:
        return [r.randrange(100, 40000) for _ in range(n)]

    extra = shlex.split(args.server_args)
    trace = Path(tempfile.mkdtemp()) / "trace.json" if args.breakdown else None
    if trace is not None:
        extra += ["--trace-file", str(trace)]
    server = start_server(Path(args.root), args.cpu, extra)
    sent = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb2_grpc.GenerationStub(ch)
            generate(stub, ids(50), 4)  # warm-up: lazy initialisation stays out of the figures
            generate(stub, ids(args.history), 4)
            history = ids(args.history)
            generate(stub, history, 1)  # the conversation so far: now cached
            stop = threading.Event()

            def neighbour(seed: int) -> None:
                r = random.Random(seed)
                while not stop.is_set():
                    generate(stub, ids(args.history, r), args.neighbour_tokens)

            threads = [
                threading.Thread(target=neighbour, args=(args.seed + 1 + i,)) for i in range(args.neighbours)
            ]
            for t in threads:
                t.start()
            time.sleep(args.settle_s)
            ttft = []
            for _ in range(args.turns):
                time.sleep(rng.uniform(0.5, 1.5))
                sent.append(time.perf_counter())
                ttft.append(generate(stub, history + ids(args.new), 1))
            stop.set()
            for t in threads:
                t.join()
    finally:
        server.stop()
    ms = sorted(round(x * 1000, 1) for x in ttft)
    p50 = statistics.median(ms)
    turns = breakdown(trace, [(s, s + t) for s, t in zip(sent, ttft)]) if trace is not None else None
    return dict(
        breakdown=turns,
        ttft_ms=ms,
        p50_ms=p50,
        p90_ms=pct(ms, 90),
        max_ms=ms[-1],
        over_twice_p50=sum(x > 2 * p50 for x in ms),
        root=str(args.root),
        cpu=args.cpu,
        load_avg=os.getloadavg(),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", type=int, default=0, help="pin the server to this CPU (-1: no pinning)")
    p.add_argument("--neighbours", type=int, default=3)
    p.add_argument(
        "--history", type=int, default=1000, help="tokens of the cached history and of a neighbour's prompt"
    )
    p.add_argument("--neighbour-tokens", type=int, default=200)
    p.add_argument("--new", type=int, default=22, help="new tokens of each turn")
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default=str(ROOT), help="the checkout whose server runs")
    p.add_argument("--server-args", default="")
    p.add_argument("--breakdown", action="store_true", help="split each turn's TTFT along the server's trace")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.cpu < 0:
        args.cpu = None
    out = run(args)
    print("TTFT ms, sorted:", out["ttft_ms"])
    print(
        f"p50 {out['p50_ms']:.0f} ms  p90 {out['p90_ms']:.0f} ms  max {out['max_ms']:.0f} ms  "
        f"over 2x p50: {out['over_twice_p50']} of {len(out['ttft_ms'])}"
    )
    if out["breakdown"]:
        print(
            f"{'TTFT':>7} {'in flight':>22} {'left':>6} {'wait':>6} {'own step':>22} {'ms':>7} {'delivery':>8}"
        )
        for r in out["breakdown"]:
            print(
                f"{r['ttft_ms']:>7.0f} {r['in_flight']:>22} {r['in_flight_left_ms']:>6.0f} {r['wait_ms']:>6.0f} "
                f"{r['step']:>22} {r['step_ms']:>7.0f} {r['delivery_ms']:>8.0f}"
            )
        med = {k: statistics.median(r[k] for r in out["breakdown"]) for k in PARTS}
        print("medians ms: " + ", ".join(f"{k[:-3]} {v:.0f}" for k, v in med.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
