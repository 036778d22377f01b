"""The docker-compose stack, built and run for real (marker `compose`).

tests/test_stack.py checks the same files without Docker; this module builds the
image (Dockerfile), brings docker-compose.yml up with Docker Engine and Compose
— the plain stack with both Compose v2 (`docker compose`) and v1.29
(`docker-compose --compatibility`, Debian bookworm's), the TLS stack with v2 —
and talks to it from the host:

* health through the LB; gRPC Generate and GenerateStream through the LB reach
  both replicas (the LB's access log names the upstream of every call);
* the OpenAI SDK through the gateway: chat, stream, response_format json_schema;
* one replica stopped: calls through the LB and the gateway keep succeeding;
* `down` leaves no container, network or volume of the project;
* deploy/compose.tls.yml on top: TLS to the LB, mutual TLS between the LB and
  the replicas (a replica refuses a client without a certificate), the gateway
  over TLS;
* deploy/compose.smg.yml on top (its smg image built too; v2 where there is one): SMG in
  front of worker-a and worker-b, the OpenAI SDK through it, new conversations
  reaching both workers and later turns finding their history cached.

Compose v2 where no Docker repository supplies it: .ci/compose-v2.sh (Debian
trixie's package, unpacked beside v1). Base images that no registry supplies are
made by .ci/base-images.sh (Debian
bookworm via debootstrap, tagged python:3.11-slim and nginx:1.27). A
torch-2.13.0+cpu wheel found in $PIP_FIND_LINKS or /opt/wheels is linked into
.wheels/ so that the build needs no access to the CPU wheel index.

Without Docker the module is skipped with what to install; under CI (CI set)
a missing tool fails it instead. Host ports are free ones on 127.0.0.1; each
run uses its own compose project name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service import healthcheck
from tests.helpers import free_port, person_as_json, wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
BUILD_TIMEOUT_S = 2400  # a cold build on 2 busy cores: deps, model conversion
UP_TIMEOUT_S = 600  # two replicas loading the model on 2 cores, then the LB and the gateway
INSTALL = "apt-get install docker.io docker-compose (.ci/run installs them and starts dockerd)"
INSTALL_COMPOSE = {
    "v1": "apt-get install docker-compose (Debian bookworm's Compose 1.29)",
    "v2": "the `docker compose` plugin: Docker's docker-compose-plugin, or .ci/compose-v2.sh (as root)",
}
HI = [{"role": "user", "content": "Say hi."}]

_timings: dict[str, float] = {}


def _need(ok: bool, msg: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def _run(
    cmd: list[str], timeout: float, env: dict | None = None, check: bool = True, **kw
) -> subprocess.CompletedProcess:
    r = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if check and r.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        )
    return r


def _compose_commands() -> dict[str, list[str]]:
    """The Compose CLIs installed, by major version: "v2" (the `docker compose` plugin, or a v2
    `docker-compose`), "v1" (`docker-compose` 1.x, given --compatibility: deploy.replicas)."""
    found: dict[str, list[str]] = {}
    if _run(["docker", "compose", "version"], 30, check=False).returncode == 0:
        found["v2"] = ["docker", "compose"]
    exe = shutil.which("docker-compose")
    if exe is not None:
        out = _run([exe, "version", "--short"], 30, check=False).stdout.strip()
        if out.startswith("1."):
            found["v1"] = [exe, "--compatibility"]
        else:
            found.setdefault("v2", [exe])
    return found


@pytest.fixture(scope="module")
def compose_cmds() -> dict[str, list[str]]:
    _need(shutil.which("docker") is not None, f"docker not installed: {INSTALL}")
    info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], 30, check=False)
    if info.returncode != 0:
        why = " ".join(info.stderr.split())[:160]
        if shutil.which("dockerd") is None:
            _need(False, f"no Docker daemon answers and none is installed: {INSTALL} [{why}]")
        _need(False, f"no Docker daemon answers: start it as root (`dockerd &`; .ci/run does) [{why}]")
    cmds = _compose_commands()
    _need(bool(cmds), f"neither `docker compose` nor docker-compose installed: {INSTALL}")
    return cmds


@pytest.fixture(scope="module")
def compose_cmd(compose_cmds) -> list[str]:
    """The Compose that builds the image and runs the TLS stack: v2 where there is one."""
    return compose_cmds.get("v2") or compose_cmds["v1"]


@pytest.fixture(scope="module")
def image(compose_cmd, request) -> str:
    """zerogap:local built from this checkout (base images made first when no registry has them)."""
    missing = [
        i
        for i in ("python:3.11-slim", "nginx:1.27")
        if _run(["docker", "image", "inspect", i], 30, check=False).returncode != 0
    ]
    if missing:
        r = _run(["bash", str(ROOT / ".ci" / "base-images.sh")], 1200, check=False)
        _need(
            r.returncode == 0,
            f"base images {missing} unavailable (no registry, and .ci/base-images.sh "
            f"needs root and debootstrap): {r.stderr.strip()[-300:]}",
        )
    wheels = ROOT / ".wheels"
    if not list(wheels.glob("torch-2.13.0+cpu-*.whl")):
        dirs = [d for d in os.environ.get("PIP_FIND_LINKS", "").split() if d] + ["/opt/wheels"]
        found = next((Path(d) / TORCH_WHEEL for d in dirs if (Path(d) / TORCH_WHEEL).is_file()), None)
        if found is not None:
            try:
                os.link(found, wheels / TORCH_WHEEL)
            except OSError:
                shutil.copy(found, wheels / TORCH_WHEEL)
    t0 = time.monotonic()
    _run([*compose_cmd, "-p", "zerogap-build", "build", "zerogap"], BUILD_TIMEOUT_S)
    _timings["image build"] = time.monotonic() - t0
    return "zerogap:local"


class Stack:
    """One compose project (its own name and host ports) of docker-compose.yml [+ overrides]."""

    def __init__(self, compose_cmd: list[str], name: str, files: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.cmd = [*compose_cmd, "-p", name] + [a for f in files for a in ("-f", f)]
        self.env = {**os.environ, "ZEROGAP_AUTH_TOKENS": "", **env}
        self.up_done = False

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.cmd, *args], timeout, env=self.env, check=check)

    def up(self, *services: str) -> float:
        """`up -d` of every service, or of `services` and what they depend on."""
        t0 = time.monotonic()
        self.up_done = True
        self.compose("up", "-d", "--no-build", *services, timeout=UP_TIMEOUT_S)
        return time.monotonic() - t0

    def down(self) -> None:
        if self.up_done:
            self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180, check=False)

    def containers(self, service: str) -> list[str]:
        """The running containers of `service` (compose v1's `ps -q` lists stopped ones too)."""
        labels = [
            f"label=com.docker.compose.project={self.name}",
            f"label=com.docker.compose.service={service}",
        ]
        return sorted(
            _run(
                ["docker", "ps", "-q", "--no-trunc", *(a for f in labels for a in ("--filter", f))], 30
            ).stdout.split()
        )

    def ip(self, container: str) -> str:
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
        return _run(["docker", "inspect", "-f", fmt, container], 30).stdout.split()[0]

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, timeout=60).stdout

    def tail_logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", timeout=60, check=False).stdout[-8000:]

    def upstreams(self, method: str) -> set[str]:
        """Replica IPs the LB sent `zerogap.v1.Generation/<method>` calls to (its access log)."""
        pat = re.compile(
            rf'"POST /zerogap\.v1\.Generation/{method} HTTP/2\.0" \d+ grpc-status=\S* upstream=(.*?) rt='
        )
        return {
            a.strip().rsplit(":", 1)[0] for m in pat.finditer(self.logs("lb")) for a in m.group(1).split(",")
        }

    def leftovers(self) -> list[str]:
        """Containers (running or not), networks and volumes of the project, by label and by name."""
        label = f"label=com.docker.compose.project={self.name}"
        out = []
        for kind, field, extra in (
            ("container", "{{.Names}}", ["-a"]),
            ("network", "{{.Name}}", []),
            ("volume", "{{.Name}}", []),
        ):
            names = _run(["docker", kind, "ls", *extra, "--format", field], 30).stdout.split()
            out += [f"{kind} {n}" for n in names if n.startswith((f"{self.name}_", f"{self.name}-"))]
            labelled = _run(["docker", kind, "ls", *extra, "--filter", label, "--format", field], 30)
            out += [f"{kind} {n}" for n in labelled.stdout.split()]
        return sorted(set(out))


def _gateway_health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as r:
            return r.status == 200
    except OSError:
        return False


def _lb_serving(port: int, sec: healthcheck.Security) -> bool:
    try:
        return healthcheck.check("127.0.0.1", port, timeout=3, sec=sec) == "SERVING"
    except grpc.RpcError:
        return False


def _bring_up(stack: Stack, lb_port: int, gw_port: int, sec: healthcheck.Security, what: str) -> None:
    """`up -d`, then wait for the LB's health and the gateway; on failure: the logs, and down."""
    t0 = time.monotonic()
    try:
        try:
            _timings[f"{what} `up -d`"] = stack.up()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{stack.tail_logs()}") from None
        ready = wait_until(lambda: _lb_serving(lb_port, sec) and _gateway_health(gw_port), 180, 1.0)
        _timings[f"{what} up to LB and gateway ready"] = time.monotonic() - t0
        assert ready, f"the stack did not become ready:\n{stack.compose('ps').stdout}\n{stack.tail_logs()}"
    except BaseException:
        stack.down()
        raise


@pytest.fixture(scope="module")
def timings(request):
    yield _timings
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is not None and capture is not None and _timings:
        with capture.global_and_fixture_disabled():  # shown on the terminal, not captured
            tr.write_line("\ncompose stack: " + ", ".join(f"{k} {v:.0f} s" for k, v in _timings.items()))


@pytest.fixture(scope="module", params=["v2", "v1"])
def stack(request, compose_cmds, image, timings):
    """The plain stack, once with each Compose (one project at a time)."""
    version = request.param
    _need(version in compose_cmds, f"Compose {version} not installed: {INSTALL_COMPOSE[version]}")
    lb, gw = free_port(), free_port()
    s = Stack(
        compose_cmds[version],
        f"zgtest{os.getpid()}{version}",
        ["docker-compose.yml"],
        {"ZEROGAP_LB_PORT": f"127.0.0.1:{lb}", "ZEROGAP_GATEWAY_PORT": f"127.0.0.1:{gw}"},
    )
    s.lb_port, s.gw_port = lb, gw
    _bring_up(s, lb, gw, healthcheck.Security(), f"stack (Compose {version})")
    try:
        yield s
    finally:
        s.down()


# --------------------------------------------------------------------------
# The plain stack: two replicas, nginx, the gateway


def test_health_through_the_lb(stack) -> None:
    assert healthcheck.main(["--host", "127.0.0.1", "--port", str(stack.lb_port)]) == 0
    assert len(stack.containers("zerogap")) == 2, stack.compose("ps").stdout
    assert _gateway_health(stack.gw_port)
    # The smoke client of the compose file (profile "client"), on the compose network.
    r = stack.compose("run", "--rm", "--no-deps", "client", timeout=120, check=False)
    assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr


def test_generate_and_stream_reach_both_replicas(stack) -> None:
    from zerogap.client import GREEDY, Client

    replicas = {stack.ip(c) for c in stack.containers("zerogap")}
    assert len(replicas) == 2
    with Client(f"127.0.0.1:{stack.lb_port}", timeout=120) as c:
        done = [c.generate("Once upon a time", GREEDY, max_new_tokens=8) for _ in range(6)]
        streams = []
        for _ in range(6):
            deltas = list(c.stream("Once upon a time", GREEDY, max_new_tokens=8))
            streams.append(deltas)
    assert {d.text for d in done} == {done[0].text} and done[
        0
    ].completion_tokens == 8  # both serve the same model
    for deltas in streams:
        assert len(deltas) > 1 and "".join(d.text for d in deltas) == done[0].text
    methods = ("Generate", "GenerateStream")
    assert wait_until(lambda: all(replicas <= stack.upstreams(m) for m in methods), 10, 0.5), (
        replicas,
        {m: stack.upstreams(m) for m in methods},
    )


def test_openai_sdk_through_the_gateway(stack) -> None:
    import openai

    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.gw_port}/v1", api_key="unused", max_retries=0, timeout=120
    ) as oai:
        model = oai.models.list().data[0].id
        # Round robin: one call per replica first, so that the two compared below both find the
        # prompt cached. A cached prompt's last row is computed alone, a cold one among the prompt's
        # 33 rows, and the matmul kernels round apart by row count (bf16 here by default): greedy
        # tokens may then differ at a near-tie, as in any server with a prefix cache.
        for _ in range(2):
            oai.chat.completions.create(model=model, messages=HI, max_tokens=1, temperature=0)
        r = oai.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        chunks = list(
            oai.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0, stream=True)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(chunks) > 2 and text == r.choices[0].message.content
        person_as_json(oai, model)


def test_stopping_one_replica_keeps_calls_succeeding(stack) -> None:
    import openai

    from zerogap.client import GREEDY, Client

    victim, survivor = stack.containers("zerogap")
    _run(["docker", "stop", "-t", "10", victim], 60)
    assert stack.containers("zerogap") == [survivor]
    with Client(f"127.0.0.1:{stack.lb_port}", timeout=60) as c:
        for _ in range(6):
            assert c.generate("Once upon a time", GREEDY, max_new_tokens=4).completion_tokens == 4
            assert "".join(d.text for d in c.stream("Hello", GREEDY, max_new_tokens=4))
    for _ in range(3):  # fresh connections too
        assert healthcheck.check("127.0.0.1", stack.lb_port, timeout=30) == "SERVING"
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.gw_port}/v1", api_key="unused", max_retries=0, timeout=60
    ) as oai:
        for _ in range(3):
            r = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=HI, max_tokens=4)
            assert r.usage.completion_tokens > 0
    assert stack.ip(survivor) in stack.upstreams("Generate")


def test_down_leaves_nothing(stack) -> None:
    assert stack.leftovers(), "the running stack should be visible by its project name"
    stack.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180)
    assert stack.leftovers() == []


# --------------------------------------------------------------------------
# deploy/compose.tls.yml: TLS to the LB, mutual TLS inside

_NO_CLIENT_CERT = """
import grpc, sys
from grpc_health.v1 import health_pb2, health_pb2_grpc
ca = open("/certs/ca.pem", "rb").read()
opts = [("grpc.ssl_target_name_override", "zerogap")]
for creds in (grpc.ssl_channel_credentials(ca), None):
    addr = "127.0.0.1:50051"
    ch = grpc.secure_channel(addr, creds, opts) if creds else grpc.insecure_channel(addr)
    try:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        print("ACCEPTED"); sys.exit(1)
    except grpc.RpcError as e:
        print("REFUSED", e.code().name)
"""


@pytest.fixture(scope="module")
def tls_stack(compose_cmd, image, timings, tmp_path_factory):
    _need(shutil.which("openssl") is not None, "openssl not installed: apt-get install openssl")
    certs = tmp_path_factory.mktemp("stack-certs")
    _run(["sh", str(ROOT / "deploy" / "make-certs.sh"), str(certs)], 60)
    certs.chmod(0o755)  # mounted into the containers, read by their non-root users
    lb, gw = free_port(), free_port()
    s = Stack(
        compose_cmd,
        f"zgtls{os.getpid()}",
        ["docker-compose.yml", "deploy/compose.tls.yml"],
        {
            "ZEROGAP_LB_PORT": f"127.0.0.1:{free_port()}",
            "ZEROGAP_GATEWAY_PORT": f"127.0.0.1:{gw}",
            "ZEROGAP_TLS_PORT": f"127.0.0.1:{lb}",
            "ZEROGAP_CERTS": str(certs),
        },
    )
    s.lb_port, s.gw_port, s.certs = lb, gw, certs
    s.sec = healthcheck.Security(tls_ca=str(certs / "ca.pem"), tls_server_name="lb")
    _bring_up(s, lb, gw, s.sec, "TLS stack")
    try:
        yield s
    finally:
        s.down()


def test_tls_stack_mutual_tls_inside(tls_stack) -> None:
    s = tls_stack
    replicas = {s.ip(c) for c in s.containers("zerogap")}
    assert len(replicas) == 2
    with healthcheck.channel(f"127.0.0.1:{s.lb_port}", s.sec) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        for _ in range(4):
            r = stub.Generate(
                pb2.GenerateRequest(text="Once upon a time", sampling=pb2.SamplingParams(max_new_tokens=4)),
                timeout=60,
            )
            assert len(r.token_ids) == 4
    assert wait_until(lambda: replicas <= s.upstreams("Generate"), 10, 0.5), (
        replicas,
        s.upstreams("Generate"),
    )
    with grpc.insecure_channel(f"127.0.0.1:{s.lb_port}") as ch, pytest.raises(grpc.RpcError):  # plaintext
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    # Inside the network: a replica refuses TLS without a client certificate, and plaintext.
    r = _run(
        ["docker", "exec", "-i", s.containers("zerogap")[0], "python", "-"],
        60,
        input=_NO_CLIENT_CERT,
        check=False,
    )
    assert r.returncode == 0 and r.stdout.count("REFUSED") == 2, r.stdout + r.stderr


def test_tls_stack_gateway_and_down(tls_stack) -> None:
    import openai

    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{tls_stack.gw_port}/v1", api_key="unused", max_retries=0, timeout=120
    ) as oai:
        r = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=HI, max_tokens=6)
        assert r.choices[0].message.content
    tls_stack.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180)
    assert tls_stack.leftovers() == []


# --------------------------------------------------------------------------
# deploy/compose.smg.yml: SMG in front of two workers, routing by their prefix caches

SMG_SYSTEM = "You are a terse assistant. Answer in one short sentence and never apologise for anything."


def _smg_workers(port: int) -> list[dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=4) as r:
            body = json.loads(r.read())
    except (OSError, ValueError):
        return []
    return body.get("workers", body) if isinstance(body, dict) else body


def _smg_client(port: int):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def _smg_answers(port: int) -> bool:
    """Both workers registered healthy, and a chat answered (the tokenizer comes from a worker)."""
    if sum(1 for w in _smg_workers(port) if w.get("is_healthy", True)) < 2:
        return False
    try:
        with _smg_client(port) as oai:
            oai.chat.completions.create(model=oai.models.list().data[0].id, messages=HI, max_tokens=1)
        return True
    except Exception:  # noqa: BLE001 - 503 until the tokenizer is loaded
        return False


@pytest.fixture(scope="module")
def smg_stack(compose_cmd, image, timings):
    """The override's smg service (its image built here) with worker-a and worker-b it depends on."""
    port = free_port()
    s = Stack(
        compose_cmd,
        f"zgsmg{os.getpid()}",
        ["docker-compose.yml", "deploy/compose.smg.yml"],
        {"ZEROGAP_SMG_PORT": f"127.0.0.1:{port}"},
    )
    s.smg_port = port
    t0 = time.monotonic()
    s.compose("build", "smg", timeout=BUILD_TIMEOUT_S)
    _timings["smg image build"] = time.monotonic() - t0
    try:
        try:
            _timings["SMG stack `up -d`"] = s.up("smg")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.tail_logs()}") from None
        ready = wait_until(lambda: _smg_answers(port), 300, 1.0)
        _timings["SMG stack up to both workers and a chat"] = time.monotonic() - t0
        assert ready, f"smg did not serve:\n{s.compose('ps').stdout}\n{s.tail_logs()}"
        yield s
    finally:
        s.down()


def _prompt_tokens(ip: str) -> int:
    """What a worker has admitted (the prompt tokens its prefix cache has seen), over gRPC."""
    with grpc.insecure_channel(f"{ip}:50051") as ch:
        info = pb2_grpc.GenerationStub(ch).GetServerInfo(pb2.GetServerInfoRequest(), timeout=10)
    return info.prefix_cache_prompt_tokens


def test_smg_stack_serves_the_openai_api_and_keeps_conversations_on_their_worker(smg_stack) -> None:
    s = smg_stack
    workers = _smg_workers(s.smg_port)
    assert {(w["runtime_type"], w["connection_mode"]) for w in workers} == {("vllm", "grpc")}, workers
    ips = [s.ip(c) for service in ("worker-a", "worker-b") for c in s.containers(service)]
    assert len(ips) == 2
    with _smg_client(s.smg_port) as oai:
        model = oai.models.list().data[0].id
        r = oai.chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        chunks = list(oai.chat.completions.create(model=model, messages=HI, max_tokens=8, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        person_as_json(oai, model)

        # Eight conversations behind a shared system prompt: the first turns in flight together
        # (spread over both workers by their loads), then two more turns each, one at a time.
        history = {
            c: [
                {"role": "system", "content": SMG_SYSTEM},
                {"role": "user", "content": f"Conversation {c}: what should I read next?"},
            ]
            for c in range(8)
        }
        before = [_prompt_tokens(ip) for ip in ips]

        def first_turn(messages: list[dict]):
            return oai.chat.completions.create(
                model=model, messages=messages, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(first_turn, history.values()))
        reached = [_prompt_tokens(ip) > b for ip, b in zip(ips, before)]
        assert all(reached), f"the first turns went to one worker only: {reached}"
        last = {c: reply.usage.prompt_tokens for c, reply in zip(history, replies)}
        for c, reply in zip(history, replies):
            history[c].append({"role": "assistant", "content": reply.choices[0].message.content})
        whole, turns = 0, 0
        for turn in (1, 2):  # sixteen later turns
            for c, messages in history.items():
                messages.append(
                    {"role": "user", "content": f"Conversation {c}, question {turn}: tell me more."}
                )
                reply = oai.chat.completions.create(
                    model=model, messages=messages, max_tokens=6, temperature=0
                )
                turns += 1
                whole += reply.usage.prompt_tokens_details.cached_tokens >= last[c]  # its worker has it all
                last[c] = reply.usage.prompt_tokens
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert whole >= turns - 1, f"{whole} of {turns} later turns found their previous prompt cached"
    with urllib.request.urlopen(f"http://127.0.0.1:{s.smg_port}/get_loads", timeout=10) as r:
        loads = json.loads(r.read())["loads"]
    assert len(loads) == 2, loads  # each worker's load


def test_smg_stack_down_leaves_nothing(smg_stack) -> None:
    smg_stack.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180)
    assert smg_stack.leftovers() == []
