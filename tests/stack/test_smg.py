"""The real SMG gateway (`smg launch`, PyPI `smg`) in front of two zerogap replicas on loopback, driven
with the official OpenAI SDK: the API's fields, cache-aware routing of multi-turn conversations
(KV events from each replica's prefix cache), and a replica killed under load and restarted."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from tests.helpers import NEEDS, free_port, wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
LONG = {"ignore_eos": True}  # SMG's extension: the burst's requests stay in flight together
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

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 10) -> int | None:
        """Send `sig` and wait for the exit (its code; None when it had already exited). One that
        outlives `timeout` is killed (its port freed for a restart) and the test fails."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"{self.name} did not exit within {timeout} s of signal {sig}") from None
        if self.channel is not None:
            self.channel.close()
        return code


class Gateway:
    """`smg launch` in front of the replicas, given as grpc:// URLs, or with `discovery` set, as the bare
    ip:port entries of a discovery manifest file (what its Kubernetes discovery registers for a pod:
    the gateway then probes HTTP and gRPC to tell which the worker speaks)."""

    def __init__(
        self,
        replicas: list[Replica],
        model_dir: Path,
        tmp: Path,
        policy: str = "cache_aware",
        *extra: str,
        discovery: bool = False,
    ):
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = tmp / f"smg-{policy}{''.join(extra)}{'-discovery' if discovery else ''}.log"
        if discovery:
            manifest = tmp / "workers.json"
            manifest.write_text(
                json.dumps({"version": 1, "workers": [{"url": f"127.0.0.1:{r.port}"} for r in replicas]})
            )
            workers = ["--discovery-provider", "file", "--discovery-file", str(manifest)]
        else:
            workers = ["--worker-urls", *[f"grpc://127.0.0.1:{r.port}" for r in replicas]]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port), *workers,
             "--model-path", str(model_dir), "--policy", policy,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
             "--balance-abs-threshold", "1", "--log-level", "warn", *extra],
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
    workers = gateway.workers()
    assert {(w["runtime_type"], w["connection_mode"], w["labels"]["page_size"]) for w in workers} == {
        ("vllm", "grpc", "16")
    }  # the contract SMG detected, and the KV event block size it took from GetServerInfo
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
    several = chat(client, model, messages, temperature=1.0, seed=5, n=3)  # n samples: one call, indexed
    assert sorted(c.index for c in several.choices) == [0, 1, 2] and several.usage.completion_tokens == 24
    texts = {c.index: c.message.content for c in several.choices}
    assert texts[0] == seeded[0] and len(set(texts.values())) == 3
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for c in chat(client, model, messages, temperature=1.0, seed=5, n=3, stream=True):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]  # fmt: skip


@pytest.mark.parametrize("parser", ["none", "mistral"])
def test_tool_calls_through_smg(stack, tmp_path, parser):
    """SMG turns tool_choice required / a named function into a constraint on the worker: a JSON
    schema (the array of calls, or the named function's parameters), or with a tool-call parser
    that has one (mistral here) a structural tag; it parses the calls out of the constrained
    output, plain and streamed."""
    import jsonschema

    gateway, replicas, model = stack
    if parser != "none":
        gateway = Gateway(
            replicas, Path(replicas[0].model_dir), tmp_path, "cache_aware", "--tool-call-parser", parser
        )
    try:
        if parser != "none":
            gateway.wait_ready(2)
        client = gateway.client()
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):
            reply = chat(client, model, messages, tools=TOOLS, tool_choice=choice, max_tokens=120)
            calls = [
                (c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []
            ]
            # after a tag, free text may follow (a random model does not stop): then "length"
            ends = ("tool_calls",) if parser == "none" else ("tool_calls", "length")
            assert calls and reply.choices[0].finish_reason in ends, reply.choices[0]
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), schemas[name])
            if choice is named:
                assert {name for name, _ in calls} == {"get_weather"}
            streamed: dict[int, list[str]] = {}
            for chunk in chat(
                client, model, messages, tools=TOOLS, tool_choice=choice, max_tokens=120, stream=True
            ):
                for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    part = streamed.setdefault(call.index, ["", ""])
                    part[0] += (call.function and call.function.name) or ""
                    part[1] += (call.function and call.function.arguments) or ""
            assert [tuple(v) for _, v in sorted(streamed.items())] == calls
    finally:
        if parser != "none":
            gateway.stop()


def conversations(gateway: Gateway, replicas: list[Replica], model: str, n: int = 8, turns: int = 4):
    """n conversations x `turns` behind a shared system prompt. The first turns come as one burst;
    later turns one at a time, in a shuffled order each turn, each placed by whose admitted prompt
    tokens grew. Returns (replicas the burst reached, turns 2+ with cached tokens > 0, turns 2+ whose
    whole previous prompt was cached, turns 2+ on their conversation's replica, turns 2+)."""
    client, rng = gateway.client(), random.Random(25)
    history = {c: [{"role": "system", "content": SYSTEM}] for c in range(n)}
    for c, messages in history.items():
        messages.append({"role": "user", "content": f"Conversation {c}: what should I read next?"})
    before = [r.prompt_tokens() for r in replicas]
    with ThreadPoolExecutor(n) as pool:
        burst = list(
            pool.map(lambda m: chat(client, model, m, max_tokens=64, extra_body=LONG), history.values())
        )
    reached = sum(r.prompt_tokens() > b for r, b in zip(replicas, before))
    hit = whole = sticky = total = 0
    home: dict[int, int] = {}
    last_prompt = {c: reply.usage.prompt_tokens for c, reply in zip(history, burst)}
    for c, reply in zip(history, burst):
        history[c].append({"role": "assistant", "content": reply.choices[0].message.content})
    for turn in range(1, turns):
        for c in rng.sample(list(history), n):
            messages = history[c]
            messages.append({"role": "user", "content": f"Conversation {c}, question {turn}: tell me more."})
            before = [r.prompt_tokens() for r in replicas]
            reply = chat(client, model, messages, max_tokens=6)
            (where,) = [i for i, (r, b) in enumerate(zip(replicas, before)) if r.prompt_tokens() > b]
            cached = reply.usage.prompt_tokens_details.cached_tokens
            total += 1
            hit += cached > 0
            whole += cached >= last_prompt[c]  # the previous turn's prompt: only its replica has it all
            sticky += home.setdefault(c, where) == where
            last_prompt[c] = reply.usage.prompt_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return reached, hit, whole, sticky, total


def test_multi_turn_conversations_stay_with_their_prefix(stack):
    gateway, replicas, model = stack
    reached, hit, whole, sticky, total = conversations(gateway, replicas, model)
    print(
        f"cache_aware: of {total} turns 2-4, {hit} cached > 0, {whole} the whole previous prompt, {sticky} home"
    )
    assert reached == 2, "a burst of new conversations all went to one replica"
    assert min(hit, whole, sticky) / total >= 0.9, (hit, whole, sticky, total)


def test_workers_found_by_discovery_as_bare_addresses_register_as_grpc(stack, tmp_path):
    """Discovery (Kubernetes pods, or a manifest file) gives the gateway a bare ip:port; it probes HTTP and
    gRPC at once and takes HTTP if both answer: a replica's port must answer gRPC only."""
    _, replicas, model = stack
    found = Gateway(replicas, Path(replicas[0].model_dir), tmp_path, discovery=True)
    try:
        found.wait_ready(2)
        workers = found.workers()
        assert {(w["connection_mode"], w["runtime_type"]) for w in workers} == {("grpc", "vllm")}
        assert sorted(w["url"] for w in workers) == sorted(f"grpc://127.0.0.1:{r.port}" for r in replicas)
        assert (
            chat(
                found.client(), model, [{"role": "user", "content": "Name a colour."}]
            ).usage.completion_tokens
            == 8
        )
    finally:
        found.stop()


def test_round_robin_finds_the_history_about_half_the_time(stack, tmp_path):
    """The same workload through the same gateway with --policy round_robin, caches flushed first."""
    _, replicas, model = stack
    for r in replicas:
        flushed = vllm_engine_pb2_grpc.VllmEngineStub(r.channel).FlushCache(
            common_pb2.FlushCacheRequest(timeout_s=10), timeout=30
        )
        assert flushed.success, flushed.message
    rr = Gateway(replicas, Path(replicas[0].model_dir), tmp_path, policy="round_robin")
    try:
        rr.wait_ready(2)
        reached, hit, whole, _, total = conversations(rr, replicas, model)
    finally:
        rr.stop()
    print(
        f"round_robin: of {total} turns 2-4, {hit} cached > 0 (the system prompt), {whole} the whole previous prompt"
    )
    assert reached == 2 and whole / total < 0.85, (whole, total)  # about half; cache_aware: >= 0.9


def test_the_gateway_routes_by_the_loads_the_replicas_push(stack):
    """Each replica pushes its load on the KV event stream: the gateway's view follows a request
    within a scheduler step or so (its GetLoads poll comes every 10 s) and it skips the polls."""
    gateway, _, model = stack

    def running() -> int:
        with urllib.request.urlopen(f"{gateway.url}/get_loads", timeout=2) as r:
            return sum(load["num_running_reqs"] for load in json.loads(r.read())["loads"])

    def polls(mode: str) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=2) as r:
            lines = r.read().decode().splitlines()
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in lines
            if line.startswith("smg_engine_load_polls_total{") and f'mode="{mode}"' in line
        )

    assert wait_until(lambda: running() == 0, 10)
    stream = chat(gateway.client(), model, [{"role": "user", "content": "count slowly"}], max_tokens=200,
                  stream=True, extra_body=LONG)  # fmt: skip
    next(iter(stream))
    assert wait_until(lambda: running() == 1, 5, 0.02), "the gateway did not see the running request"
    stream.close()  # the gateway aborts it
    assert wait_until(lambda: running() == 0, 5, 0.02)
    assert wait_until(lambda: polls("skipped_fresh_push") > 0, 15, 0.5), "the gateway still polls"


@contextlib.contextmanager
def under_streaming_load(client, model: str, threads: int = 4) -> Iterator[list[tuple[float, str]]]:
    """`threads` clients streaming chats one after another; yields their results, (start time,
    "ok" | the error's class), as they come. They stop (each after its request) however the block
    ends, so a failing assertion inside does not leave the pool waiting for ever."""
    results: list[tuple[float, str]] = []
    stop = threading.Event()
    pool = ThreadPoolExecutor(threads)
    try:
        for i in range(threads):
            pool.submit(streaming_load, client, model, results, stop, i)
        yield results
    finally:
        stop.set()
        pool.shutdown(wait=True)


def streaming_load(client, model: str, results: list, stop: threading.Event, i: int) -> None:
    """Streamed chats one after another until `stop`: (start time, "ok" | the error's class)."""
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


def test_a_killed_replica_is_routed_around_and_used_again_once_restarted(stack):
    gateway, replicas, model = stack
    client = gateway.client()
    victim, survivor = replicas
    with under_streaming_load(client, model) as results:
        assert wait_until(lambda: len(results) >= 4, 60, 0.05)
        killed_at = time.monotonic()
        victim.kill()
        assert wait_until(lambda: sum(1 for t, _ in results if t > killed_at + 3) >= 8, 60, 0.05)
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


def test_a_replica_drained_under_load_fails_no_request(stack):
    """A rolling restart: SIGTERM drains a replica (in-flight requests finish, new ones get
    UNAVAILABLE, which SMG retries on the other replica): no request fails, and the replica exits 0."""
    gateway, replicas, model = stack
    client = gateway.client()
    victim = replicas[0]
    try:
        with under_streaming_load(client, model) as results:
            assert wait_until(lambda: len(results) >= 4, 60, 0.05)
            drained_at = time.monotonic()
            assert victim.kill(signal.SIGTERM, timeout=60) == 0, victim.log_path.read_text()[-3000:]
            assert wait_until(lambda: sum(1 for t, _ in results if t > drained_at) >= 8, 60, 0.05)
        failed = [r for _, r in results if r != "ok"]
        print(f"{len(results)} requests under load, {len(failed)} failed across the drain")
        assert failed == [], failed
        assert "shutting down" in victim.log_path.read_text()
    finally:
        victim.kill()  # a no-op once it exited
        victim.start()
        victim.wait_ready()
