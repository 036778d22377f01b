"""The overlap worker: the forward pass on its own thread, and future tokens.

`launch(batch)` returns at once with placeholders for the tokens the batch will
sample: -(slot + 1) for a slot of the FutureMap. The scheduler puts them into
the next batch's inputs; the forward thread resolves them right before that
batch's forward and writes each batch's sampled tokens into its own slots.
On CPU the thread is what makes overlap real: torch releases the GIL inside
ops, so the scheduler's Python runs meanwhile. On CUDA the forward runs on its
own stream (ModelWorker.step): it waits on the batch's `ready` event recorded
on the scheduler's stream, resolves placeholders on the device, and copies the
sampled ids to pinned host memory behind a `copy_done` event; the handle keeps
the batch's tensors referenced until its result has been processed.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from service.core.forward_batch import BatchResult, ForwardBatch
from service.engine.future_map import FutureMap
from service.engine.model_worker import ModelWorker


class LaunchedBatch:
    """Handle of a batch in flight. It holds the ForwardBatch, so every tensor the
    forward thread reads stays alive until the result has been processed."""

    def __init__(self, fb: ForwardBatch, slots: torch.Tensor, slots_device: torch.Tensor, label: str):
        self.fb = fb
        self.slots = slots  # host: released by the scheduler
        self.slots_device = slots_device  # read by the forward stream (kept alive here)
        self.label = label
        self.placeholders: list[int] = FutureMap.placeholders(slots).tolist()
        self._done = threading.Event()
        self.started: float | None = None  # perf_counter times on the forward thread (its step)
        self.finished: float | None = None
        self._result: BatchResult | None = None
        self._error: BaseException | None = None

    def set_result(self, result: BatchResult) -> None:
        self._result = result
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> BatchResult:
        """Block until the forward thread enqueued the step and its copy to host is
        done (copy_done); re-raise its exception."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        self._result.synchronize()
        return self._result


class OverlapWorker:
    """Runs ModelWorker.forward on a dedicated forward thread, in launch order."""

    def __init__(self, worker: ModelWorker, future_map: FutureMap):
        self.worker = worker
        self.future_map = future_map
        self._queue: queue.Queue[LaunchedBatch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._forward_thread, name="zerogap-forward", daemon=True)
        self._thread.start()

    def launch(self, fb: ForwardBatch, label: str = "forward") -> LaunchedBatch:
        """Scheduler thread: allocate the batch's future slots, record its `ready`
        event on the scheduler stream, and queue it for the forward thread."""
        device = self.worker.device
        slots = self.future_map.alloc(fb.batch_size)
        (slots_device,) = device.to_device(slots)
        fb.ready = device.record_event()
        handle = LaunchedBatch(fb, slots, slots_device, label)
        self._queue.put(handle)
        return handle

    def _forward_thread(self) -> None:
        if self.worker.device.is_cuda:
            torch.cuda.set_device(self.worker.device.device)
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            try:
                handle.started = time.perf_counter()
                result = self.worker.step(handle.fb, handle.label, self.future_map, handle.slots_device)
                handle.finished = time.perf_counter()
                handle.set_result(result)
            except BaseException as e:  # the scheduler fails the batch's requests
                handle.set_error(e)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
