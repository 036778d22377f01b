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
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


def main(argv: list[str]) -> int:
    import uvicorn

    args = parse_args(argv)
    config = GatewayConfig(args.grpc, args.served_model_name, args.default_max_tokens, args.timeout)
    print(f"zerogap gateway on http://{args.host}:{args.port} -> grpc {args.grpc}", flush=True)
    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0
