"""In-flight results (overlap loop): launched batches whose results are not processed yet.

One way to settle the oldest: wait for its result, release its future slots (every batch that could
read its placeholders was launched before now), process it, then run the deferred `after_launch`
hooks of the batch that is now the oldest. Draining is that, until none is left.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator

from service.core.forward_batch import BatchResult
from service.engine.overlap_worker import LaunchedBatch, OverlapWorker
from service.engine.schedule_batch import ScheduleBatch
from service.engine.scheduler.pacing import LaunchPacer

log = logging.getLogger("zerogap.scheduler")

Outcome = BatchResult | BaseException


def run_after_launch(batch: ScheduleBatch) -> None:
    """Each hook on its own: a failing hook fails this batch's requests, nobody else's."""
    batch.after_launch_pending = False
    for feature, rows in batch.plan:
        try:
            feature.after_launch(batch, rows)
        except Exception as e:
            log.exception("after_launch of %s failed", feature.name)
            batch.hook_error = e


class InFlight:
    """Launched batches, oldest first; `process` is the scheduler's result processing."""

    def __init__(
        self,
        worker: OverlapWorker | None,
        process: Callable[[ScheduleBatch, Outcome], None],
        pacer: LaunchPacer | None = None,
    ):
        self.worker = worker  # None in the normal loop: nothing is ever in flight
        self.process = process
        self.pacer = pacer  # learns each finished step's duration (CPU)
        self.batches: deque[tuple[ScheduleBatch, LaunchedBatch]] = deque()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[ScheduleBatch, LaunchedBatch]]:
        return iter(self.batches)

    def add(self, batch: ScheduleBatch, handle: LaunchedBatch) -> None:
        """In flight from here on, whatever happens next: its future slots are released with it."""
        self.batches.append((batch, handle))

    def start_hooks(self, batch: ScheduleBatch) -> None:
        """The just-launched batch's after_launch hooks: now, or once the older results are processed."""
        if len(self.batches) > 1:
            batch.after_launch_pending = True  # after the older batches' results
        else:
            run_after_launch(batch)  # runs while the forward computes

    def form_next_at(self) -> float | None:
        """When to form the next batch (perf_counter; None: now): the pacer's call while one
        batch runs."""
        if self.pacer is None or len(self.batches) != 1:
            return None
        return self.pacer.form_at(self.batches[0])

    def wait(self, item: tuple[ScheduleBatch, LaunchedBatch]) -> tuple[ScheduleBatch, Outcome]:
        batch, handle = item
        try:
            result: Outcome = handle.wait()
        except Exception as e:
            result = e
        if self.pacer is not None:
            self.pacer.observe_step(batch, handle)
        assert self.worker is not None
        self.worker.future_map.release(handle.slots)
        return batch, result

    def process_oldest(self) -> None:
        self.process(*self.wait(self.batches.popleft()))
        self.run_deferred_after_launch()

    def process_newest(self) -> None:
        """A "none" batch, launched last: processed at once."""
        self.process(*self.wait(self.batches.pop()))

    def drain(self) -> None:
        """Process every result in flight (a sync point)."""
        while self.batches:
            self.process_oldest()

    def run_deferred_after_launch(self) -> None:
        """A batch's after_launch hooks run once every earlier result is processed
        (e.g. grammar masks need the previous tokens accepted), while it computes."""
        if self.batches and self.batches[0][0].after_launch_pending:
            run_after_launch(self.batches[0][0])

    def abandon(self) -> None:
        """After a loop failure: let the forward thread finish every batch, process none."""
        for batch, handle in self.batches:
            if batch.after_launch_pending:  # the forward may wait on what these hooks provide
                run_after_launch(batch)
            try:
                handle.wait()
            except Exception:
                pass
            assert self.worker is not None
            self.worker.future_map.release(handle.slots)
        self.batches.clear()
