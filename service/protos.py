"""Generated gRPC stubs, built from proto/ on first import (never hand-edited).

`load()` returns the `zerogap.v1` message module and the service module,
regenerating them with grpc_tools when the .proto is newer than the output.
They are imported as `zerogap.v1.*`: the `zerogap` package (the Python client)
adds GEN_DIR/zerogap to its search path, so GEN_DIR itself stays off sys.path.
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILE = PROTO_DIR / "zerogap" / "v1" / "generation.proto"
GEN_DIR = Path(__file__).resolve().parent / "_gen"
_lock = threading.Lock()


def _generate() -> None:
    from grpc_tools import protoc  # build-time tool, imported only when needed

    GEN_DIR.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={GEN_DIR}",
            f"--grpc_python_out={GEN_DIR}",
            str(PROTO_FILE),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE} (exit {rc})")
    (GEN_DIR / "zerogap" / "v1" / "__init__.py").touch()


def load() -> tuple[ModuleType, ModuleType]:
    """(generation_pb2, generation_pb2_grpc), generated if missing or stale."""
    with _lock:
        out = GEN_DIR / "zerogap" / "v1" / "generation_pb2.py"
        if not out.exists() or out.stat().st_mtime < PROTO_FILE.stat().st_mtime:
            _generate()
        pb2 = importlib.import_module("zerogap.v1.generation_pb2")
        pb2_grpc = importlib.import_module("zerogap.v1.generation_pb2_grpc")
    return pb2, pb2_grpc
