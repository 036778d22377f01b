"""The container stack, checked without Docker.

* docker-compose.yml validates against the Compose Specification (the schema
  vendored in check-jsonschema) and wires what the stack needs: healthchecked
  replicas, an LB that waits for them, the smoke client.
* deploy/nginx.conf is run by the system nginx (Debian package `nginx`) in
  front of two real in-process gRPC health servers on loopback: calls are
  balanced round robin, fail over when a backend dies, and end with a gRPC
  UNAVAILABLE (not an HTML page) when none is left.
* `python -m service healthcheck` (service.healthcheck.main) returns 0 only
  for SERVING.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service import healthcheck
from tests.helpers import need_tools

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
DOCKERFILE = ROOT / "Dockerfile"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# --------------------------------------------------------------------------
# Compose file


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_validates_against_compose_spec() -> None:
    exe = Path(sys.executable).parent / "check-jsonschema"
    if not exe.exists():
        pytest.skip(f"check-jsonschema not installed next to {sys.executable} (pip install -e '.[test]')")
    r = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_wiring() -> None:
    svc = _compose()["services"]
    app, lb, client = svc["zerogap"], svc["lb"], svc["client"]

    assert app["build"] == "."
    assert app["deploy"]["replicas"] == 2
    assert "ports" not in app, "replicas must not publish a fixed host port"
    hc = app["healthcheck"]
    assert hc["test"][:4] == ["CMD", "python", "-m", "service"] and "healthcheck" in hc["test"]
    assert "start_period" in hc

    assert lb["image"].startswith("nginx:")
    assert lb["depends_on"]["zerogap"]["condition"] == "service_healthy"
    assert any(v.split(":")[:2] == ["./deploy/nginx.conf", "/etc/nginx/nginx.conf"] for v in lb["volumes"])
    assert any(str(p).split(":")[-1] == "8080" for p in lb["ports"])

    assert client["profiles"] == ["client"]
    assert client["image"] == app["image"]
    cmd = client["command"]
    assert cmd[:4] == ["python", "-m", "service", "healthcheck"]
    assert cmd[cmd.index("--host") + 1] == "lb" and cmd[cmd.index("--port") + 1] == "8080"


def test_compose_gateway_sits_behind_the_lb() -> None:
    svc = _compose()["services"]
    gw = svc["gateway"]
    assert gw["image"] == svc["zerogap"]["image"]
    cmd = gw["command"]
    assert cmd[:4] == ["python", "-m", "service", "gateway"]
    assert cmd[cmd.index("--grpc") + 1] == "lb:8080", "the gateway must reach the replicas through the LB"
    port = cmd[cmd.index("--port") + 1]
    assert (
        any(str(p).split(":")[-1] == port for p in gw["ports"]) and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    )
    assert "lb" in gw["depends_on"] and f":{port}/health" in " ".join(gw["healthcheck"]["test"])


def test_nginx_conf_matches_compose() -> None:
    conf = NGINX_CONF.read_text()
    # The upstream is the compose service name at the port the image serves on,
    # and nginx listens (HTTP/2 cleartext) on the port compose publishes.
    assert re.search(r"^\s*server zerogap:50051\b[^;]*;", conf, re.M)
    assert re.search(r"^\s*listen 8080 http2;", conf, re.M)
    assert re.search(r"grpc_pass grpc://zerogap;", conf)


def test_dockerfile_essentials() -> None:
    text = DOCKERFILE.read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"torch=={torch_pin} --index-url https://download.pytorch.org/whl/cpu" in text
    assert "python -m service prepare-model" in text
    assert re.search(r"^USER (?!root)\S+", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*python\", \"-m\", \"service\", \"healthcheck\"", text, re.M)
    assert re.search(r"^EXPOSE 50051\b", text, re.M)
    assert "COPY clients/python ./clients/python" in text  # the client distribution: the stubs
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".venv", ".git", "service/_gen"):
        assert entry in ignored


# --------------------------------------------------------------------------
# In-process gRPC health backends


class _TaggedHealth(health.HealthServicer):
    """HealthServicer that counts its Check calls and names itself in trailers."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.hits = 0
        self._lock = threading.Lock()

    def Check(self, request, context):  # noqa: N802 (gRPC method name)
        with self._lock:
            self.hits += 1
        context.set_trailing_metadata((("x-backend", self.name),))
        return super().Check(request, context)


class _Backend:
    def __init__(self, name: str, status: int = SERVING) -> None:
        self.servicer = _TaggedHealth(name)
        self.servicer.set("", status)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        assert self.port
        self.server.start()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.server.stop(grace=None).wait(5)


@pytest.fixture
def backends():
    bs = [_Backend("backend-a"), _Backend("backend-b")]
    try:
        yield bs
    finally:
        for b in bs:
            b.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# nginx in front of them


def _nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )


def render_nginx_conf(upstreams: list[int], listen_port: int, tmp: Path, conf: str | None = None) -> str:
    """deploy/nginx.conf for loopback backends, listening on listen_port.

    Two text substitutions on the production file (its upstream server line,
    once per backend, and its listen line) plus temp paths under tmp, so
    nothing outside tmp is written.
    """
    conf = NGINX_CONF.read_text() if conf is None else conf
    server_line = re.search(r"^(\s*)server zerogap:50051\b([^;]*);\n", conf, re.M)
    listen_line = re.search(r"^(\s*)listen 8080 http2;\n", conf, re.M)
    assert server_line and listen_line, "deploy/nginx.conf changed shape: update render_nginx_conf"
    indent, params = server_line.group(1), server_line.group(2)
    servers = "".join(f"{indent}server 127.0.0.1:{p}{params};\n" for p in upstreams)
    conf = conf.replace(server_line.group(0), servers)
    listen = f"{listen_line.group(1)}listen 127.0.0.1:{listen_port} http2;\n"
    conf = conf.replace(listen_line.group(0), listen)
    temps = "".join(
        f"    {kind}_temp_path {tmp / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf, n = re.subn(r"^http \{\n", "http {\n" + temps, conf, count=1, flags=re.M)
    assert n == 1
    return conf


class _Nginx:
    def __init__(self, binary: str, conf: str, tmp: Path, port: int) -> None:
        self.port = port
        self.tmp = tmp
        conf_path = tmp / "nginx.conf"
        conf_path.write_text(conf)
        self.log_path = tmp / "nginx.log"
        self._log = open(self.log_path, "wb")
        # Single process in the foreground: no daemon, no workers to orphan, no
        # privilege drop when the tests run as root.
        self.proc = subprocess.Popen(
            [
                binary,
                "-e",
                "stderr",
                "-p",
                str(tmp),
                "-c",
                str(conf_path),
                "-g",
                f"daemon off; master_process off; pid {tmp / 'nginx.pid'};",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@pytest.fixture
def nginx_lb(backends, tmp_path):
    binary = _nginx_binary()
    if binary is None:
        need_tools(["nginx"], "apt-get install nginx")
    for attempt in range(3):  # the free port may be taken in between: retry
        port = _free_port()
        conf = render_nginx_conf([b.port for b in backends], port, tmp_path)
        lb = _Nginx(binary, conf, tmp_path, port)
        if lb.wait_ready():
            break
        lb.stop()
        if attempt == 2:
            pytest.fail(f"nginx did not start:\n{lb.log()}")
    try:
        yield lb
    finally:
        lb.stop()


def _check_via(port: int, service: str = "") -> tuple[int, str | None]:
    """(status, answering backend) of one Health/Check on a fresh channel."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp, call = health_pb2_grpc.HealthStub(ch).Check.with_call(
            health_pb2.HealthCheckRequest(service=service), timeout=3
        )
        tags = dict(call.trailing_metadata() or ())
    return resp.status, tags.get("x-backend")


def test_nginx_round_robins_grpc(backends, nginx_lb) -> None:
    seen = []
    with grpc.insecure_channel(f"127.0.0.1:{nginx_lb.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(6):  # one client connection: nginx balances per request
            resp, call = stub.Check.with_call(health_pb2.HealthCheckRequest(), timeout=3)
            assert resp.status == SERVING
            seen.append(dict(call.trailing_metadata() or ()).get("x-backend"))
    assert set(seen) == {"backend-a", "backend-b"}, (seen, nginx_lb.log())
    assert [b.servicer.hits for b in backends] == [3, 3], nginx_lb.log()


def test_nginx_fails_over_to_live_backend(backends, nginx_lb) -> None:
    assert _check_via(nginx_lb.port)[0] == SERVING
    a, b = backends
    a.stop()
    before = b.servicer.hits
    for _ in range(4):
        status, who = _check_via(nginx_lb.port)
        assert (status, who) == (SERVING, "backend-b"), nginx_lb.log()
    assert b.servicer.hits - before == 4


def test_nginx_all_backends_down_is_grpc_unavailable(backends, nginx_lb) -> None:
    for b in backends:
        b.stop()
    with pytest.raises(grpc.RpcError) as e:
        _check_via(nginx_lb.port)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, nginx_lb.log()
    assert "no replica available" in e.value.details()


def test_nginx_passes_backend_status_through(backends, nginx_lb) -> None:
    for b in backends:
        b.servicer.set("zerogap.v1.Generation", NOT_SERVING)
    assert _check_via(nginx_lb.port, "zerogap.v1.Generation")[0] == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:  # unknown service: NOT_FOUND, as from a replica
        _check_via(nginx_lb.port, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_healthcheck_cli_through_nginx(nginx_lb, capsys) -> None:
    # What the compose `client` service runs, against the LB.
    assert healthcheck.main(["--host", "127.0.0.1", "--port", str(nginx_lb.port)]) == 0
    assert "SERVING" in capsys.readouterr().out


# --------------------------------------------------------------------------
# service.healthcheck against a direct server


def test_healthcheck_serving(backends, capsys) -> None:
    assert healthcheck.main(["--port", str(backends[0].port)]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_healthcheck_not_serving(backends, capsys) -> None:
    backends[0].servicer.set("zerogap.v1.Generation", NOT_SERVING)
    argv = ["--port", str(backends[0].port), "--service", "zerogap.v1.Generation"]
    assert healthcheck.main(argv) == 1
    assert "NOT_SERVING" in capsys.readouterr().out


def test_healthcheck_unknown_service(backends, capsys) -> None:
    assert healthcheck.main(["--port", str(backends[0].port), "--service", "nope"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_healthcheck_closed_port(capsys) -> None:
    port = _free_port()  # bound then released: nothing listens there
    assert healthcheck.main(["--port", str(port), "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_healthcheck_cli_is_light() -> None:
    # The probe runs every few seconds in each container: it must not import torch.
    code = "import sys; from service import healthcheck; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# --------------------------------------------------------------------------
# TLS: deploy/compose.tls.yml, deploy/make-certs.sh and deploy/nginx-tls.conf

NGINX_TLS_CONF = ROOT / "deploy" / "nginx-tls.conf"
COMPOSE_TLS = ROOT / "deploy" / "compose.tls.yml"


def test_compose_tls_override_validates_and_wires() -> None:
    exe = Path(sys.executable).parent / "check-jsonschema"
    if exe.exists():
        r = subprocess.run(
            [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_TLS)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stdout + r.stderr
    svc = yaml.safe_load(COMPOSE_TLS.read_text())["services"]
    cmd = svc["zerogap"]["command"]
    for flag in ("--tls-cert", "--tls-key", "--tls-client-ca"):
        assert flag in cmd
    from service.config import build_arg_parser

    build_arg_parser().parse_args(cmd[4:])  # every flag is one `serve` knows
    assert any(v.startswith("./deploy/nginx-tls.conf:/etc/nginx/nginx.conf") for v in svc["lb"]["volumes"])
    assert "ZEROGAP_AUTH_TOKENS" in _compose()["services"]["zerogap"]["environment"]
    # The gateway follows the LB onto TLS (nginx-tls.conf listens on 8443 only).
    from service.gateway.cli import parse_args

    gw = svc["gateway"]["command"]
    assert gw[:4] == ["python", "-m", "service", "gateway"]
    args = parse_args(gw[4:])
    assert args.grpc == "lb:8443" and args.tls_ca == "/certs/ca.pem"


def test_gateway_tls_flags(stack_certs) -> None:
    from service.gateway.cli import credentials, parse_args

    assert credentials(parse_args([])) is None
    args = parse_args(
        [
            "--tls-ca",
            str(stack_certs / "ca.pem"),
            "--tls-cert",
            str(stack_certs / "client.pem"),
            "--tls-key",
            str(stack_certs / "client.key"),
        ]
    )
    assert isinstance(credentials(args), grpc.ChannelCredentials)
    for bad in (["--tls-cert", "c.pem", "--tls-key", "k.pem"], ["--tls-ca", "ca.pem", "--tls-cert", "c.pem"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.fixture(scope="module")
def stack_certs(tmp_path_factory) -> Path:
    need_tools(["openssl"], "apt-get install openssl")
    d = tmp_path_factory.mktemp("certs")
    subprocess.run(
        ["sh", str(ROOT / "deploy" / "make-certs.sh"), str(d)], check=True, capture_output=True, timeout=60
    )
    return d


class _TlsBackend(_Backend):
    """A health backend serving mutual TLS with the replicas' certificate, recording the authorization it saw."""

    def __init__(self, name: str, certs: Path) -> None:
        self.servicer = _TaggedHealth(name)
        self.servicer.set("", SERVING)
        self.seen: list[str] = []
        inner = self.servicer.Check

        def check(request, context):
            self.seen.append(dict(context.invocation_metadata()).get("authorization", ""))
            return inner(request, context)

        self.servicer.Check = check
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        creds = grpc.ssl_server_credentials(
            [((certs / "zerogap.key").read_bytes(), (certs / "zerogap.pem").read_bytes())],
            root_certificates=(certs / "ca.pem").read_bytes(),
            require_client_auth=True,
        )
        self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        assert self.port
        self.server.start()
        self.running = True


def render_nginx_tls_conf(upstreams: list[int], listen_port: int, tmp: Path, certs: Path) -> str:
    """deploy/nginx-tls.conf with render_nginx_conf's substitutions, its listen line and the certs directory."""
    conf = NGINX_TLS_CONF.read_text()
    listen_line = re.search(r"^(\s*)listen 8443 ssl http2;\n", conf, re.M)
    assert listen_line and "/etc/nginx/certs/" in conf, (
        "deploy/nginx-tls.conf changed shape: update this test"
    )
    conf = conf.replace(listen_line.group(0), f"{listen_line.group(1)}listen 8080 http2;\n", 1)
    out = render_nginx_conf(upstreams, listen_port, tmp, conf)
    out = out.replace(f"listen 127.0.0.1:{listen_port} http2;", f"listen 127.0.0.1:{listen_port} ssl http2;")
    return out.replace("/etc/nginx/certs/", f"{certs}/")


def test_nginx_tls_end_to_end_with_token_passthrough(stack_certs, tmp_path) -> None:
    binary = _nginx_binary()
    if binary is None:
        need_tools(["nginx"], "apt-get install nginx")
    bs = [_TlsBackend("tls-a", stack_certs), _TlsBackend("tls-b", stack_certs)]
    port = _free_port()
    lb = _Nginx(
        binary, render_nginx_tls_conf([b.port for b in bs], port, tmp_path, stack_certs), tmp_path, port
    )
    try:
        assert lb.wait_ready(), lb.log()
        sec = healthcheck.Security(tls_ca=str(stack_certs / "ca.pem"), tls_server_name="lb")
        seen = []
        for _ in range(4):
            with healthcheck.channel(f"127.0.0.1:{port}", sec) as ch:
                resp, call = health_pb2_grpc.HealthStub(ch).Check.with_call(
                    health_pb2.HealthCheckRequest(),
                    timeout=5,
                    metadata=[("authorization", "Bearer tok-0123456789abcdef")],
                )
                assert resp.status == SERVING, lb.log()
                seen.append(dict(call.trailing_metadata() or ()).get("x-backend"))
        assert set(seen) == {"tls-a", "tls-b"}, (seen, lb.log())
        assert {a for b in bs for a in b.seen} == {
            "Bearer tok-0123456789abcdef"
        }  # the token reached the replicas
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # plaintext to the TLS port
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert (
            healthcheck.main(
                ["--port", str(port), "--tls-ca", str(stack_certs / "ca.pem"), "--tls-server-name", "lb"]
            )
            == 0
        )
    finally:
        lb.stop()
        for b in bs:
            b.stop()
