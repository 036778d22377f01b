"""Per-step instrumentation: when the forward ran and when the scheduler worked.

Both threads append spans here. From them come the forward-busy fraction and
the gap between consecutive forwards (GetServerInfo, Prometheus), and a
Chrome trace JSON of the two threads' timelines (`--trace-file`, Perfetto).
With `device_timing`, each step also records a pair of timing events on the
forward stream (CUDA events; the host clock on CPU): `device_forward_stats`
reads them for what the accelerator saw — busy time and idle gaps.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

SCHEDULER_TID = 1
FORWARD_TID = 2


@dataclass
class DeviceStats:
    """What the forward stream saw over consecutive steps (milliseconds)."""

    pairs: int
    median_gap_ms: float
    median_forward_ms: float
    busy_fraction: float


@dataclass
class Span:
    tid: int
    name: str
    start: float  # time.perf_counter() seconds
    end: float
    args: dict | None = None


class Timeline:
    """Recent forward spans and (optionally) every span for the trace file."""

    def __init__(
        self,
        keep_trace: bool,
        window: int = 2048,
        max_trace_spans: int = 500_000,
        device_timing: bool = False,
    ):
        self._lock = threading.Lock()
        self.keep_trace = keep_trace
        self.trace: list[Span] = []
        self.max_trace_spans = max_trace_spans
        # (start, end, busy_epoch) of recent forwards; see mark_idle.
        self.forwards: deque[tuple[float, float, int]] = deque(maxlen=window)
        self.forward_steps = 0
        self._epoch = 0
        self.t0 = time.perf_counter()
        self.device_timing = device_timing
        # (mode, start event, end event, busy_epoch) recorded on the forward stream.
        self.device_spans: deque[tuple[str, Any, Any, int]] = deque(maxlen=window)

    def mark_idle(self) -> None:
        """The scheduler had no work: the next gap is idleness, not overhead."""
        self._epoch += 1

    def add(self, tid: int, name: str, start: float, end: float, args: dict | None = None) -> None:
        with self._lock:
            if tid == FORWARD_TID:
                self.forwards.append((start, end, self._epoch))
                self.forward_steps += 1
            if self.keep_trace and len(self.trace) < self.max_trace_spans:
                self.trace.append(Span(tid, name, start, end, args))

    def add_device_span(self, mode: str, start: Any, end: Any) -> None:
        """Forward stream: timing events around one step (read later, never here)."""
        with self._lock:
            self.device_spans.append((mode, start, end, self._epoch))

    def clear_device_spans(self) -> None:
        with self._lock:
            self.device_spans.clear()

    def device_forward_stats(self, mode: str | None = None) -> DeviceStats:
        """Busy time and gaps between consecutive recorded steps (optionally only
        pairs of `mode` steps) as the forward stream saw them. Waits for the events."""
        with self._lock:
            spans = list(self.device_spans)
        durations: list[float] = []
        gaps: list[float] = []
        for (m0, _s0, e0, ep0), (m1, s1, e1, ep1) in zip(spans, spans[1:]):
            if ep0 != ep1 or (mode is not None and (m0 != mode or m1 != mode)):
                continue
            e1.synchronize()
            gaps.append(max(0.0, e0.elapsed_time(s1)))
            durations.append(s1.elapsed_time(e1))
        if not gaps:
            return DeviceStats(0, 0.0, 0.0, 0.0)
        busy, idle = sum(durations), sum(gaps)
        return DeviceStats(
            len(gaps), statistics.median(gaps), statistics.median(durations), busy / (busy + idle)
        )

    def forward_stats(self) -> tuple[float, float]:
        """(busy fraction, median gap s) over recent back-to-back forwards."""
        with self._lock:
            fw = list(self.forwards)
        busy = gaps_total = 0.0
        gaps: list[float] = []
        for (_s0, e0, ep0), (s1, e1, ep1) in zip(fw, fw[1:]):
            if ep0 != ep1:  # the scheduler went idle in between
                continue
            gap = max(0.0, s1 - e0)
            gaps.append(gap)
            gaps_total += gap
            busy += e1 - s1
        if not gaps:
            return 0.0, 0.0
        return busy / (busy + gaps_total), statistics.median(gaps)

    def write_chrome_trace(self, path: str) -> None:
        with self._lock:
            spans = list(self.trace)
        events: list[dict] = [
            {"ph": "M", "pid": 1, "tid": SCHEDULER_TID, "name": "thread_name", "args": {"name": "scheduler"}},
            {"ph": "M", "pid": 1, "tid": FORWARD_TID, "name": "thread_name", "args": {"name": "forward"}},
        ]
        for s in spans:
            ev = {
                "ph": "X",
                "pid": 1,
                "tid": s.tid,
                "name": s.name,
                "ts": (s.start - self.t0) * 1e6,
                "dur": max(0.0, s.end - s.start) * 1e6,
            }
            if s.args:
                ev["args"] = s.args
            events.append(ev)
        # ts 0 is this time.perf_counter() reading (CLOCK_MONOTONIC, shared by the processes of the
        # machine): a client's own perf_counter stamps line up with the spans.
        with open(path, "w") as f:
            json.dump(
                {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"clock_origin_s": self.t0}}, f
            )
