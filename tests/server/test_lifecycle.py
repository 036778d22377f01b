"""Process-level behaviour: SIGTERM drain, bounded queue, CLI."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.config import ServerArgs
from service.server import BackgroundServer
from tests.helpers import free_port, serve_process, wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_finishes_in_flight_then_refuses_and_exits(tiny_llama_dir):
    port = free_port()
    proc = serve_process(tiny_llama_dir, port, "--kv-cache-tokens", "2000", "--grace-period-s", "20")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb2_grpc.GenerationStub(ch)
            stream = stub.GenerateStream(
                pb2.GenerateRequest(
                    token_ids=pb2.TokenIds(ids=[5, 6, 7]),
                    sampling=pb2.SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True),
                )
            )
            it = iter(stream)
            next(it)
            proc.send_signal(signal.SIGTERM)
            # Draining is announced through health (NOT_SERVING); wait for it rather than for a fixed time.
            health = health_pb2_grpc.HealthStub(ch)
            assert wait_until(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest()).status
                    != health_pb2.HealthCheckResponse.SERVING
                ),
                20,
            )
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(pb2.GenerateRequest(text="new", sampling=pb2.SamplingParams(max_new_tokens=2)))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(it)
            assert rest[-1].finish_reason == pb2.FINISH_REASON_LENGTH
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_full_queue_answers_resource_exhausted(tiny_llama_dir):
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            model=str(tiny_llama_dir),
            port=0,
            kv_cache_tokens=400,
            max_running_requests=1,
            max_queued_requests=2,
        )
    )
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb2_grpc.GenerationStub(ch)
            req = pb2.GenerateRequest(
                token_ids=pb2.TokenIds(ids=[5, 6]),
                sampling=pb2.SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True),
            )
            futures = [stub.Generate.future(req) for _ in range(8)]
            codes = []
            for f in futures:
                try:
                    f.result()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        srv.stop()


def test_cli_help_lists_options():
    out = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0
    for opt in (
        "--model",
        "--max-running-requests",
        "--kv-cache-tokens",
        "--dtype",
        "--disable-overlap",
        "--trace-file",
    ):
        assert opt in out.stdout


def test_prometheus_metrics_endpoint(tiny_llama_dir):
    import urllib.request

    port = free_port()
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            model=str(tiny_llama_dir),
            port=0,
            kv_cache_tokens=400,
            max_running_requests=2,
            metrics_port=port,
        )
    )
    try:
        with grpc.insecure_channel(srv.address) as ch:
            pb2_grpc.GenerationStub(ch).Generate(
                pb2.GenerateRequest(
                    token_ids=pb2.TokenIds(ids=[5, 6]),
                    sampling=pb2.SamplingParams(max_new_tokens=8, temperature=0),
                )
            )
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name in (
            "zerogap_forward_busy_fraction",
            "zerogap_forward_gap_median_seconds",
            "zerogap_kv_pool_free_tokens",
            "zerogap_forward_steps_total",
            'zerogap_requests_finished_total{reason="length"} 1.0',
            'zerogap_feature_batches_total{feature="retraction",how="synced"} 0.0',
        ):
            assert name in body, name
    finally:
        srv.stop()


def test_the_queue_counts_requests_not_inbox_commands(tiny_llama_dir):
    """Sent requests that the scheduler has not taken yet count one each, however they were sent (a
    call's n samples come as one command) and whatever else waits beside them (aborts): for the
    queue's bound and for the loads a router balances by."""
    import threading

    from service.core.request import RequestError, SamplingParams
    from service.engine.engine import SyncClient
    from tests.helpers import before_each_forward

    c = SyncClient(
        ServerArgs(
            model=str(tiny_llama_dir), dtype="float32", loop="normal", kv_cache_tokens=400,
            max_running_requests=1, max_queued_requests=5,
        ),
        tiny_llama_dir,
    )  # fmt: skip
    entered, go = threading.Event(), threading.Event()

    def hold(fb) -> None:  # the normal loop runs the forward on the scheduler thread: it stops there
        entered.set()
        go.wait(30)

    sp = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    try:
        with before_each_forward(c.engine.worker, hold):
            c.submit("busy", [5, 6], sp)
            assert entered.wait(30)
            c.engine.submit_all([c.engine.build_request(f"n/{i}", [7, 8], sp) for i in range(4)])
            c.engine.abort("nobody")  # not live: no command
            c.engine.abort("n/3")
            assert c.engine.occupancy().queued_requests == 4
            with pytest.raises(RequestError) as e:  # 4 queued + 2 > 5
                c.engine.submit_all([c.engine.build_request(f"m/{i}", [7, 8], sp) for i in range(2)])
            assert e.value.code == "RESOURCE_EXHAUSTED"
            go.set()
        for rid in ("busy", "n/0", "n/1", "n/2", "n/3"):
            c.wait(rid)
        assert c.engine.occupancy().queued_requests == 0
    finally:
        go.set()
        c.close()
