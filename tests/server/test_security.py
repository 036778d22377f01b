"""TLS, mutual TLS and bearer-token auth on a real server, with a CA made in the test (openssl CLI)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service import healthcheck
from service.config import ServerArgs
from service.healthcheck import Security
from service.server import BackgroundServer, StartupError
from tests.helpers import need_tools
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

TOKEN = "t0k3n-for-tests-only-0123456789"


@pytest.fixture(autouse=True)
def _openssl():
    need_tools(["openssl"], "apt-get install openssl")


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_client_cert: Path  # signed by another CA
    other_client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        f"{name}.pem",
        "-extfile",
        f"{name}.ext",
        cwd=d,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "intruder", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(
        d / "ca.pem",
        d / "server.pem",
        d / "server.key",
        d / "client.pem",
        d / "client.key",
        d / "intruder.pem",
        d / "intruder.key",
    )


def _secure(address: str, pki: Pki, cert: Path | None = None, key: Path | None = None) -> grpc.Channel:
    return healthcheck.channel(
        address, Security(str(pki.ca), str(cert) if cert else None, str(key) if key else None)
    )


REQ = pb2.GenerateRequest(
    token_ids=pb2.TokenIds(ids=[5, 6, 7]), sampling=pb2.SamplingParams(max_new_tokens=4, temperature=0)
)
BEARER = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture(scope="module")
def tls_server(tiny_llama_dir, pki, tmp_path_factory):
    """TLS, tokens from a file, health open (the default)."""
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"# zerogap tokens\n\n{TOKEN}\nanother-token-0123456789\n")
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            model=str(tiny_llama_dir),
            port=0,
            kv_cache_tokens=400,
            max_running_requests=2,
            tls_cert=str(pki.server_cert),
            tls_key=str(pki.server_key),
            auth_token_file=str(tokens),
        )
    )
    yield srv
    srv.stop()


def test_tls_serves_and_refuses_plaintext(tls_server, pki):
    with _secure(tls_server.address, pki) as ch:
        r = pb2_grpc.GenerationStub(ch).Generate(REQ, metadata=BEARER, timeout=30)
        assert len(r.token_ids) == 4
    with grpc.insecure_channel(tls_server.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb2_grpc.GenerationStub(ch).Generate(REQ, metadata=BEARER, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "metadata, says",
    [
        (None, "missing credentials"),
        ([("authorization", "Bearer wrong-token-0123456789")], "invalid token"),
        ([("authorization", f"Basic {TOKEN}")], "malformed authorization"),
    ],
)
def test_token_auth_refuses_without_a_valid_token(tls_server, pki, metadata, says):
    with _secure(tls_server.address, pki) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        for call in (
            lambda: stub.Generate(REQ, metadata=metadata, timeout=10),
            lambda: list(stub.GenerateStream(REQ, metadata=metadata, timeout=10)),
            lambda: stub.GetServerInfo(pb2.GetServerInfoRequest(), metadata=metadata, timeout=10),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and says in e.value.details(), (
                e.value.details()
            )
        # Health stays open (default --auth-open health); reflection does not.
        status = (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
            .status
        )
        assert status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        with pytest.raises(grpc.RpcError) as e:
            list(
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    metadata=metadata,
                    timeout=10,
                )
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert tls_server.engine.num_live() == 0


def test_healthcheck_cli_over_tls(tls_server, pki, capsys):
    port = str(tls_server.port)
    assert healthcheck.main(["--port", port, "--tls-ca", str(pki.ca)]) == 0
    assert healthcheck.main(["--port", port]) == 1  # plaintext to a TLS server
    # Health is open whichever service it is asked about.
    assert (
        healthcheck.main(["--port", port, "--tls-ca", str(pki.ca), "--service", "zerogap.v1.Generation"]) == 0
    )
    capsys.readouterr()


@pytest.fixture(scope="module")
def mtls_server(tiny_llama_dir, pki, monkeypatch_module):
    """Mutual TLS, tokens from the environment, health and reflection open."""
    monkeypatch_module.setenv("ZEROGAP_AUTH_TOKENS", f"{TOKEN}, second-token-0123456789")
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            model=str(tiny_llama_dir),
            port=0,
            kv_cache_tokens=400,
            max_running_requests=2,
            tls_cert=str(pki.server_cert),
            tls_key=str(pki.server_key),
            tls_client_ca=str(pki.ca),
            auth_open="health,reflection",
        )
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(mtls_server, pki):
    with _secure(mtls_server.address, pki, pki.client_cert, pki.client_key) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        assert (
            len(
                stub.Generate(
                    REQ, metadata=[("authorization", "Bearer second-token-0123456789")], timeout=30
                ).token_ids
            )
            == 4
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(REQ, timeout=10)  # a certificate is not a token
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        resp = next(
            reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        assert "zerogap.v1.Generation" in {s.name for s in resp.list_services_response.service}
    for cert, key in ((None, None), (pki.other_client_cert, pki.other_client_key)):
        with _secure(mtls_server.address, pki, cert, key) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb2_grpc.GenerationStub(ch).Generate(REQ, metadata=BEARER, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (
        healthcheck.main(
            [
                "--port",
                str(mtls_server.port),
                "--tls-ca",
                str(pki.ca),
                "--tls-cert",
                str(pki.client_cert),
                "--tls-key",
                str(pki.client_key),
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(tls_cert="x.pem"), "--tls-cert and --tls-key go together"),
        (dict(tls_client_ca="ca.pem"), "--tls-client-ca needs --tls-cert"),
        (dict(tls_cert="/nonexistent.pem", tls_key="/nonexistent.key"), "No such file"),
        (dict(auth_open="health,nope"), "--auth-open: unknown service"),
    ],
)
def test_bad_security_settings_refuse_to_start(tiny_llama_dir, kw, says):
    with pytest.raises(StartupError, match=says):
        BackgroundServer(ServerArgs(dtype="float32", model=str(tiny_llama_dir), port=0, **kw))


def test_short_tokens_are_refused(tiny_llama_dir, tmp_path):
    (tmp_path / "t").write_text("short\n")
    with pytest.raises(StartupError, match="at least 16 characters"):
        BackgroundServer(
            ServerArgs(
                dtype="float32", model=str(tiny_llama_dir), port=0, auth_token_file=str(tmp_path / "t")
            )
        )
