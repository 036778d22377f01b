"""Two zerogap replicas behind SMG (cache_aware, fed by KV events) vs behind round robin.

A multi-turn chat workload: `--conversations` conversations x `--turns` turns behind one shared
system prompt, the history growing each turn (the previous greedy answers included), run
`--concurrency` conversations at a time; each conversation's turns are sequential, as a user's are.
Arms, each on the same two replicas with their prefix caches flushed in between:

  smg-cache_aware   `smg launch --policy cache_aware` (OpenAI API, streamed)
  smg-round_robin   the same gateway, `--policy round_robin`
  nginx-rr          nginx `grpc_pass` round robin (zerogap.v1 GenerateStream with chat input)

Figures per arm: TTFT p50/p99 (to the first streamed token), requests/s over the arm's wall time,
prefix hit rate (cached prompt tokens / prompt tokens, from each response's usage) and the share
of turns 2+ that found their previous turn's whole prompt cached (only the replica that served that
turn holds all of it: about half under round robin with two replicas).

Usage (heavy: run under the shared lock):
    flock /tmp/zg-heavy.lock .venv/bin/python bench/bench_smg_routing.py [--model DIR]
        [--conversations 16] [--turns 6] [--concurrency 4] [--max-tokens 16] [--arms a,b,c] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "clients" / "python"))

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

SYSTEM = (
    "You are a careful assistant for a public library. Answer questions about books, authors, opening "
    "hours and lending rules. Keep every answer short, factual and polite; when unsure, say so and "
    "suggest asking a librarian at the front desk. Never invent titles, dates or prices."
)
NGINX_CONF = """worker_processes 1;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream replicas {{ {servers} }}
  server {{ listen 127.0.0.1:{port} http2; location / {{ grpc_pass grpc://replicas; }} }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not come up in {timeout:.0f}s")


def start_replicas(model: str, tmp: Path, extra: list[str]) -> list[tuple[subprocess.Popen, int]]:
    out = []
    for name in ("a", "b"):
        port = free_port()
        log = open(tmp / f"replica-{name}.log", "wb")
        cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
        if model:
            cmd += ["--model", model]
        out.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), port))
    for _, port in out:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb2_grpc.GenerationStub(ch)
            wait(lambda: stub.GetServerInfo(pb2.GetServerInfoRequest(), timeout=2), 300, f"replica :{port}")
    return out


def flush(ports: list[int]) -> None:
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = vllm_engine_pb2_grpc.VllmEngineStub(ch).FlushCache(common_pb2.FlushCacheRequest(timeout_s=30))
            assert r.success, r.message


def model_name(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return Path(pb2_grpc.GenerationStub(ch).GetModelInfo(pb2.GetModelInfoRequest()).model_path).name


class Stats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.prompt = self.cached = self.later = self.whole = 0
        self.errors = 0

    def add(self, ttft: float, prompt: int, cached: int, previous_prompt: int) -> None:
        self.ttft.append(ttft)
        self.prompt += prompt
        self.cached += cached
        if previous_prompt:
            self.later += 1
            self.whole += cached >= previous_prompt

    def row(self, arm: str, wall: float) -> dict:
        t = sorted(self.ttft) or [float("nan")]
        return {
            "arm": arm,
            "requests": len(t),
            "errors": self.errors,
            "ttft_p50_ms": 1000 * statistics.median(t),
            "ttft_p99_ms": 1000 * t[min(len(t) - 1, int(0.99 * len(t)))],
            "req_per_s": len(t) / wall,
            "prefix_hit_rate": self.cached / self.prompt if self.prompt else 0.0,
            "turns_with_previous_prompt_cached": self.whole / self.later if self.later else 0.0,
        }


async def run_workload(make_ask, args) -> tuple[Stats, float]:
    """`make_ask()(messages) -> (ttft, text, prompt_tokens, cached_tokens)`; conversations in parallel."""
    stats, sem, ask = Stats(), asyncio.Semaphore(args.concurrency), make_ask()

    async def conversation(c: int) -> None:
        async with sem:
            messages, previous = [{"role": "system", "content": SYSTEM}], 0
            for turn in range(args.turns):
                messages.append({"role": "user", "content": f"Reader {c}, question {turn}: what next?"})
                try:
                    ttft, text, prompt, cached = await ask(messages)
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    print(f"  conversation {c} turn {turn}: {type(e).__name__}: {e}", file=sys.stderr)
                    stats.errors += 1
                    return
                stats.add(ttft, prompt, cached, previous)
                previous = prompt
                messages.append({"role": "assistant", "content": text})

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return stats, time.perf_counter() - t0


def smg_asker(url: str, model: str, max_tokens: int):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

    async def ask(messages):
        t0 = time.perf_counter()
        ttft, parts, usage = None, [], None
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = usage.prompt_tokens_details
        return (
            ttft or time.perf_counter() - t0,
            "".join(parts),
            usage.prompt_tokens,
            details.cached_tokens or 0,
        )

    return ask


def grpc_asker(address: str, max_tokens: int):
    channel = grpc.aio.insecure_channel(address)
    stub = pb2_grpc.GenerationStub(channel)

    async def ask(messages):
        req = pb2.GenerateRequest(
            chat=pb2.ChatInput(
                messages=[pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
            ),
            sampling=pb2.SamplingParams(temperature=0, max_new_tokens=max_tokens, ignore_eos=True),
        )
        t0 = time.perf_counter()
        ttft, parts, last = None, [], None
        async for r in stub.GenerateStream(req, timeout=300):
            if r.token_ids:
                ttft = ttft or time.perf_counter() - t0
            parts.append(r.text)
            last = r
        return (
            ttft or time.perf_counter() - t0,
            "".join(parts),
            last.usage.prompt_tokens,
            last.usage.cached_tokens,
        )

    return ask


def shared_prefix_len(model_dir: str | None) -> int:
    """Tokens every conversation's first prompt shares (the system prompt and the template)."""
    from transformers import AutoTokenizer

    from service.model_prep import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(model_dir))
    ids = [
        list(
            tok.apply_chat_template(
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Reader {c}, question 0: what next?"},
                ],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )  # fmt: skip
        for c in range(2)
    ]
    n = 0
    while n < min(map(len, ids)) and ids[0][n] == ids[1][n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--arms", default="smg-cache_aware,smg-round_robin,nginx-rr")
    ap.add_argument("--server-args", default="--max-running-requests 16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    smg = Path(sys.executable).parent / "smg"
    tmp = Path(tempfile.mkdtemp(prefix="bench-smg-"))
    replicas = start_replicas(args.model, tmp, args.server_args.split())
    ports = [p for _, p in replicas]
    model = model_name(ports[0])
    shared = shared_prefix_len(args.model)
    rows, procs = [], []
    try:
        for arm in args.arms.split(","):
            flush(ports)
            if arm.startswith("smg-"):
                port = free_port()
                log = open(tmp / f"{arm}.log", "wb")
                proc = subprocess.Popen(
                    [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                     *[f"grpc://127.0.0.1:{p}" for p in ports], "--policy", arm.removeprefix("smg-"),
                     "--balance-abs-threshold", "1", "--worker-startup-check-interval", "1",
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"],
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
                procs.append(proc)
                url = f"http://127.0.0.1:{port}"

                def ready(url: str = url) -> bool:  # both workers registered, the tokenizer loaded
                    import urllib.request

                    with urllib.request.urlopen(f"{url}/workers", timeout=2) as r:
                        workers = json.loads(r.read())
                    if len(workers.get("workers", workers)) < 2:
                        return False
                    hello = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                    req = urllib.request.Request(
                        f"{url}/v1/chat/completions",
                        json.dumps(hello).encode(),
                        {"Content-Type": "application/json"},
                    )
                    with urllib.request.urlopen(req, timeout=30) as r:
                        return r.status == 200

                wait(ready, 60, arm)
                make_ask = lambda url=url: smg_asker(url, model, args.max_tokens)  # noqa: E731
            else:
                nginx = shutil.which("nginx") or "/usr/sbin/nginx"
                port = free_port()
                conf = tmp / "nginx.conf"
                servers = " ".join(f"server 127.0.0.1:{p};" for p in ports)
                conf.write_text(NGINX_CONF.format(tmp=tmp, servers=servers, port=port))
                procs.append(
                    subprocess.Popen(
                        [
                            nginx,
                            "-e",
                            "stderr",
                            "-p",
                            str(tmp),
                            "-c",
                            str(conf),
                            "-g",
                            "daemon off; master_process off;",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.STDOUT,
                    )  # fmt: skip
                )
                wait(
                    lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True,
                    10,
                    "nginx",
                )
                make_ask = lambda port=port: grpc_asker(f"127.0.0.1:{port}", args.max_tokens)  # noqa: E731
            stats, wall = asyncio.run(run_workload(make_ask, args))
            rows.append(stats.row(arm, wall))
            print(json.dumps(rows[-1]), flush=True)
            procs.pop().kill()
    finally:
        for p in procs:
            p.kill()
        for p, _ in replicas:
            p.terminate()
        for p, _ in replicas:
            p.wait(30)
    print(f"\n{args.conversations} conversations x {args.turns} turns, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, shared prefix {shared} tokens, model {model}")  # fmt: skip
    print(
        f"{'arm':18} {'TTFT p50 ms':>12} {'p99 ms':>9} {'req/s':>7} {'hit rate':>9} {'prev hit':>9} {'errors':>7}"
    )
    for r in rows:
        print(
            f"{r['arm']:18} {r['ttft_p50_ms']:12.0f} {r['ttft_p99_ms']:9.0f} {r['req_per_s']:7.2f} "
            f"{r['prefix_hit_rate']:9.2f} {r['turns_with_previous_prompt_cached']:9.2f} {r['errors']:7d}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
