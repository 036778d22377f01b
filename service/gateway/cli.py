"""`python -m service gateway`: serve the OpenAI-compatible HTTP API over a gRPC generation service."""

from __future__ import annotations

import argparse

from service.gateway.app import GatewayConfig, create_app


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m service gateway",
        description="OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models) over a zerogap gRPC server or load balancer.",
    )
    p.add_argument(
        "--grpc",
        default="127.0.0.1:50051",
        help="gRPC address of the service or its LB (default %(default)s)",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients use (default: the service's model name)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of chat requests that set none (default: the service's default, 128)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="deadline of one generation in seconds (default %(default)s)",
    )
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle: reach --grpc over TLS (default: plaintext)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    p.add_argument(
        "--allow-image-urls",
        default="",
        metavar="HOST[,HOST...]",
        help="hosts whose http(s) image URLs chat requests may name; the gateway fetches them "
        "(at most --image-url-max-bytes, within --image-url-timeout). Default: none, only data: URIs",
    )
    p.add_argument("--image-url-max-bytes", type=int, default=10 << 20, help="default %(default)s")
    p.add_argument("--image-url-timeout", type=float, default=10.0, help="seconds (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    if (args.tls_cert or args.tls_key) and not args.tls_ca:
        p.error("--tls-cert/--tls-key need --tls-ca")
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    return args


def credentials(args: argparse.Namespace):
    """grpc.ChannelCredentials for --tls-ca (and the client certificate), None without it."""
    if not args.tls_ca:
        return None
    import grpc

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))


def main(argv: list[str]) -> int:
    import uvicorn

    args = parse_args(argv)
    config = GatewayConfig(
        args.grpc,
        args.served_model_name,
        args.default_max_tokens,
        args.timeout,
        credentials=credentials(args),
        image_hosts=frozenset(h.strip().lower() for h in args.allow_image_urls.split(",") if h.strip()),
        image_max_bytes=args.image_url_max_bytes,
        image_timeout_s=args.image_url_timeout,
    )
    tls = " (TLS)" if config.credentials is not None else ""
    print(f"zerogap gateway on http://{args.host}:{args.port} -> grpc {args.grpc}{tls}", flush=True)
    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0
