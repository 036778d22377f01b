"""A request's time to first token split along a server's forward spans (`--trace-file`).

The trace's `otherData.clock_origin_s` is the server's perf_counter reading at ts 0 (CLOCK_MONOTONIC,
shared by the machine's processes), so a client's own perf_counter stamps line up with the spans.
A turn sent at `sent` whose first token came at `first` splits into: what was left of the step in
flight at `sent`, the wait from then to the start of the turn's own step (the last forward to end
before `first`), that step, and the delivery from its end to the client.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

Forward = tuple[float, float, str, dict]  # start, end (client clock), name, args


def load_forwards(trace_path: Path) -> list[Forward]:
    doc = json.loads(trace_path.read_text())
    origin = doc["otherData"]["clock_origin_s"]
    return sorted(
        (origin + e["ts"] / 1e6, origin + (e["ts"] + e["dur"]) / 1e6, e["name"], e.get("args", {}))
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["name"].startswith("forward")
    )


def shape(f: Forward) -> str:
    return f"{f[2]} {f[3].get('bs')}x{f[3].get('tokens')}"


def split_turn(forwards: list[Forward], sent: float, first: float) -> dict | None:
    """One turn's parts in ms (None: no step of its own after `sent`, e.g. the trace was cut short).
    `forwards` as load_forwards gives them: one forward thread's steps, so sorted by start and by end."""
    i = bisect.bisect_right(forwards, sent, key=lambda f: f[0]) - 1  # the last step started by `sent`
    in_flight = forwards[i] if i >= 0 and sent < forwards[i][1] else None
    j = bisect.bisect_right(forwards, first, key=lambda f: f[1]) - 1  # the last step ended by `first`
    own = forwards[j] if j >= 0 else None
    if own is None or own[0] < sent:
        return None
    left = in_flight[1] - sent if in_flight else 0.0
    return dict(
        ttft_ms=round((first - sent) * 1e3, 1),
        in_flight=shape(in_flight) if in_flight else "",
        in_flight_tokens=int(in_flight[3].get("tokens", 0)) if in_flight else 0,
        in_flight_left_ms=round(left * 1e3, 1),
        wait_ms=round((own[0] - sent - left) * 1e3, 1),
        step=shape(own),
        step_tokens=int(own[3].get("tokens", 0)),
        step_ms=round((own[1] - own[0]) * 1e3, 1),
        delivery_ms=round((first - own[1]) * 1e3, 1),
    )


def breakdown(trace_path: Path, turns: list[tuple[float, float]]) -> list[dict]:
    """Each turn (sent, first token; perf_counter seconds) split along the server's forward spans."""
    forwards = load_forwards(trace_path)
    return [r for sent, first in turns if (r := split_turn(forwards, sent, first)) is not None]


PARTS = ("in_flight_left_ms", "wait_ms", "step_ms", "delivery_ms")
