"""When the overlap loop forms its next batch (CPU): late enough that requests arriving during the
running step join it, early enough that the forward thread does not wait for it.

The overlap loop forms batch N+1 as soon as batch N starts. A request that arrives while N runs then
misses N+1, which is already queued, and joins N+2: its first token comes a whole step later than in
the normal loop. On a GPU a step is a few milliseconds and forming one takes about as long, so the
loop forms at once there. On a CPU a step takes tens of milliseconds and forming one about one: the
scheduler waits for new requests until shortly before the running step is predicted to end (the
last step of the same shape, times `share`, less the time forming takes and a margin), and forms
at once when one arrives. Waiting also leaves the CPU to the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.overlap_worker import LaunchedBatch
from service.engine.schedule_batch import ScheduleBatch

StepShape = tuple[str, int]  # mode, tokens


def step_shape(batch: ScheduleBatch) -> StepShape:
    return batch.mode.value, int(batch.fb.input_ids.shape[0])


@dataclass
class LaunchPacer:
    """How long recent steps ran, by mode and token count; how long forming a batch takes."""

    share: float = 0.8  # of the predicted step: a shorter step than the last one leaves no gap
    margin_s: float = 0.002
    form_s: float = 0.001  # forming and launching a batch, a moving average
    near: float = 1.25  # a step of the same mode with tokens within this factor predicts another
    last_s: dict[StepShape, float] = field(default_factory=dict)

    def observe_step(self, batch: ScheduleBatch, handle: LaunchedBatch) -> None:
        """A finished step's duration on the forward thread, for the next steps of its shape."""
        if handle.started is not None and handle.finished is not None:
            if len(self.last_s) >= 64:  # predict() scans them once per step: keep the recent shapes
                self.last_s.clear()
            self.last_s[step_shape(batch)] = handle.finished - handle.started

    def observe_form(self, seconds: float) -> None:
        self.form_s += 0.2 * (seconds - self.form_s)

    def predict(self, shape: StepShape) -> float | None:
        """The last duration of the step of the same mode with the nearest token count, if near."""
        mode, tokens = shape
        seen = [(abs(t - tokens), t, d) for (m, t), d in self.last_s.items() if m == mode]
        if not seen:
            return None
        _, t, d = min(seen)
        return d if max(t, tokens) <= self.near * min(t, tokens) else None

    def form_at(self, running: tuple[ScheduleBatch, LaunchedBatch]) -> float | None:
        """The perf_counter time to form the next batch by (None: now); `running` is the only batch
        in flight."""
        batch, handle = running
        if handle.started is None or handle.finished is not None:
            return None
        predicted = self.predict(step_shape(batch))
        if predicted is None:
            return None
        return handle.started + self.share * predicted - self.form_s - self.margin_s
