"""What a hostile or careless client found (issue 17), each case through gRPC on a real server.

Every case asserts the status the client gets, that other requests are unaffected (their tokens, and
their latency as a ratio to an unloaded run), and that the KV pool is back to its initial state.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from service import protos
from service.config import ServerArgs
from service.server import AddressInUse, BackgroundServer, bind_port, check_address_free
from tests.helpers import wait_until

pb2, pb2_grpc = protos.load()
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(n: int = 8, **kw) -> pb2.SamplingParams:
    return pb2.SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def kv_idle(srv: BackgroundServer) -> bool:
    e = srv.engine
    return e.kv_pool.free_count == e.kv_pool.size and e.num_live() == 0


# ---- 1. a taken port -----------------------------------------------------------------------------


def test_second_server_on_a_taken_port_refuses_to_start(tiny_llama_dir):
    first = BackgroundServer(ServerArgs(model=str(tiny_llama_dir), port=0, kv_cache_tokens=400, max_running_requests=2))
    try:
        port = first.port
        with pytest.raises(AddressInUse, match=f"127.0.0.1:{port}.*in use"):
            BackgroundServer(ServerArgs(model=str(tiny_llama_dir), port=port, kv_cache_tokens=400))
        # The CLI says so and exits non-zero, before loading the model.
        out = subprocess.run([sys.executable, "-m", "service", "serve", "--model", str(tiny_llama_dir), "--port", str(port)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr[-2000:]
        # Every new connection still reaches the first server.
        for _ in range(4):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                r = pb2_grpc.GenerationStub(ch).Generate(pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5, 6]), sampling=greedy(2)))
                assert len(r.token_ids) == 2
        assert wait_until(lambda: kv_idle(first), 20)
    finally:
        first.stop()


def test_exclusive_bind_refuses_a_port_held_with_so_reuseport():
    """A foreign gRPC server holding the port with gRPC's default SO_REUSEPORT: both our checks refuse."""
    import asyncio

    async def scenario() -> None:
        other = grpc.aio.server()  # default options: SO_REUSEPORT on
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        try:
            with pytest.raises(AddressInUse):
                check_address_free("127.0.0.1", port)
            with pytest.raises(AddressInUse):
                bind_port(grpc.aio.server(options=[("grpc.so_reuseport", 0)]), "127.0.0.1", port)
        finally:
            await other.stop(0)

    asyncio.run(scenario())
