"""`python -m service healthcheck`: probe a server's standard gRPC health service.

Calls `grpc.health.v1.Health/Check` once (plaintext, or TLS with --tls-ca,
optionally with a client certificate and a bearer token), prints the
reported status and exits 0 only when it is SERVING. Anything else -- another
status, an unknown service name, a refused connection, a timeout -- prints the
reason and exits 1, which is what Docker's HEALTHCHECK and compose expect.

Deliberately light: it imports only grpc and the health stubs (no torch, no
model code), so a probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m service healthcheck",
        description="Exit 0 if the gRPC health service reports SERVING, else 1.",
    )
    p.add_argument("--host", default="127.0.0.1", help="server host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="server port (default 50051)")
    p.add_argument(
        "--service",
        default="",
        help='service name to check ("" = the whole server, e.g. zerogap.v1.Generation)',
    )
    p.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds (default 3.0)")
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("ZEROGAP_TLS_CA"),
        help="PEM CA bundle: connect with TLS ($ZEROGAP_TLS_CA)",
    )
    p.add_argument(
        "--tls-cert",
        default=os.environ.get("ZEROGAP_TLS_CLIENT_CERT"),
        help="PEM client certificate (mutual TLS)",
    )
    p.add_argument(
        "--tls-key", default=os.environ.get("ZEROGAP_TLS_CLIENT_KEY"), help="PEM key of --tls-cert"
    )
    p.add_argument("--tls-server-name", default=None, help="name to verify the server certificate against")
    p.add_argument(
        "--token",
        default=os.environ.get("ZEROGAP_AUTH_TOKEN"),
        help="bearer token, for servers whose health service is not open ($ZEROGAP_AUTH_TOKEN)",
    )
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


def _target(host: str, port: int) -> str:
    """host:port, bracketing a bare IPv6 literal."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


@dataclass(frozen=True)
class Security:
    """How to reach a server: TLS files (None: plaintext) and a bearer token."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    token: str | None = None


def channel(target: str, sec: Security = Security()) -> grpc.Channel:
    if sec.tls_ca is None:
        return grpc.insecure_channel(target)

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(read(sec.tls_ca), read(sec.tls_key), read(sec.tls_cert))
    options = [("grpc.ssl_target_name_override", sec.tls_server_name)] if sec.tls_server_name else []
    return grpc.secure_channel(target, creds, options=options)


def check(host: str, port: int, service: str = "", timeout: float = 3.0, sec: Security = Security()) -> str:
    """The status name the server reports for `service` (e.g. "SERVING").

    Raises grpc.RpcError when the call fails (connection refused, deadline,
    NOT_FOUND for an unknown service name, UNAUTHENTICATED).
    """
    metadata = [("authorization", f"Bearer {sec.token}")] if sec.token else None
    with channel(_target(host, port), sec) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=metadata)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str]) -> int:
    """Run one health check; return the process exit code (0 = SERVING)."""
    args = _parse_args(argv)
    target = _target(args.host, args.port)
    label = f"{target} service={args.service!r}"
    try:
        sec = Security(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name, args.token)
        status = check(args.host, args.port, args.service, args.timeout, sec)
    except OSError as e:
        print(f"{label}: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        name = code.name if code is not None else "ERROR"
        print(f"{label}: {name}: {details}", file=sys.stderr)
        return 1
    print(f"{label}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
