"""Which threads run parallel CPU work, and why it matters.

torch's CPU ops run their parallel regions on OpenMP (libgomp). libgomp gives
every thread that ever opened a parallel region its own team of worker threads,
kept for that thread's whole life. Once the process holds more such threads
than cores, libgomp throttles the workers' spin-wait (to ~100 iterations), so
each worker sleeps right after a region and the next region pays a futex wake
of a halted vCPU: on a 2-core VM a bs-1 decode step went from 21 to 30 ms when
the weights had been loaded on one thread and the forward ran on another.

So the engine does its one-time parallel work (loading and packing weights,
filling the pools) on a thread that then exits, taking its team with it: the
thread that runs forwards keeps the only team.

The vision worker's encoder calls run the same way (features/multimodal.py): a thread that
lives on beside the forward's would keep a second team.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T], name: str = "zerogap-setup") -> T:
    """fn() run on a new thread that exits when it returns; its result, or its exception."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) as pool:  # leaving joins the thread
        return pool.submit(fn).result()


def _libgomp() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libgomp.so.1")  # the copy torch loaded (same soname)
    except OSError:
        return None


def serial_cpu_ops_on_this_thread() -> bool:
    """Make this thread's torch CPU ops run without OpenMP workers (a team of one), so a thread
    beside the forward's (the overlap loop's scheduler) adds no second team. False where torch
    does not run on libgomp (nothing changed)."""
    lib = _libgomp()
    if lib is None or not torch.backends.openmp.is_available():
        return False
    # torch's per-thread OpenMP set-up first: it runs lazily, at this thread's first parallel region
    # or get_num_threads(), and sets the team back to torch's process-wide count (a tiny op opens
    # no region, so it does not run it)
    torch.get_num_threads()
    lib.omp_set_num_threads(1)
    return True
