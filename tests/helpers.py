"""Small helpers shared by tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from service import protos
from service.config import ServerArgs

# A small bounded JSON Schema (the one the example clients in clients/ send, too).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def wait_until(pred, timeout: float = 30.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


@contextmanager
def grpc_stub(model_dir, **args) -> Iterator:
    """A real server on a loopback ephemeral port and a Generation stub for it."""
    from service.server import BackgroundServer

    _, pb2_grpc = protos.load()
    srv = BackgroundServer(ServerArgs(dtype="float32", model=str(model_dir), port=0, **args))
    try:
        with grpc.insecure_channel(srv.address) as ch:
            yield pb2_grpc.GenerationStub(ch)
    finally:
        srv.stop()


@contextmanager
def grpc_client(model_dir, **args) -> Iterator:
    """A real server on a loopback ephemeral port and a zerogap.client.Client for it: (client, server)."""
    from service.server import BackgroundServer
    from zerogap.client import Client

    srv = BackgroundServer(ServerArgs(model=str(model_dir), port=0, **args))
    try:
        with Client(srv.address) as client:
            yield client, srv
    finally:
        srv.stop()


def kv_idle(server) -> bool:
    """No live request and every KV slot free on a BackgroundServer."""
    e = server.engine
    return e.kv_pool.free_count == e.kv_pool.size and e.num_live() == 0
