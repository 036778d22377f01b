"""Two zerogap replicas behind SMG (cache_aware, fed by KV events) vs behind round robin.

The workload is a multi-turn chat service: `--conversations` conversations of `--turns` turns behind
one shared system prompt (448 tokens with the template), `--concurrency` conversations open at a
time (a new one starts when one ends), each conversation's turns sequential with a user's think time
(exponential, mean `--think-s`) between an answer and the next question. A user turn is either a short
question (~10-40 tokens) or, with probability `--paste-share` (0.2; twice that on a first turn),
pasted material of 150-500 tokens with a line asking about it: Python source (the standard
library's), a section of the Python reference manual (`pydoc_data`) or a service log. With 0.2 a user
turn averages 64-88 tokens (median 11-13) over the default rounds' seeds, near LMSYS-Chat-1M's 69.5
tokens per prompt. Answers are greedy and 64-128 tokens long (drawn per turn, `ignore_eos`), and the
history grows with them. Every arm replays the same conversations (one seed per round), so the arms
do the same work and only the routing differs:

  smg-cache_aware   `smg launch --policy cache_aware` (OpenAI API, streamed)
  smg-round_robin   the same gateway, `--policy round_robin`
  nginx-rr          nginx `grpc_pass` round robin (zerogap.v1 GenerateStream with chat input)

The arms are interleaved, rotated every round (A B C, B C A, C A B, ...), on the same two replicas,
their prefix caches flushed and the frontend restarted before every arm, so a drift of the machine
hits all arms alike. With `--pin` (the default when two or more CPUs are granted) replica i runs on
CPU i only, as if each had a machine of its own; the gateway, nginx and this client float.

smg runs with its own routing defaults (`--smg-args` adds flags); the replicas with the server's
(`--server-args` adds flags).

Figures per arm and round: TTFT p50/p99 (to the first streamed token, all turns; and the p50 of turns
2+ with a short question and with a paste, apart: the two modes of the distribution),
requests/s and output tokens/s over the arm's wall time, prefix hit rate (cached prompt tokens /
prompt tokens, from each response's usage), the share of turns 2+ that found their previous turn's
whole prompt cached (only the replica that served that turn holds all of it), prompt tokens computed
(prompt - cached: what a miss costs), the spread of new conversations and of all requests over the
two replicas (smg's `x-smg-routed-worker-id` response header; nginx's access log of `$upstream_addr`
keyed by an `x-request-id` the client sends), the replicas' CPU seconds, and the CPU time other
processes took from the machine meanwhile (`/proc/stat` minus this bench's own processes). Then the
median of every figure over the rounds and TTFT p50 ratios (round robin / cache_aware) per round.
`--breakdown` traces the replicas (`--trace-file`) and splits each turn's TTFT along its replica's
forward steps (`forward_trace.py`): what was left of the step in flight when the turn was sent, the
wait until its own step, that step, and the delivery; printed per arm for the turns 2+ with a short
question. Nothing here asserts a duration.

Usage (heavy: run under the shared lock; about 2-4 minutes per arm with the defaults):
    flock /tmp/zg-heavy.lock .venv/bin/python bench/bench_smg_routing.py [--model DIR] [--rounds 3]
        [--conversations 24] [--turns 6] [--concurrency 8] [--think-s 1.0] [--paste-share 0.2]
        [--arms a,b,c] [--smg-args '...'] [--server-args '...'] [--breakdown] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "clients" / "python"))

import grpc
from forward_trace import PARTS, load_forwards, split_turn
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

SYSTEM = """You are Harbor, the developer-support assistant of Larkspur Systems, a company that runs a \
hosted data platform (ingestion pipelines, a SQL warehouse, scheduled Python jobs and dashboards) for \
small and mid-sized businesses. The people writing to you are engineers and analysts at our customers; \
most of them know Python and SQL well, some are new to both.

How to answer:
- Read what the user pasted (code, logs, documentation, error messages) before answering, and refer to \
the exact lines or fields you mean. If something needed to answer is missing, say what it is and ask \
for it instead of guessing.
- Be brief: lead with the answer or the fix, then the reason in a sentence or two. Use short code \
blocks for code, with the language named, and keep examples runnable with the standard library unless \
the user's code already uses a package.
- Prefer the smallest change that fixes the problem. Point out a second problem you notice, but do not \
rewrite code the user did not ask about.
- For errors in logs, name the first failure, not the cascade that follows it, and say which service or \
job produced it.
- Never invent APIs, configuration keys, versions or limits of the Larkspur platform. When a question \
depends on the customer's plan (row limits, job timeouts, retention), say so and point to the account \
page under Settings > Plan.
- Security: never ask for or repeat passwords, API keys or tokens; if the user pasted one, tell them to \
revoke it under Settings > API keys and continue without it.
- If a request is outside software and data work, say politely that you can only help with the \
platform and with code.

Larkspur conventions you may rely on: jobs run Python 3.11 in a container with 2 vCPUs and 4 GiB of \
memory; the scheduler retries a failed job twice with a five-minute back-off; warehouse tables are \
partitioned by day on a column named event_date; logs are kept for 14 days."""

CODE_MODULES = (
    "argparse", "textwrap", "json.decoder", "json.encoder", "csv", "shutil", "heapq", "functools",
    "collections", "pathlib", "logging", "configparser", "difflib", "calendar", "fractions",
    "statistics", "string", "tempfile", "urllib.parse", "http.cookies", "email.utils", "ipaddress",
    "datetime", "pprint", "dataclasses", "gzip", "zipfile", "queue", "sched", "shlex",
)  # fmt: skip
LEAD_INS = {
    "code": (
        "Here is a function from our codebase. Can you explain what it does and whether it has a bug?",
        "This code was written by a colleague who left. What is it for, and what would you change?",
        "Our job fails somewhere in this part. What are the edge cases I should test?",
        "Can you review this? We want to reuse it in a scheduled job on the platform.",
        "I do not understand the control flow here. Walk me through it, please.",
    ),
    "docs": (
        "I am reading this section of the Python reference. Can you summarise it for a newcomer?",
        "What is the practical consequence of the rules below for code I write every day?",
        "Is there anything in this text that contradicts what you told me before?",
        "Please explain the following with one short example.",
    ),
    "logs": (
        "Last night's run failed. These are the logs; what went wrong first?",
        "We see this in the job logs every few hours. Is it a problem on our side or on yours?",
        "Here are the logs from the ingestion service. Why did the load stop?",
        "Can you tell from these logs which step is slow?",
    ),
}
FOLLOW_UPS = (
    "Can you give a shorter version of that?",
    "Why is that better than what I had?",
    "How would I write a unit test for it?",
    "Is this thread-safe if two jobs run it at once?",
    "What happens if the input is empty?",
    "Thanks. Could you show the fixed code in full?",
    "Which part of that would fail first under load?",
    "Would this still work on Python 3.8?",
    "What does line {n} do exactly?",
    "Could you explain the second point again, more slowly?",
    "How do I log this properly so I can find it later?",
    "Is there a standard library function that already does this?",
    "What would the output be for the value {n}?",
    "Does the scheduler's retry make this worse?",
    "How much memory would this need for {n} thousand rows?",
    "Rewrite your last answer as three bullet points.",
    "OK, and what should I tell my manager about the cause?",
    "Can we avoid the extra dependency?",
    "Why did it only fail on the {n}th of the month?",
    "What is the time complexity of that?",
    "Could you add type hints?",
    "Where in Settings do I find that?",
    "Is there a risk of losing data here?",
    "How would you name this function instead?",
)
OPENERS = (
    "How do I read a CSV file with a header and skip empty lines?",
    "What is the difference between a list and a tuple in practice?",
    "Our scheduled job sometimes runs twice. How can I make it idempotent?",
    "How should I store an API key for a job on the platform?",
    "What is a good way to retry an HTTP call with back-off in plain Python?",
    "How do I partition a query by event_date to make it faster?",
    "Can you explain what a context manager is, with a small example?",
    "Why does my datetime come out one hour off after the clock change?",
)
LOG_EVENTS = (
    ("INFO", "scheduler", "job {job} started (attempt {a}/3, container {c})"),
    ("INFO", "ingest", "batch {b} read {r} rows from s3://lk-{cust}/events/{d}/part-{p}.json.gz"),
    ("DEBUG", "ingest", "schema check ok for batch {b}: {k} columns, {n} nullable"),
    ("INFO", "warehouse", "COPY INTO events_{d} committed {r} rows in {ms} ms"),
    ("WARN", "warehouse", "slow query {q}: {ms} ms scanning {k} partitions (limit 30)"),
    ("WARN", "ingest", "batch {b}: {n} rows rejected (event_date missing), first at offset {r}"),
    ("ERROR", "ingest", "batch {b}: s3 GetObject failed: SlowDown (retry {a} in {s}s)"),
    ("INFO", "jobs", "task transform_{job} finished in {s}.{ms} s, peak memory {m} MiB"),
    ("ERROR", "jobs", "task transform_{job}: MemoryError after {s} s (limit 4096 MiB, peak {m} MiB)"),
    ("WARN", "scheduler", "job {job} exceeded soft deadline by {s} s"),
    ("INFO", "dashboards", "refresh of board {q} queued behind {n} queries"),
    ("ERROR", "warehouse", "query {q} cancelled: statement timeout ({s} s) on events_{d}"),
)
NGINX_CONF = """worker_processes 1;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
  log_format routed '$http_x_request_id $upstream_addr';
  access_log {tmp}/access.log routed;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream replicas {{ {servers} }}
  server {{ listen 127.0.0.1:{port} http2; location / {{ grpc_pass grpc://replicas; }} }}
}}
"""


# ---- the workload --------------------------------------------------------------------------
@dataclass
class Turn:
    user: str
    max_tokens: int
    think_s: float  # the user's pause before sending it (0 for the first turn)
    paste: bool  # pasted material with a line about it, else a short question


class Material:
    """Pasted material of about a given token count: stdlib source, reference-manual prose, logs."""

    def __init__(self, tokenizer) -> None:
        import importlib
        import inspect
        from pydoc_data.topics import topics

        self.tok = tokenizer
        self.code = [inspect.getsource(importlib.import_module(m)).splitlines() for m in CODE_MODULES]
        self.docs = [t.splitlines() for _, t in sorted(topics.items()) if len(t) > 6000]

    def _trim(self, lines: list[str], target: int) -> str:
        text, n = [], 0
        for line in lines:
            n += len(self.tok.encode(line + "\n", add_special_tokens=False))
            if n > target and text:
                break
            text.append(line)
        return "\n".join(text)

    def paste(self, kind: str, target: int, rng: random.Random) -> str:
        if kind == "code":
            src = rng.choice(self.code)
            starts = [i for i, s in enumerate(src) if s.lstrip().startswith(("def ", "class "))]
            return "```python\n" + self._trim(src[rng.choice(starts) :], target) + "\n```"
        if kind == "docs":
            doc = rng.choice(self.docs)
            starts = [i + 1 for i, s in enumerate(doc[:-40]) if not s.strip()]
            return self._trim(doc[rng.choice(starts) :], target)
        t = rng.randrange(86_400)
        lines = []
        for _ in range(120):
            t += rng.randrange(1, 90)
            level, svc, msg = rng.choice(LOG_EVENTS)
            vals = {k: rng.randrange(2, 999) for k in ("a", "b", "k", "n", "ms", "s", "m", "p", "r")}
            vals |= {"job": f"{rng.randrange(16**6):06x}", "c": f"{rng.randrange(16**8):08x}",
                     "q": f"q-{rng.randrange(10**6)}", "cust": rng.choice(("acme", "brightco", "nordfish")),
                     "d": f"2026{rng.randrange(1, 13):02d}{rng.randrange(1, 29):02d}", "a": rng.randrange(1, 4)}  # fmt: skip
            lines.append(
                f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} {level:5} {svc:10} {msg.format(**vals)}"
            )
        return "```\n" + self._trim(lines, target) + "\n```"


def build_conversations(
    n: int, turns: int, think_s: float, paste_share: float, seed: int, material: Material
) -> list[list[Turn]]:
    """The same list for the same seed: every arm of a round replays it. A turn is a paste with
    probability `paste_share`, a first turn with twice that."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = []
        for t in range(turns):
            paste = rng.random() < min(1.0, paste_share * (2 if t == 0 else 1))
            if paste:
                kind = rng.choice(("code", "code", "docs", "logs"))
                user = f"{rng.choice(LEAD_INS[kind])}\n\n{material.paste(kind, rng.randrange(150, 501), rng)}"
            elif t == 0:
                user = rng.choice(OPENERS)
            else:
                user = rng.choice(FOLLOW_UPS).format(n=rng.randrange(2, 40))
            think = 0.0 if t == 0 else min(rng.expovariate(1 / think_s), 4 * think_s) if think_s > 0 else 0.0
            conv.append(Turn(user, rng.randrange(64, 129), think, paste))
        out.append(conv)
    return out


# ---- processes -----------------------------------------------------------------------------
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


def start_replicas(
    model: str | None, tmp: Path, extra: list[str], cpus: list[int] | None, traces: bool = False
):
    out = []
    for i, name in enumerate(("a", "b")):
        port = free_port()
        log = open(tmp / f"replica-{name}.log", "wb")
        cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
        if traces:  # written when the replica stops
            cmd += ["--trace-file", str(tmp / f"trace-{name}.json")]
        if model:
            cmd += ["--model", model]
        pin = None if cpus is None else (lambda cpu=cpus[i]: os.sched_setaffinity(0, {cpu}))
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)
        out.append((proc, port))
    for _, port in out:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb2_grpc.GenerationStub(ch)
            wait(lambda: stub.GetServerInfo(pb2.GetServerInfoRequest(), timeout=2), 300, f"replica :{port}")
    return out


def warm_up(ports: list[int], material: Material) -> None:
    """A short and a long prompt on each replica first: lazy initialisation stays out of the arms."""
    long = material.paste("docs", 1500, random.Random(0))
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb2_grpc.GenerationStub(ch)
            for text, n in (("hello", 8), (long, 16)):
                req = pb2.GenerateRequest(
                    chat=pb2.ChatInput(messages=[pb2.ChatMessage(role="user", content=text)]),
                    sampling=pb2.SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True),
                )
                list(stub.GenerateStream(req, timeout=300))


def flush(ports: list[int]) -> None:
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = vllm_engine_pb2_grpc.VllmEngineStub(ch).FlushCache(common_pb2.FlushCacheRequest(timeout_s=30))
            assert r.success, r.message


def model_name(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return Path(pb2_grpc.GenerationStub(ch).GetModelInfo(pb2.GetModelInfoRequest()).model_path).name


def start_smg(
    policy: str, ports: list[int], model: str, tmp: Path, extra: list[str]
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in ports], "--policy", policy,
         "--worker-startup-check-interval", "1", "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port()), "--log-level", "warn", *extra],
        stdout=open(tmp / f"smg-{policy}.log", "ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:  # both workers registered, the tokenizer loaded
        import urllib.request

        with urllib.request.urlopen(f"{url}/workers", timeout=2) as r:
            workers = json.loads(r.read())
        if len(workers.get("workers", workers)) < 2:
            return False
        hello = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        req = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(hello).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200

    wait(ready, 60, f"smg {policy}")
    return proc, url


def start_nginx(ports: list[int], tmp: Path) -> tuple[subprocess.Popen, int]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    port = free_port()
    conf = tmp / "nginx.conf"
    (tmp / "access.log").unlink(missing_ok=True)
    servers = " ".join(f"server 127.0.0.1:{p};" for p in ports)
    conf.write_text(NGINX_CONF.format(tmp=tmp, servers=servers, port=port))
    proc = subprocess.Popen(
        [nginx, "-e", "stderr", "-p", str(tmp), "-c", str(conf), "-g", "daemon off; master_process off;"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True, 10, "nginx")
    return proc, port


# ---- CPU accounting ------------------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq) / TICK, steal / TICK


def tree_cpu_s(roots: list[int]) -> dict[int, float]:
    """CPU seconds (user + system, threads included) of each root and its descendants, by root."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                stats[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK)
            except (OSError, IndexError):
                pass
    out = {}
    for root in roots:
        total, frontier = 0.0, {root}
        while frontier:
            total += sum(stats[p][1] for p in frontier if p in stats)
            frontier = {p for p, (ppid, _) in stats.items() if ppid in frontier}
        out[root] = total
    return out


# ---- the client side -----------------------------------------------------------------------
@dataclass
class Record:
    conv: int
    turn: int
    ttft: float
    e2e: float
    prompt: int
    cached: int
    output: int
    previous_prompt: int
    paste: bool
    replica: str = "?"
    sent: float = 0.0  # perf_counter when the turn was sent (the replicas' traces share the clock)


@dataclass
class ArmRun:
    records: list[Record] = field(default_factory=list)
    errors: int = 0
    wall: float = 0.0


async def run_workload(make_ask, conversations: list[list[Turn]], concurrency: int) -> ArmRun:
    """`make_ask()(messages, max_tokens, request_id) -> (ttft, e2e, text, prompt, cached, output, replica)`
    (made in the running loop; its `aclose()` is awaited at the end, while the loop still runs)."""
    run, sem, ask = ArmRun(), asyncio.Semaphore(concurrency), make_ask()

    async def conversation(c: int, turns: list[Turn]) -> None:
        async with sem:
            messages, previous = [{"role": "system", "content": SYSTEM}], 0
            for t, turn in enumerate(turns):
                await asyncio.sleep(turn.think_s)
                messages.append({"role": "user", "content": turn.user})
                sent = time.perf_counter()
                try:
                    ttft, e2e, text, prompt, cached, output, replica = await ask(
                        messages, turn.max_tokens, f"c{c}-t{t}-{os.urandom(3).hex()}"
                    )
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    print(f"  conversation {c} turn {t}: {type(e).__name__}: {e}", file=sys.stderr)
                    run.errors += 1
                    return
                run.records.append(
                    Record(c, t, ttft, e2e, prompt, cached, output, previous, turn.paste, replica, sent)
                )
                previous = prompt
                messages.append({"role": "assistant", "content": text})

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(conversation(c, turns) for c, turns in enumerate(conversations)))
    finally:
        run.wall = time.perf_counter() - t0
        await ask.aclose()  # the client's connections, before asyncio.run closes the loop
    return run


def smg_asker(url: str, model: str, replica_of: dict[str, str]):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

    async def ask(messages, max_tokens, request_id):
        t0 = time.perf_counter()
        ttft, parts, usage = None, [], None
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": request_id},
        )  # fmt: skip
        replica = replica_of.get(raw.headers.get("x-smg-routed-worker-id", ""), "?")
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        e2e = time.perf_counter() - t0
        cached = usage.prompt_tokens_details.cached_tokens or 0
        return ttft or e2e, e2e, "".join(parts), usage.prompt_tokens, cached, usage.completion_tokens, replica

    ask.aclose = client.close  # type: ignore[attr-defined]
    return ask


def grpc_asker(address: str):
    channel = grpc.aio.insecure_channel(address)
    stub = pb2_grpc.GenerationStub(channel)

    async def ask(messages, max_tokens, request_id):
        req = pb2.GenerateRequest(
            chat=pb2.ChatInput(
                messages=[pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
            ),
            sampling=pb2.SamplingParams(temperature=0, max_new_tokens=max_tokens, ignore_eos=True),
        )
        t0 = time.perf_counter()
        ttft, parts, last, output = None, [], None, 0
        async for r in stub.GenerateStream(req, timeout=600, metadata=(("x-request-id", request_id),)):
            if r.token_ids:
                ttft = ttft or time.perf_counter() - t0
                output += len(r.token_ids)
            parts.append(r.text)
            last = r
        e2e = time.perf_counter() - t0
        # the replica comes from nginx's access log after the arm (keyed by request id)
        return (
            ttft or e2e,
            e2e,
            "".join(parts),
            last.usage.prompt_tokens,
            last.usage.cached_tokens,
            output,
            request_id,
        )

    ask.aclose = channel.close  # type: ignore[attr-defined]
    return ask


def shared_prefix_len(tokenizer) -> int:
    """Tokens every conversation's first prompt shares (the system prompt and the template)."""
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True, tokenize=True, return_dict=True,
        )["input_ids"]
        for q in OPENERS[:2]
    ]  # fmt: skip
    n = 0
    while n < min(map(len, ids)) and ids[0][n] == ids[1][n]:
        n += 1
    return n


# ---- figures -------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs) or [float("nan")]
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def p50(xs: list[float]) -> float:
    return 1000 * statistics.median(xs) if xs else float("nan")


def summarize(arm: str, rnd: int, run: ArmRun, cpu: dict) -> dict:
    rs = run.records
    later = [r for r in rs if r.turn > 0]
    first = [r for r in rs if r.turn == 0]
    by = {name: [r for r in rs if r.replica == name] for name in ("a", "b")}
    prompt = sum(r.prompt for r in rs)
    return {
        "arm": arm,
        "round": rnd,
        "requests": len(rs),
        "errors": run.errors,
        "wall_s": run.wall,
        "ttft_p50_ms": 1000 * statistics.median([r.ttft for r in rs]) if rs else float("nan"),
        "ttft_p99_ms": 1000 * pct([r.ttft for r in rs], 0.99),
        "ttft_p50_turn2plus_ms": p50([r.ttft for r in later]),
        "ttft_p50_turn2plus_short_ms": p50([r.ttft for r in later if not r.paste]),
        "ttft_p50_turn2plus_paste_ms": p50([r.ttft for r in later if r.paste]),
        "e2e_p50_ms": 1000 * statistics.median([r.e2e for r in rs]) if rs else float("nan"),
        "req_per_s": len(rs) / run.wall,
        "out_tok_per_s": sum(r.output for r in rs) / run.wall,
        "prefix_hit_rate": sum(r.cached for r in rs) / prompt if prompt else 0.0,
        "turns_with_previous_prompt_cached": (
            sum(r.cached >= r.previous_prompt for r in later) / len(later) if later else 0.0
        ),
        "prompt_tokens": prompt,
        "computed_prompt_tokens": {k: sum(r.prompt - r.cached for r in v) for k, v in by.items()},
        "new_conversations": {k: sum(r.turn == 0 for r in v) for k, v in by.items()},
        "new_conversations_first_wave": {
            k: sum(r.turn == 0 and r.conv < cpu["concurrency"] for r in v) for k, v in by.items()
        },
        "requests_per_replica": {k: len(v) for k, v in by.items()},
        "unattributed": sum(r.replica not in by for r in rs),
        "replica_cpu_s": cpu["replicas"],
        "other_cpu_s": cpu["other"],
        "steal_s": cpu["steal"],
        "first_turns": len(first),
    }


def split(d: dict) -> str:
    return f"{d['a']}/{d['b']}"


def print_table(rows: list[dict]) -> None:
    print(
        f"{'arm':16} {'TTFT p50':>9} {'p99':>7} {'t2+ short':>9} {'t2+ paste':>9} {'req/s':>6} {'tok/s':>6} {'hit':>5} "
        f"{'prev':>5} {'computed a/b':>13} {'new a/b':>8} {'1st wave':>8} {'all a/b':>8} "
        f"{'cpu a/b s':>10} {'other s':>7} {'err':>3}"
    )
    for r in rows:
        cpu = r["replica_cpu_s"]
        print(
            f"{r['arm']:16} {r['ttft_p50_ms']:9.0f} {r['ttft_p99_ms']:7.0f} "
            f"{r['ttft_p50_turn2plus_short_ms']:9.0f} {r['ttft_p50_turn2plus_paste_ms']:9.0f} "
            f"{r['req_per_s']:6.2f} {r['out_tok_per_s']:6.1f} {r['prefix_hit_rate']:5.2f} "
            f"{r['turns_with_previous_prompt_cached']:5.2f} {split(r['computed_prompt_tokens']):>13} "
            f"{split(r['new_conversations']):>8} {split(r['new_conversations_first_wave']):>8} "
            f"{split(r['requests_per_replica']):>8} {cpu['a']:4.0f}/{cpu['b']:<5.0f} "
            f"{r['other_cpu_s']:7.0f} {r['errors']:3d}"
        )


NUMERIC = (
    "ttft_p50_ms", "ttft_p99_ms", "ttft_p50_turn2plus_ms", "ttft_p50_turn2plus_short_ms",
    "ttft_p50_turn2plus_paste_ms", "e2e_p50_ms", "req_per_s", "out_tok_per_s",
    "prefix_hit_rate", "turns_with_previous_prompt_cached", "other_cpu_s",
)  # fmt: skip


def medians(rows: list[dict], arms: list[str]) -> list[dict]:
    out = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        m = {k: statistics.median(r[k] for r in mine) for k in NUMERIC}
        for k in ("computed_prompt_tokens", "new_conversations", "new_conversations_first_wave",
                  "requests_per_replica", "replica_cpu_s"):  # fmt: skip
            m[k] = {x: statistics.median_low(r[k][x] for r in mine) for x in ("a", "b")}
        m |= {"arm": arm, "errors": sum(r["errors"] for r in mine), "rounds": len(mine)}
        out.append(m)
    return out


def add_breakdown(records: list[dict], tmp: Path) -> None:
    """Each record's TTFT split along its replica's forward spans (`forward_trace`), in place."""
    forwards = {n: load_forwards(tmp / f"trace-{n}.json") for n in ("a", "b")}
    for r in records:
        if r["replica"] in forwards:
            r["breakdown"] = split_turn(forwards[r["replica"]], r["sent"], r["sent"] + r["ttft"])


def print_breakdown(records: list[dict], arms: list[str], rounds: int) -> None:
    """Per arm and round, the turns 2+ with a short question: the medians of their TTFT's parts on
    the replica, and how often the step in flight or their own step carried a prompt chunk."""
    print("\nturns 2+ with a short question, TTFT split along the replica's steps (medians, ms)")
    print(
        f"{'round':>5} {'arm':16} {'turns':>5} {'TTFT':>6} {'left':>6} {'wait':>6} {'step':>6} "
        f"{'deliv':>6} {'behind chunk':>12} {'own tokens':>10} {'own > 64':>8}"
    )
    for rnd in range(1, rounds + 1):
        for arm in arms:
            b = [
                r["breakdown"]
                for r in records
                if r["arm"] == arm and r["round"] == rnd and r["turn"] > 0 and not r["paste"]
                if r.get("breakdown")
            ]
            if not b:
                continue
            med = {k: statistics.median(x[k] for x in b) for k in ("ttft_ms", *PARTS)}
            print(
                f"{rnd:>5} {arm:16} {len(b):>5} {med['ttft_ms']:6.0f} {med['in_flight_left_ms']:6.0f} "
                f"{med['wait_ms']:6.0f} {med['step_ms']:6.0f} {med['delivery_ms']:6.0f} "
                f"{sum(x['in_flight_tokens'] > 64 for x in b):>12} "
                f"{statistics.median(x['step_tokens'] for x in b):>10.0f} "
                f"{sum(x['step_tokens'] > 64 for x in b):>8}"
            )


# ---- main ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=3, help="each round runs every arm once, order rotated")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8, help="conversations open at a time")
    ap.add_argument(
        "--think-s", type=float, default=1.0, help="mean pause between an answer and the next turn"
    )
    ap.add_argument(
        "--paste-share",
        type=float,
        default=0.2,
        help="share of user turns that paste material (first turns: x2)",
    )
    ap.add_argument("--seed", type=int, default=25)
    ap.add_argument("--arms", default="smg-cache_aware,smg-round_robin,nginx-rr")
    ap.add_argument("--smg-args", default="", help="extra `smg launch` flags (default: smg's own defaults)")
    ap.add_argument("--server-args", default="", help="extra `service serve` flags for both replicas")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                    help="replica i on CPU i only (default: on when two or more CPUs are granted)")  # fmt: skip
    ap.add_argument("--breakdown", action="store_true",
                    help="trace the replicas and split each turn's TTFT along its replica's forward steps")  # fmt: skip
    ap.add_argument("--json", default=None, help="write rows, medians and per-request records here")
    args = ap.parse_args()
    arms = args.arms.split(",")

    from transformers import AutoTokenizer

    from service.model_prep import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    material = Material(tokenizer)
    granted = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(granted) >= 2
    cpus = granted[:2] if pin else None
    tmp = Path(tempfile.mkdtemp(prefix="bench-smg-"))
    replicas = start_replicas(args.model, tmp, args.server_args.split(), cpus, traces=args.breakdown)
    ports = [p for _, p in replicas]
    replica_of = {f"grpc://127.0.0.1:{p}": n for p, n in zip(ports, "ab")}
    replica_of |= {f"127.0.0.1:{p}": n for p, n in zip(ports, "ab")}
    model = model_name(ports[0])
    shared = shared_prefix_len(tokenizer)
    warm_up(ports, material)
    rows, records, frontend, user_tokens = [], [], None, []
    try:
        for rnd in range(args.rounds):
            conversations = build_conversations(
                args.conversations, args.turns, args.think_s, args.paste_share, args.seed + rnd, material
            )
            user_tokens += [len(tokenizer.encode(t.user)) for c in conversations for t in c]
            order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
            for arm in order:
                flush(ports)
                if arm.startswith("smg-"):
                    frontend, url = start_smg(
                        arm.removeprefix("smg-"), ports, model, tmp, args.smg_args.split()
                    )
                    make_ask = lambda url=url: smg_asker(url, model, replica_of)  # noqa: E731
                else:
                    frontend, port = start_nginx(ports, tmp)
                    make_ask = lambda port=port: grpc_asker(f"127.0.0.1:{port}")  # noqa: E731
                roots = [p.pid for p, _ in replicas] + [frontend.pid, os.getpid()]
                busy0, steal0 = machine_busy_s()
                mine0 = tree_cpu_s(roots)
                run = asyncio.run(run_workload(make_ask, conversations, args.concurrency))
                busy1, steal1 = machine_busy_s()
                mine1 = tree_cpu_s(roots)
                frontend.kill()
                frontend.wait(10)
                frontend = None
                if not arm.startswith("smg-"):  # nginx: the replica from the access log
                    routed = dict(
                        line.split()[:2]
                        for line in (tmp / "access.log").read_text().splitlines()
                        if " " in line
                    )
                    for r in run.records:
                        r.replica = replica_of.get(routed.get(r.replica, ""), "?")
                used = {p: mine1.get(p, 0.0) - mine0.get(p, 0.0) for p in roots}
                cpu = {
                    "replicas": {n: used[p.pid] for (p, _), n in zip(replicas, "ab")},
                    "other": max(0.0, (busy1 - busy0) - sum(used.values())),
                    "steal": steal1 - steal0,
                    "concurrency": args.concurrency,
                }
                rows.append(summarize(arm, rnd + 1, run, cpu))
                records += [{"arm": arm, "round": rnd + 1, **vars(r)} for r in run.records]
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if frontend is not None:
            frontend.kill()
        for p, _ in replicas:
            p.terminate()
        for p, _ in replicas:
            p.wait(30)

    if args.breakdown:
        add_breakdown(records, tmp)
    prompts = [r["prompt"] for r in records]
    print(
        f"\n{args.conversations} conversations x {args.turns} turns, {args.concurrency} open at a time, think "
        f"{args.think_s} s mean, paste share {args.paste_share} (first turns x2), user turns "
        f"{statistics.mean(user_tokens):.0f} tokens mean / {statistics.median(user_tokens):.0f} median, answers "
        f"64-128 tokens, shared prefix {shared} tokens, prompts "
        f"{min(prompts)}-{max(prompts)} tokens (median {statistics.median(prompts):.0f}), model {model}, "
        + (f"replicas pinned to CPUs {cpus}" if pin else "replicas not pinned")
    )
    for rnd in range(1, args.rounds + 1):
        print(f"\nround {rnd}")
        print_table([r for r in rows if r["round"] == rnd])
    med = medians(rows, arms)
    print(f"\nmedian over {args.rounds} rounds")
    print_table(med)
    base = "smg-cache_aware"
    if base in arms:
        print("\nTTFT p50, round robin / cache_aware (the goal: >= 2.0)")
        for arm in arms:
            if arm == base:
                continue
            per = [
                r["ttft_p50_ms"] / c["ttft_p50_ms"]
                for r in rows
                for c in rows
                if r["arm"] == arm and c["arm"] == base and r["round"] == c["round"]
            ]
            print(
                f"  {arm:16} "
                + " ".join(f"{x:.2f}x" for x in per)
                + f"  (median {statistics.median(per):.2f}x)"
            )
    if args.breakdown:
        print_breakdown(records, arms, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "medians": med, "records": records}, indent=1))


if __name__ == "__main__":
    main()
