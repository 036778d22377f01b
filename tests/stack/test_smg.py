"""The real SMG gateway (`smg launch`, PyPI `smg`) in front of two zerogap replicas on loopback, driven
with the official OpenAI SDK: the API's fields, cache-aware routing of multi-turn conversations
(KV events from each replica's prefix cache), and a replica killed under load and restarted."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from service import protos
from tests.helpers import NEEDS, free_port, wait_until

pb2, pb2_grpc = protos.load()
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are a terse assistant. Answer in one short sentence and never apologise for anything at all."


def smg_binary() -> str:
    local = Path(sys.executable).parent / "smg"  # the venv's, when its bin/ is not on PATH
    found = str(local) if local.exists() else shutil.which("smg")
    if found is None:
        pytest.skip(f"{NEEDS}smg: pip install -e '.[test]' (the smg gateway is in the test extra)")
    return found


class Replica:
    """`python -m service serve` on a fixed port, logging to a file; restartable after a kill."""

    def __init__(self, model_dir: Path, tmp: Path, name: str):
        self.model_dir, self.port, self.name = model_dir, free_port(), name
        self.log_path = tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--model", str(self.model_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32", "--kv-cache-tokens", "8192",
             "--max-running-requests", "8"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def wait_ready(self, timeout: float = 120.0) -> None:
        assert wait_until(self._ready, timeout, 0.2), (
            f"{self.name} did not start:\n{self.log_path.read_text()}"
        )

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()
        try:
            self.info()
            return True
        except grpc.RpcError:
            return False

    def info(self):
        return pb2_grpc.GenerationStub(self.channel).GetServerInfo(pb2.GetServerInfoRequest(), timeout=5)

    def prompt_tokens(self) -> int:
        return self.info().prefix_cache_prompt_tokens

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.channel is not None:
            self.channel.close()


class Gateway:
    def __init__(self, replicas: list[Replica], model_dir: Path, tmp: Path, policy: str = "cache_aware"):
        self.port = free_port()
        self.log_path = tmp / f"smg-{policy}.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *[f"grpc://127.0.0.1:{r.port}" for r in replicas],
             "--model-path", str(model_dir), "--policy", policy,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
             "--balance-abs-threshold", "1", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model_dir.name

    def workers(self) -> list[dict]:
        try:
            with urllib.request.urlopen(f"{self.url}/workers", timeout=2) as r:
                body = json.loads(r.read())
        except OSError:
            return []
        return body.get("workers", body) if isinstance(body, dict) else body

    def wait_ready(self, n: int, timeout: float = 60.0) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()
            return sum(1 for w in self.workers() if w.get("is_healthy", True)) >= n

        assert wait_until(ready, timeout, 0.2), (
            f"smg did not register {n} workers:\n{self.log_path.read_text()}"
        )

        def answers() -> bool:  # the tokenizer is registered a little after the workers
            try:
                self.client().chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
                return True
            except Exception:  # noqa: BLE001 - 503 until then
                return False

        assert wait_until(answers, timeout, 0.2), self.log_path.read_text()

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smg")
    replicas = [Replica(tiny_llama_dir, tmp, name) for name in ("a", "b")]
    gateway = None
    try:
        t0 = time.monotonic()
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        t1 = time.monotonic()
        gateway = Gateway(replicas, tiny_llama_dir, tmp)
        gateway.wait_ready(2)
        print(f"replicas up in {t1 - t0:.1f}s, smg with both workers in {time.monotonic() - t1:.1f}s")
        yield gateway, replicas, tiny_llama_dir.name
    finally:
        if gateway is not None:
            gateway.stop()
        for r in replicas:
            r.kill()


def chat(client, model: str, messages: list[dict], **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=messages, **kw)


def test_openai_sdk_through_smg(stack):
    gateway, replicas, model = stack
    client = gateway.client()
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = chat(client, model, messages)
    direct = pb2_grpc.GenerationStub(replicas[0].channel).Generate(
        pb2.GenerateRequest(
            chat=pb2.ChatInput(messages=[pb2.ChatMessage(role="user", content="Name a colour.")]),
            sampling=pb2.SamplingParams(temperature=0, max_new_tokens=8),
        )
    )
    assert reply.choices[0].message.content == direct.text  # smg's template and tokens = zerogap's
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
    deltas = [
        c.choices[0].delta.content or "" for c in chat(client, model, messages, stream=True) if c.choices
    ]
    assert "".join(deltas) == direct.text
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
    structured = chat(
        client, model, messages, max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )  # fmt: skip
    assert json.loads(structured.choices[0].message.content)["colour"] in ("red", "green")
    lp = chat(client, model, messages, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(lp) == 8 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    word = direct.text.split()[1] if len(direct.text.split()) > 1 else direct.text[2:5]
    stopped = chat(client, model, messages, stop=[word]).choices[0]
    assert stopped.finish_reason == "stop" and word not in stopped.message.content
    assert direct.text.startswith(stopped.message.content)
    seeded = [
        chat(client, model, messages, temperature=1.0, seed=s).choices[0].message.content for s in (5, 5, 6)
    ]
    assert seeded[0] == seeded[1] != seeded[2]


def test_multi_turn_conversations_stay_with_their_prefix(stack):
    """8 conversations x 4 turns behind a shared system prompt. The first turns come as one burst and
    reach both replicas; later turns, one at a time, are placed by whose admitted prompt tokens grew:
    they land where the conversation is cached, and their cached tokens reach past the shared part."""
    gateway, replicas, model = stack
    client = gateway.client()
    history = {c: [{"role": "system", "content": SYSTEM}] for c in range(8)}
    for c, messages in history.items():
        messages.append({"role": "user", "content": f"Conversation {c}: what should I read next?"})
    before = [r.prompt_tokens() for r in replicas]
    with ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(lambda m: chat(client, model, m, max_tokens=24), history.values()))
    grew = [r.prompt_tokens() > b for r, b in zip(replicas, before)]
    assert all(grew), f"a burst of new conversations all went to one replica: {grew}"
    shared = _shared_prefix_len(history)
    sticky = deep = total = 0
    home: dict[int, int] = {}
    for c, reply in zip(history, burst):
        history[c].append({"role": "assistant", "content": reply.choices[0].message.content})
    for turn in range(1, 4):
        for c, messages in history.items():
            messages.append({"role": "user", "content": f"Conversation {c}, question {turn}: tell me more."})
            before = [r.prompt_tokens() for r in replicas]
            reply = chat(client, model, messages, max_tokens=6)
            (where,) = [i for i, (r, b) in enumerate(zip(replicas, before)) if r.prompt_tokens() > b]
            cached = reply.usage.prompt_tokens_details.cached_tokens
            total += 1
            deep += cached > shared  # more than the system prompt: this conversation's own history
            sticky += home.setdefault(c, where) == where
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    print(f"turns 2-4: {deep}/{total} cached past the shared {shared} tokens, {sticky}/{total} on their home")
    assert deep / total >= 0.9 and sticky / total >= 0.9, (deep, sticky, total, shared)


def _shared_prefix_len(history: dict[int, list[dict]]) -> int:
    """Tokens every conversation's first prompt shares: the system prompt and the template around it."""
    from transformers import AutoTokenizer

    from service.model_prep import prepare_default_model

    tok = AutoTokenizer.from_pretrained(prepare_default_model())  # the tiny models carry SmolLM2's tokenizer
    ids = [
        tok.apply_chat_template(m[:2], add_generation_prompt=True, tokenize=True) for m in history.values()
    ]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    n = 0
    while all(len(x) > n and x[n] == ids[0][n] for x in ids):
        n += 1
    return n


def test_a_killed_replica_is_routed_around_and_used_again_once_restarted(stack):
    gateway, replicas, model = stack
    client = gateway.client()
    victim, survivor = replicas
    results: list[tuple[float, str]] = []  # (start time, "ok" | error class)
    stop = threading.Event()

    def load(i: int) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                stream = chat(client, model, [{"role": "user", "content": f"load {i} {t0}"}], max_tokens=48,
                              stream=True)  # fmt: skip
                for _ in stream:
                    pass
                results.append((t0, "ok"))
            except Exception as e:  # noqa: BLE001 - the kind of failure is what is checked
                results.append((t0, type(e).__name__))
                time.sleep(0.2)

    with ThreadPoolExecutor(4) as pool:
        for i in range(4):
            pool.submit(load, i)
        assert wait_until(lambda: len(results) >= 4, 60, 0.05)
        killed_at = time.monotonic()
        victim.kill()
        assert wait_until(lambda: sum(1 for t, _ in results if t > killed_at + 3) >= 8, 60, 0.05)
        stop.set()
    after = [r for t, r in results if t > killed_at + 3]
    print(f"{len(results)} requests under load, failed: {[r for _, r in results if r != 'ok']}")
    failed = [r for _, r in results if r != "ok"]
    assert all(r == "ok" for r in after), after
    assert len(failed) <= 4, failed  # at most the requests in flight on the dead replica
    assert all(
        r in ("APIError", "InternalServerError", "APIStatusError", "ServiceUnavailableError") for r in failed
    )

    victim.start()
    victim.wait_ready()
    before = victim.prompt_tokens()

    def reached() -> bool:
        chat(client, model, [{"role": "user", "content": f"back {time.monotonic()}"}], max_tokens=2)
        return victim.prompt_tokens() > before

    assert wait_until(reached, 60, 0.1), "the restarted replica gets no requests"
    assert survivor.prompt_tokens() > 0
