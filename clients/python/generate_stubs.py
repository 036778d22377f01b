"""Regenerate zerogap/v1/ from the repository's proto/ (needs grpcio-tools; not part of the package).

python clients/python/generate_stubs.py          # rewrite the shipped stubs
python clients/python/generate_stubs.py OUT_DIR  # write them under OUT_DIR/zerogap/v1 instead
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parent.parent / "proto"
PROTO_FILE = PROTO_DIR / "zerogap" / "v1" / "generation.proto"
STUBS = ("generation_pb2.py", "generation_pb2_grpc.py")


def generate(out_dir: Path = HERE) -> Path:
    """Write the stubs into out_dir/zerogap/v1 and return that folder."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    return out_dir / "zerogap" / "v1"


if __name__ == "__main__":
    print(generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
