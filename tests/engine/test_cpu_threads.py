"""The engine's one-time parallel CPU work runs on a thread that exits (service/core/omp.py)."""

from __future__ import annotations

import os
import threading

import pytest

from service.config import ServerArgs
from service.core.omp import on_passing_thread
from service.engine import engine as engine_module
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
    client = SyncClient(
        ServerArgs(dtype="float32", kv_cache_tokens=512, max_running_requests=4), tiny_llama_dir
    )
    try:
        assert len(loaders) == 1
        assert loaders[0] is not threading.current_thread() and not loaders[0].is_alive()
        assert loaders[0] is not client.engine._thread
    finally:
        client.close()


def test_a_thread_beside_the_forward_runs_its_ops_on_a_team_of_one():
    """The overlap loop's scheduler thread: its OpenMP team size is one (no worker threads),
    the calling threads' (the forward's) stays as torch set it; its ops still compute right."""
    import ctypes

    import torch

    from service.core.omp import serial_cpu_ops_on_this_thread

    if not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP")
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
    except OSError:
        pytest.skip("no libgomp.so.1 to load")
    old = torch.get_num_threads()
    torch.set_num_threads(max(2, old))  # as the engine does: new threads take it at their first region
    before = gomp.omp_get_max_threads()
    seen: dict[str, object] = {}

    def os_threads() -> set[str]:  # ids, not a count: a thread of an earlier test may exit meanwhile
        return set(os.listdir("/proc/self/task"))

    def scheduler_like() -> None:
        seen["changed"] = serial_cpu_ops_on_this_thread()
        seen["team"] = gomp.omp_get_max_threads()
        threads = os_threads()
        x = torch.arange(1 << 18, dtype=torch.float32)  # large enough for a parallel region
        seen["sum"] = float((x * 2).sum())
        torch.repeat_interleave(torch.arange(1 << 16), torch.full((1 << 16,), 2))  # the scheduler's
        # torch's lazy per-thread set-up at the first parallel region must not set the team back:
        # it did (a bs-1 decode step went from 24 to 43 ms after the first 64-row batch)
        seen["team_after"] = gomp.omp_get_max_threads()
        seen["new_threads"] = len(os_threads() - threads)

    t = threading.Thread(target=scheduler_like)
    t.start()
    t.join()
    torch.set_num_threads(old)
    assert seen["changed"] is True and seen["team"] == 1
    assert seen["team_after"] == 1 and seen["new_threads"] == 0, seen
    assert seen["sum"] == float(torch.arange(1 << 18, dtype=torch.float64).sum() * 2)
    assert gomp.omp_get_max_threads() == before
