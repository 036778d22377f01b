"""The engine's one-time parallel CPU work runs on a thread that exits (service/engine/cpu_threads.py)."""

from __future__ import annotations

import threading

import pytest

from service.config import ServerArgs
from service.engine import engine as engine_module
from service.engine.cpu_threads import on_passing_thread
from service.engine.engine import SyncClient


def test_on_passing_thread_returns_the_result_and_reraises():
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 7

    assert on_passing_thread(work) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        on_passing_thread(fail)


def test_engine_loads_weights_and_pools_on_a_thread_that_is_gone(tiny_llama_dir, monkeypatch):
    """Loading on the caller's (or any long-lived) thread would leave a second OpenMP team
    alive next to the forward's, and libgomp then throttles its workers' spinning."""
    loaders: list[threading.Thread] = []
    real = engine_module.load_model

    def recording_load(*args, **kwargs):
        loaders.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", recording_load)
    client = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=512, max_running_requests=4), tiny_llama_dir)
    try:
        assert len(loaders) == 1
        assert loaders[0] is not threading.current_thread() and not loaders[0].is_alive()
        assert loaders[0] is not client.engine._thread
    finally:
        client.close()
