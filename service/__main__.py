"""Command line: `python -m service {serve,gateway,prepare-model,matrix,healthcheck} ...`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m service {serve,gateway,prepare-model,matrix,healthcheck} [options]  (serve --help lists all)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from service.config import parse_server_args
        from service.server import serve

        return serve(parse_server_args(rest))
    if cmd == "gateway":
        from service.gateway.cli import main as gateway_main

        return gateway_main(rest)
    if cmd == "prepare-model":
        from service.model_prep import prepare_default_model

        print(prepare_default_model())
        return 0
    if cmd == "matrix":
        from service.matrix import main as matrix_main

        return matrix_main(rest)
    if cmd == "healthcheck":
        from service.healthcheck import main as health_main

        return health_main(rest)
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
