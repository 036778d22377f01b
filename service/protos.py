"""The gRPC stubs of proto/zerogap/v1, as shipped by the client distribution (clients/python).

`load()` returns the `zerogap.v1` message module and the service module.
"""

from __future__ import annotations

from types import ModuleType


def load() -> tuple[ModuleType, ModuleType]:
    """(generation_pb2, generation_pb2_grpc)."""
    from zerogap.v1 import generation_pb2, generation_pb2_grpc

    return generation_pb2, generation_pb2_grpc
