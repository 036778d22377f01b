"""Small helpers shared by tests."""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from service.config import ServerArgs
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

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


def person_as_json(oai, model: str) -> dict:
    """A response_format json_schema answer through an OpenAI endpoint (an `openai.OpenAI`), checked
    against PERSON_SCHEMA; the parsed object."""
    import jsonschema

    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )
    person = json.loads(r.choices[0].message.content)
    jsonschema.validate(person, PERSON_SCHEMA)
    return person


NEEDS = "needs "  # how a missing tool's skip reason starts: conftest's summary lists one line per tool group


def need_tools(tools: list[str], install: str) -> None:
    """Skip the test when one of `tools` is not on PATH, naming how to install it (under CI, conftest
    turns such a skip into a failure: CI installs every tool, so a missing one is a broken set-up)."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{NEEDS}{', '.join(missing)}: {install}")


def need_triton() -> None:
    """Skip unless the Triton kernels can run: a GPU, or the interpreter (tests/conftest.py sets
    TRITON_INTERPRET=1 before triton is imported)."""
    import os

    import torch

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")


def greedy_with_logprobs(model_dir: Path, prompts: list[list[int]], n_new: int, **args) -> tuple[list, int]:
    """In process (fp32, 2048 KV tokens, 8 slots unless `args` say otherwise): each prompt's outputs,
    greedy, `n_new` tokens, input and output logprobs; and the run's retractions. Every KV row is
    free again at the end."""
    from service.core.request import SamplingParams
    from service.engine.engine import SyncClient

    client = SyncClient(
        ServerArgs(**dict(dict(dtype="float32", kv_cache_tokens=2048, max_running_requests=8), **args)),
        model_dir,
    )
    try:
        outs = client.generate(
            prompts,
            SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True),
            [{"logprobs": dict(return_logprob=True, logprob_start_len=0)}] * len(prompts),
        )
        assert client.engine.kv_all_free()
        return outs, client.engine.stats().retractions
    finally:
        client.close()


def wait_until(pred, timeout: float = 30.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def serve_process(model_dir, port: int, *flags: str, timeout: float = 120.0):
    """`python -m service serve` as a child process, once it says it listens (stdout piped)."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--model", str(model_dir), "--port", str(port), *flags],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = ""
    deadline = time.monotonic() + timeout
    while "listening" not in line and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
    if "listening" not in line:
        proc.kill()
        proc.stdout.close()
        raise AssertionError(f"the server did not start: {line}")
    return proc


def model_variant(model_dir: Path, out: Path, **files: str) -> Path:
    """`out`: `model_dir`'s files as symlinks, but for `files` (name -> text) written in their place."""
    out.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.name not in files:
            (out / f.name).symlink_to(f)
    for name, text in files.items():
        (out / name).write_text(text)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def grpc_stub(model_dir, **args) -> Iterator:
    """A real server on a loopback ephemeral port and a Generation stub for it."""
    from service.server import BackgroundServer

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
    return e.num_live() == 0 and e.kv_all_free()  # all free once the prefix cache is flushed


# ---- fault injection: wrappers a test installs on a live engine (nothing of it in production code) ----
@contextmanager
def on_each_result(scheduler, hook):
    """Call hook(req) for each request while the scheduler processes its token, before the token is
    appended; an exception fails that request (as a fault while serving it would)."""
    output = scheduler.output
    accept = output.accept

    def wrapped(req, token):
        hook(req)
        accept(req, token)

    output.accept = wrapped
    try:
        yield
    finally:
        del output.accept


@contextmanager
def before_each_forward(worker, hook):
    """Call hook(fb) with each ForwardBatch right before the worker's forward, on the thread that runs
    it; an exception fails the batch (as a forward fault would)."""
    forward = worker.forward

    def wrapped(fb, *args, **kwargs):
        hook(fb)
        return forward(fb, *args, **kwargs)

    worker.forward = wrapped
    try:
        yield
    finally:
        del worker.forward
