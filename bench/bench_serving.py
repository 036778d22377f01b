"""Serving benchmark: zerogap overlap vs normal scheduler, and vs transformers `generate`.

One run starts a server subprocess per configuration (``--configs overlap,normal``),
drives the same chat workload through ``GenerateStream`` at a fixed concurrency,
reads GetServerInfo, stops the server, and finally (unless ``--no-hf``) runs
transformers ``generate`` on the same prompts in this process, so nothing competes.

Every request is greedy with ``ignore_eos`` (on by default), so each one produces
exactly ``--max-new-tokens`` tokens and all systems do the same amount of work.

Usage:
    .venv/bin/python bench/bench_serving.py [--num-prompts 64] [--max-new-tokens 128]
        [--concurrency 32] [--dtype float32|bfloat16] [--configs overlap,normal]
        [--server-args "--max-running-requests 64"] [--num-threads N]
        [--no-hf] [--hf-batch-size B] [--json out.json] [--model DIR]

Figures: output tok/s = all output tokens / workload wall time; TTFT = time to the
first streamed message holding a token; ITL = (t_last - t_first) / (tokens - 1) per
request; p50/p99 are over requests. busy / gap come from GetServerInfo (recent
back-to-back forwards, warm-up included).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.model_prep import prepare_default_model  # noqa: E402
from zerogap.client import AsyncClient, Chat, Sampling  # noqa: E402

CONFIG_FLAGS: dict[str, list[str]] = {"overlap": ["--loop", "overlap"], "normal": ["--loop", "normal"]}
QUESTIONS = [
    "What is {t}?", "Explain {t} to a child.", "Give three facts about {t}.", "Why does {t} matter?",
    "Write a short poem about {t}.", "What are common misconceptions about {t}?",
    "How would you teach {t} in one lesson?", "Summarize the history of {t}.",
]  # fmt: skip
TOPICS = [
    "photosynthesis", "the moon", "binary numbers", "volcanoes", "the French revolution", "gravity",
    "honey bees", "the internet", "rainbows", "prime numbers", "the human heart", "glaciers",
    "electric cars", "jazz music", "the Roman empire", "black holes",
]  # fmt: skip
STYLES = ["", " Keep it brief.", " Use simple words.", " Answer step by step."]


@dataclass
class ConfigResult:
    name: str
    server_cmd: list[str]
    wall_s: float
    output_tokens: int
    requests: int
    tok_per_s: float
    req_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    forward_busy_fraction: float
    median_forward_gap_ms: float
    forward_steps_in_run: int
    scheduler_mode: str
    hf_ratio: float | None = None


@dataclass
class HfResult:
    wall_s: float
    output_tokens: int
    tok_per_s: float
    batch_size: int


@dataclass
class Report:
    params: dict
    configs: list[ConfigResult] = field(default_factory=list)
    hf: HfResult | None = None
    overlap_over_normal: float | None = None


# ---- workload ------------------------------------------------------------------------
def build_prompts(n: int) -> list[str]:
    """n distinct short user questions, deterministic, spread over templates x topics x styles."""
    combos = len(QUESTIONS) * len(TOPICS) * len(STYLES)
    out = []
    for i in range(n):
        j = (i * 37) % combos  # 37 is coprime with 512: a permutation that mixes all three axes
        q, t, s = j % len(QUESTIONS), (j // len(QUESTIONS)) % len(TOPICS), j // (len(QUESTIONS) * len(TOPICS))
        text = QUESTIONS[q].format(t=TOPICS[t]) + STYLES[s]
        out.append(text if i < combos else f"{text} (variant {i // combos})")
    return out


def make_request(prompt: str, max_new_tokens: int, ignore_eos: bool) -> tuple[Chat, Sampling]:
    return Chat([("user", prompt)]), Sampling(
        max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos
    )


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100); 0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


# ---- server subprocess ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m service serve ...` in its own process group, logging to a temp file; `cwd`: the
    checkout whose server runs (this one by default)."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ):
        self.cmd, self.port = cmd, port
        self.log = tempfile.NamedTemporaryFile("w+", prefix="zerogap-bench-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else {**os.environ, **env},
        )
        _LIVE.add(self)
        try:
            self._wait_listening(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "listening" in Path(self.log.name).read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        tail = Path(self.log.name).read_text(errors="replace")[-3000:]
        rc = self.proc.returncode
        raise RuntimeError(f"server did not come up (rc={rc}): {shlex.join(self.cmd)}\n{tail}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the group, wait, then SIGKILL if it is still there."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        _LIVE.discard(self)


_LIVE: set[ServerProcess] = set()
atexit.register(lambda: [s.stop(timeout_s=5.0) for s in list(_LIVE)])  # last resort


def server_cmd(args: argparse.Namespace, config: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "service", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--dtype", args.dtype, *CONFIG_FLAGS[config]]
    if args.num_threads is not None:
        cmd += ["--num-threads", str(args.num_threads)]
    return cmd + shlex.split(args.server_args)


# ---- client --------------------------------------------------------------------------
async def one_stream(
    client: AsyncClient, req: tuple[Chat, Sampling], sem: asyncio.Semaphore
) -> tuple[float, float | None, int]:
    """(ttft s, itl s or None, output tokens) for one streamed request."""
    async with sem:
        t0 = time.perf_counter()
        t_first = t_last = None
        n = 0
        async with client.stream(*req) as stream:
            async for delta in stream:
                if delta.token_ids:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    n += len(delta.token_ids)
    if t_first is None:
        raise RuntimeError("a stream ended without any token")
    return t_first - t0, (t_last - t_first) / (n - 1) if n > 1 else None, n


async def run_workload(address: str, prompts: list[str], args: argparse.Namespace) -> ConfigResult:
    """Warm up, run all prompts at --concurrency, and read GetServerInfo around the run."""
    async with AsyncClient(address, timeout=None) as client:
        warm = asyncio.Semaphore(2)
        await asyncio.gather(*(one_stream(client, make_request(p, min(args.max_new_tokens, 16), True), warm)
                               for p in prompts[:2]))  # fmt: skip
        before = await client.server_info()
        sem = asyncio.Semaphore(args.concurrency)
        reqs = [make_request(p, args.max_new_tokens, args.ignore_eos) for p in prompts]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, r, sem) for r in reqs))
        wall = time.perf_counter() - t0
        info = await client.server_info()
    ttft = [r[0] for r in results]
    itl = [r[1] for r in results if r[1] is not None]
    tokens = sum(r[2] for r in results)
    return ConfigResult(
        name="", server_cmd=[], wall_s=wall, output_tokens=tokens, requests=len(results),
        tok_per_s=tokens / wall, req_per_s=len(results) / wall,
        ttft_p50_ms=pct(ttft, 50) * 1e3, ttft_p99_ms=pct(ttft, 99) * 1e3,
        itl_p50_ms=pct(itl, 50) * 1e3, itl_p99_ms=pct(itl, 99) * 1e3,
        forward_busy_fraction=info.forward_busy_fraction,
        median_forward_gap_ms=info.median_forward_gap_s * 1e3,
        forward_steps_in_run=info.forward_steps - before.forward_steps, scheduler_mode=info.scheduler_mode,
    )  # fmt: skip


def bench_config(args: argparse.Namespace, config: str, prompts: list[str]) -> ConfigResult:
    port = free_port()
    cmd = server_cmd(args, config, port)
    print(f"[bench] {config}: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
    server = ServerProcess(cmd, port)
    try:
        res = asyncio.run(run_workload(f"127.0.0.1:{port}", prompts, args))
    finally:
        server.stop()
    res.name, res.server_cmd = config, cmd
    return res


# ---- transformers baseline -----------------------------------------------------------
def bench_hf(args: argparse.Namespace, prompts: list[str]) -> HfResult:
    """transformers generate, static left-padded batches, exactly M new tokens each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    chats = [[{"role": "user", "content": p}] for p in prompts]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    bs = args.hf_batch_size or args.concurrency
    m = args.max_new_tokens

    def generate(batch: list[str], new_tokens: int) -> int:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
        return (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

    print(f"[bench] transformers generate, batch {bs}", file=sys.stderr, flush=True)
    with torch.inference_mode():
        generate(texts[:2], min(m, 16))  # warm-up
        t0 = time.perf_counter()
        tokens = sum(generate(texts[i : i + bs], m) for i in range(0, len(texts), bs))
        wall = time.perf_counter() - t0
    return HfResult(wall_s=wall, output_tokens=tokens, tok_per_s=tokens / wall, batch_size=bs)


# ---- report --------------------------------------------------------------------------
def print_report(rep: Report) -> None:
    p = rep.params
    print(
        f"\nworkload: {p['num_prompts']} prompts x {p['max_new_tokens']} new tokens, "
        f"concurrency {p['concurrency']}, dtype {p['dtype']}, ignore_eos {p['ignore_eos']}, "
        f"threads {p['num_threads'] or 'all'}"
    )
    print(f"host: {p['cpu_count']} cores, 1-min load average at start {p['loadavg_1m_at_start']:.2f}")
    head = f"{'config':<14}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}" \
           f"{'busy':>7}{'gap ms':>8}{'steps':>7}{'vs HF':>7}"  # fmt: skip
    print(head + "\n" + "-" * len(head))
    for c in rep.configs:
        vs = f"{c.hf_ratio:.2f}x" if c.hf_ratio is not None else "-"
        print(f"{c.name:<14}{c.tok_per_s:>9.1f}{c.req_per_s:>8.2f}"
              f"{c.ttft_p50_ms:>8.0f}ms{c.ttft_p99_ms:>7.0f}ms"
              f"{c.itl_p50_ms:>7.1f}ms{c.itl_p99_ms:>6.1f}ms{c.forward_busy_fraction:>7.3f}"
              f"{c.median_forward_gap_ms:>8.2f}{c.forward_steps_in_run:>7d}{vs:>7}")  # fmt: skip
    if rep.hf is not None:
        print(f"{'transformers':<14}{rep.hf.tok_per_s:>9.1f}   (static batches of {rep.hf.batch_size}, "
              f"{rep.hf.output_tokens} tokens in {rep.hf.wall_s:.2f} s)")  # fmt: skip
    if rep.overlap_over_normal is not None:
        print(f"\noverlap / normal throughput: {rep.overlap_over_normal:.3f}x")
    print("(TTFT/ITL p50/p99 over requests; busy = forward_busy_fraction; gap = median forward gap; "
          "steps = forwards during the workload; vs HF = zerogap tok/s / transformers tok/s)")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--configs", default="overlap,normal", help="comma list of: " + ", ".join(CONFIG_FLAGS))
    extra_help = "extra server options, one quoted string (a lone flag: --server-args=--disable-overlap)"
    p.add_argument("--server-args", default="", help=extra_help)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads: server --num-threads and HF")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: --concurrency")
    p.add_argument("--json", default=None, help="write all figures here")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIG_FLAGS]
    if bad:
        p.error(f"--configs: unknown {bad} (known: {', '.join(CONFIG_FLAGS)})")
    args.model = str(args.model or prepare_default_model())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> SystemExit, so the `finally` blocks stop any server subprocess.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prompts = build_prompts(args.num_prompts)
    params = {k: v for k, v in vars(args).items() if k != "json"}
    # Other load on the host skews CPU figures (and oversubscribed torch threads badly so): record it.
    params.update(cpu_count=os.cpu_count(), loadavg_1m_at_start=os.getloadavg()[0])
    rep = Report(params=params)
    for config in args.configs:
        rep.configs.append(bench_config(args, config, prompts))
    by_name = {c.name: c for c in rep.configs}
    if "overlap" in by_name and "normal" in by_name:
        rep.overlap_over_normal = by_name["overlap"].tok_per_s / by_name["normal"].tok_per_s
    if not args.no_hf:
        rep.hf = bench_hf(args, prompts)
        for c in rep.configs:
            c.hf_ratio = c.tok_per_s / rep.hf.tok_per_s
    print_report(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(rep), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
