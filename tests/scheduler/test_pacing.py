"""The overlap loop on CPU forms its next batch shortly before the running step ends (pacing.py), so
a request that arrives meanwhile joins the next step instead of the one after it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from service.config import ServerArgs
from service.core.feature import Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch, ForwardMode
from service.core.request import SamplingParams
from service.engine.engine import SyncClient
from service.engine.scheduler.pacing import LaunchPacer


class SlowSteps(Feature):
    """Every batch with a row of a request that uses it takes `STEP_S` more on the forward thread;
    each step's batch size is recorded and its start signalled."""

    name = "test_slow_steps"
    support = OverlapSupport.FULL
    reason = "test-only: a slow forward"
    STEP_S = 0.15

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.step_started = threading.Condition()

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> bool:
        return True

    def before_forward(self, fb: ForwardBatch) -> None:
        with self.step_started:
            self.sizes.append(fb.batch_size)
            self.step_started.notify_all()
        time.sleep(self.STEP_S)

    def wait_for_step(self, n: int) -> int:
        """Block until step n (0-based) has started; its index."""
        with self.step_started:
            assert self.step_started.wait_for(lambda: len(self.sizes) > n, timeout=60)
            return len(self.sizes) - 1


@pytest.mark.parametrize("pace", [True, False])
def test_a_request_arriving_during_a_step_joins_the_next(tiny_llama_dir, pace):
    slow = SlowSteps()
    args = ServerArgs(dtype="float32", loop="overlap", pace_launches=pace, adapt_cpu_team=False)
    c = SyncClient(args, tiny_llama_dir, [slow])
    try:
        long = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        c.submit("stream", [5, 6, 7, 8], long, {slow.name: True})
        k = slow.wait_for_step(4)  # decode steps of one request were seen: the pacer knows their length
        time.sleep(0.02)  # early in step k
        c.submit("late", [9, 10, 11], SamplingParams(max_new_tokens=2, temperature=0.0))
        c.wait("late")
        joined = next(i for i, n in enumerate(slow.sizes) if n == 2)
        assert joined == (k + 1 if pace else k + 2), slow.sizes
        c.wait("stream")
    finally:
        c.close()


class Handle:
    def __init__(self, started: float | None = None, finished: float | None = None):
        self.started, self.finished = started, finished


class Batch:
    def __init__(self, mode: ForwardMode, reqs: int, tokens: int):
        self.mode, self.reqs = mode, [object()] * reqs
        self.fb = type("FB", (), {"input_ids": torch.zeros(tokens, dtype=torch.int64)})()


def test_pacer_forms_before_the_predicted_end_of_a_step_of_a_known_shape():
    p = LaunchPacer(share=0.8, margin_s=0.002, form_s=0.001)
    decode4 = Batch(ForwardMode.DECODE, 4, 4)
    assert p.form_at((decode4, Handle(started=10.0))) is None  # no step of this shape seen: now
    p.observe_step(decode4, Handle(started=1.0, finished=1.05))  # 50 ms
    assert p.form_at((decode4, Handle(started=10.0))) == pytest.approx(10.0 + 0.04 - 0.003)
    assert p.form_at((decode4, Handle())) is None  # not started yet (queued): now
    assert p.form_at((decode4, Handle(started=10.0, finished=10.05))) is None  # already done
    assert p.form_at((Batch(ForwardMode.DECODE, 5, 5), Handle(started=10.0))) is not None  # near: 5/4
    assert p.form_at((Batch(ForwardMode.DECODE, 6, 6), Handle(started=10.0))) is None  # 6/4: too far
    assert p.form_at((Batch(ForwardMode.EXTEND, 4, 4), Handle(started=10.0))) is None  # another mode
    p.observe_form(0.011)
    assert p.form_s == pytest.approx(0.001 + 0.2 * 0.010)
