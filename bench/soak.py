"""Soak: N concurrent streams of mixed features for a given time, with random cancels.

Starts a server process (`python -m service serve`), then keeps `--concurrency`
GenerateStream calls in flight for `--duration-s`: chat / text / token-id
inputs, greedy and seeded sampling, stop strings, logprobs, JSON-schema /
regex / JSON-object constraints, random client cancels and short deadlines.
Reports errors (any status not caused by our own cancel or deadline), the KV
pool and live requests once idle after the run, the server's RSS over time
(server process and its grammar workers) and the p99 drift of time to first
token and of per-token latency (last window / first window). Writes a PNG
(matplotlib: `pip install -e '.[bench]'`) and a JSON summary.

    python bench/soak.py --duration-s 600 --out-dir soak-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerogap.v1 import generation_pb2 as pb2  # noqa: E402
from zerogap.v1 import generation_pb2_grpc as pb2_grpc  # noqa: E402

PROMPTS = [
    "Tell me a short story about a fox.",
    "List three colours.",
    "What is 17 times 3?",
    "Write a haiku about rain.",
    "Describe a cat in one sentence.",
    "Name two planets.",
]
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    }
)
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8}"]


@dataclass
class Sample:
    t: float  # seconds since start
    ttft: float | None
    per_token: float | None  # (end - first token) / (tokens - 1)
    tokens: int


@dataclass
class Totals:
    requests: int = 0
    ok: int = 0
    cancelled_by_us: int = 0
    deadline_by_us: int = 0
    errors: Counter = field(default_factory=Counter)  # "CODE: details" -> count


def make_request(rng: random.Random, i: int) -> tuple[pb2.GenerateRequest, str]:
    """A random mix of features; returns (request, label)."""
    n = rng.choice([8, 16, 32, 48])
    sp = pb2.SamplingParams(max_new_tokens=n, temperature=0.0)
    if rng.random() < 0.5:
        sp.temperature, sp.top_p, sp.seed = 0.8, 0.95, rng.randrange(1 << 32)
    if rng.random() < 0.2:
        sp.stop.append(rng.choice([".", "\n", " the"]))
    req = pb2.GenerateRequest(request_id=f"soak-{i}", sampling=sp)
    kind = rng.random()
    if kind < 0.5:
        req.chat.messages.append(pb2.ChatMessage(role="user", content=rng.choice(PROMPTS)))
    elif kind < 0.8:
        req.text = rng.choice(PROMPTS)
    else:
        req.token_ids.ids.extend(rng.randrange(100, 40000) for _ in range(rng.randrange(4, 64)))
    label = "plain"
    f = rng.random()
    if f < 0.2:
        req.return_logprob, req.top_logprobs_num, label = True, rng.choice([0, 5]), "logprobs"
    elif f < 0.3:
        req.constraint.json_schema, label = SCHEMA, "json_schema"
    elif f < 0.35:
        req.constraint.json_object, label = True, "json_object"
    elif f < 0.45:
        req.constraint.regex, label = rng.choice(REGEXES), "regex"
    return req, label


async def one(
    stub, rng: random.Random, i: int, t0: float, totals: Totals, samples: list[Sample], cancel_p: float
) -> None:
    req, _ = make_request(rng, i)
    totals.requests += 1
    plan = rng.random()
    cancel_after = rng.randrange(1, 6) if plan < cancel_p else None  # messages, then cancel
    timeout = rng.uniform(0.05, 0.5) if cancel_p <= plan < cancel_p + 0.03 else None
    start = time.perf_counter()
    first = None
    tokens = msgs = 0
    call = stub.GenerateStream(req, timeout=timeout)
    try:
        async for msg in call:
            msgs += 1
            tokens += len(msg.token_ids)
            if first is None and msg.token_ids:
                first = time.perf_counter()
            if cancel_after is not None and msgs >= cancel_after:
                call.cancel()
                totals.cancelled_by_us += 1
                return
        end = time.perf_counter()
        totals.ok += 1
        per_token = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
        samples.append(Sample(start - t0, (first - start) if first else None, per_token, tokens))
    except asyncio.CancelledError:
        totals.cancelled_by_us += 1
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            totals.cancelled_by_us += 1
        elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
            totals.deadline_by_us += 1
        else:
            totals.errors[f"{e.code().name}: {e.details()[:120]}"] += 1


async def drive(address: str, args, t0: float, totals: Totals, samples: list[Sample]) -> None:
    rng = random.Random(args.seed)
    counter = iter(range(1 << 62))
    deadline = t0 + args.duration_s
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb2_grpc.GenerationStub(ch)

        async def worker(w: int) -> None:
            wrng = random.Random(rng.randrange(1 << 32) + w)
            while time.perf_counter() < deadline:
                await one(stub, wrng, next(counter), t0, totals, samples, args.cancel_p)

        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))


def rss_mb(pid: int) -> tuple[float, float]:
    """(server RSS, its children's RSS) in MB, from /proc."""

    def one_rss(p: int) -> float:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    kids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.add(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    grand = set()
    for d in Path("/proc").iterdir():  # grammar workers are children of the forkserver
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) in kids:
                    grand.add(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return one_rss(pid), sum(one_rss(p) for p in kids | grand)


def p99(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def windows(samples: list[Sample], width: float, duration: float) -> list[dict]:
    out = []
    t = 0.0
    while t < duration:
        w = [s for s in samples if t <= s.t < t + width]
        out.append(
            {
                "t": t + width / 2,
                "n": len(w),
                "ttft_p99": p99([s.ttft for s in w]),
                "per_token_p99": p99([s.per_token for s in w]),
            }
        )
        t += width
    return out


def warm(full: list[dict]) -> dict | None:
    """The drift's base window: the second one when there are three or more, else the first."""
    return full[1] if len(full) >= 3 else full[0] if len(full) == 2 else None


def plot(path: Path, rss: list[tuple[float, float, float]], wins: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    a.plot([r[0] for r in rss], [r[1] for r in rss], label="server")
    a.plot([r[0] for r in rss], [r[2] for r in rss], label="grammar workers + forkserver")
    a.set_ylabel("RSS (MB)")
    a.legend()
    a.set_title(title)
    b.plot([w["t"] for w in wins], [w["ttft_p99"] for w in wins], marker="o", label="TTFT p99")
    b.plot(
        [w["t"] for w in wins], [w["per_token_p99"] * 10 for w in wins], marker="s", label="per-token p99 x10"
    )
    b.set_ylabel("seconds")
    b.set_xlabel("time (s)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=41790)
    ap.add_argument("--duration-s", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel-p", type=float, default=0.1, help="share of streams the client cancels mid-way")
    ap.add_argument("--window-s", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="soak-out")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `serve` option (repeatable)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    cmd = [
        sys.executable,
        "-m",
        "service",
        "serve",
        "--port",
        str(args.port),
        "--max-running-requests",
        str(args.concurrency),
        *(["--model", args.model] if args.model else []),
        *args.server_arg,
    ]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_lines: list[str] = []
    try:
        while True:
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("server exited:\n" + "".join(log_lines[-30:]))
            log_lines.append(line)
            if "listening" in line:
                break
        import threading

        threading.Thread(target=lambda: log_lines.extend(server.stdout), daemon=True).start()
        address = f"127.0.0.1:{args.port}"
        rss: list[tuple[float, float, float]] = []
        totals, samples = Totals(), []
        t0 = time.perf_counter()
        stop = threading.Event()

        def sample_rss() -> None:
            while not stop.is_set():
                rss.append((time.perf_counter() - t0, *rss_mb(server.pid)))
                stop.wait(2.0)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        asyncio.run(drive(address, args, t0, totals, samples))
        run_s = time.perf_counter() - t0
        # Idle: every request ended, KV back to full.
        with grpc.insecure_channel(address) as ch:
            stub = pb2_grpc.GenerationStub(ch)
            deadline = time.monotonic() + 60
            while True:
                info = stub.GetServerInfo(pb2.GetServerInfoRequest())
                idle = (
                    info.running_requests == 0
                    and info.queued_requests == 0
                    and info.kv_pool_free_tokens == info.kv_pool_total_tokens
                )
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        stop.set()
        sampler.join()
        wins = windows(samples, args.window_s, args.duration_s)
        full = [w for w in wins if w["n"]]
        summary = {
            "duration_s": round(run_s, 1),
            "concurrency": args.concurrency,
            "requests": totals.requests,
            "completed": totals.ok,
            "cancelled_by_client": totals.cancelled_by_us,
            "deadline_by_client": totals.deadline_by_us,
            "errors": dict(totals.errors),
            "output_tokens": sum(s.tokens for s in samples),
            "after": {
                "kv_free": info.kv_pool_free_tokens,
                "kv_total": info.kv_pool_total_tokens,
                "running": info.running_requests,
                "queued": info.queued_requests,
            },
            "rss_mb": {
                "server_first": round(rss[0][1]),
                "server_max": round(max(r[1] for r in rss)),
                "server_last": round(rss[-1][1]),
                "workers_max": round(max(r[2] for r in rss)),
            },
            "windows": full,
            # last window over the first one after the warm-up window (all streams start at once there)
            "p99_drift": {
                "ttft": full[-1]["ttft_p99"] / base["ttft_p99"],
                "per_token": full[-1]["per_token_p99"] / base["per_token_p99"],
            }
            if (base := warm(full))
            else None,
        }
        (out / "soak.json").write_text(json.dumps(summary, indent=2, default=str))
        print(json.dumps({k: v for k, v in summary.items() if k != "windows"}, indent=2, default=str))
        for w in full:
            print(
                f"  t={w['t']:6.0f}s  n={w['n']:4d}  TTFT p99 {w['ttft_p99']:.2f}s  per-token p99 {w['per_token_p99'] * 1000:.0f} ms"
            )
        try:
            plot(out / "soak.png", rss, wins, f"soak: {args.concurrency} streams, {run_s / 60:.0f} min")
            print(f"plot: {out / 'soak.png'}")
        except ImportError:
            print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return 1 if totals.errors or info.kv_pool_free_tokens != info.kv_pool_total_tokens else 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        (out / "server.log").write_text("".join(log_lines))


if __name__ == "__main__":
    sys.exit(main())
