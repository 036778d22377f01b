"""Retraction under memory pressure, with optimistic admission — fully overlapped.

Admission. `reserve` sets aside a request's whole budget (prompt + max_new_tokens)
when it is admitted: nothing ever runs out, and the pool mostly idles because
most requests stop long before max_new_tokens. `optimistic` (the default) sets
aside the prompt plus an estimate: `new_token_ratio` × the tokens it may still
generate. The ratio starts at `init_ratio`, decays towards `min_ratio` with every
decode step that needed no retraction, and backs off after a retraction to at
least the share of max_new_tokens the surviving requests already used (plus a
few steps of headroom): admitting below what running requests demonstrably use
would only retract again.

Retraction. Before a decode batch is formed, every running request that will
launch a token needs one KV row. When the pool is short, the scheduler first
processes every result in flight (one counted sync point per retraction event,
which is rare: the ratio backs off), so a victim has no batch on the forward
thread: the token of its last batch was appended exactly once, its future
placeholder was resolved, and no in-flight batch can write its KV rows any
more. Then victims are retracted until the survivors can run `headroom_steps`
steps: their KV and request slot are freed and they go back to the head of the
queue, to be re-prefilled from prompt + the tokens generated so far (real ids).

Victims: fewest output tokens first (the least decode progress is lost and the
re-prefill is short), the latest arrival on ties (older requests keep going). A
request retracted `max_retractions` times is re-admitted with its whole
remaining budget reserved and is never a victim again: retraction is bounded
per request. Such reservations are counted in full by later admissions, so a
shortage always has a victim among the optimistic requests.

What survives a retraction: the kept output tokens (re-prefilled), the seeded
sampling counter (the re-prefill samples token len(output_ids), as a decode step
would), penalty counts (this module re-counts the kept tokens on the forward
thread after the new slot's state was reset), the grammar matcher (rebuilt by
`on_retract` from the kept tokens), the stop-string matcher and detokenizer (never
touched: nothing is re-emitted), logprobs (no input logprobs for a re-prefill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from service.core.feature import Feature, OverlapSupport
from service.core.forward_batch import ForwardMode
from service.core.request import Req, RequestError

POLICIES = ("optimistic", "reserve")


@dataclass
class RetractionConfig:
    policy: str = "optimistic"  # optimistic | reserve
    init_ratio: float = 0.7  # share of the remaining max_new_tokens set aside at admission
    min_ratio: float = 0.1
    decay_steps: int = 600  # decode steps without retraction from init_ratio down to min_ratio
    max_retractions: int = 3  # per request; then it runs with its whole budget reserved
    headroom_steps: int = 4  # after a retraction the survivors can run this many steps

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown admission policy {self.policy!r} (one of {', '.join(POLICIES)})")
        if not 0 < self.min_ratio <= self.init_ratio <= 1:
            raise ValueError("new-token ratios: need 0 < min <= init <= 1")
        if self.max_retractions < 0 or self.decay_steps < 1 or self.headroom_steps < 1:
            raise ValueError("max_retractions >= 0, decay_steps >= 1, headroom_steps >= 1")


@dataclass
class Retracted:
    """A retracted request's payload (`req.features['retraction']`)."""

    count: int = 0  # times retracted


@dataclass
class RetractionStats:
    retractions: int = 0  # requests retracted (a request retracted twice counts twice)
    events: int = 0  # decode steps that retracted
    sync_points: int = 0  # of those, how many first processed results in flight
    peak_running: int = 0  # most requests admitted at once
    reprefill_tokens: int = 0  # tokens prefilled again


def retractions_of(req: Req) -> int:
    state = req.features.get(RetractionFeature.name)
    return state.count if isinstance(state, Retracted) else 0


@dataclass
class AdmissionPolicy:
    """How much KV admission sets aside per request, and whom a shortage retracts."""

    config: RetractionConfig = field(default_factory=RetractionConfig)
    stats: RetractionStats = field(default_factory=RetractionStats)

    def __post_init__(self) -> None:
        self.ratio = self.config.init_ratio

    @property
    def optimistic(self) -> bool:
        return self.config.policy == "optimistic"

    def reserved(self, req: Req) -> bool:
        """Runs with its whole budget set aside (never a victim)."""
        return not self.optimistic or retractions_of(req) >= self.config.max_retractions

    # ---- admission -------------------------------------------------------------------
    def room(self, running: list[Req], free_rows: int, reserved_tokens: int, pool_size: int) -> int:
        """KV rows new admissions may take now. `reserve`: the pool less every admitted budget (as
        before this module); `optimistic`: the free rows less what running requests are expected to take."""
        if not self.optimistic:
            return pool_size - reserved_tokens
        return free_rows - sum(self.future_rows(r) for r in running if not r.finished)

    def future_rows(self, req: Req) -> int:
        """Rows a running request is expected to take from now on."""
        if self.reserved(req):
            return max(0, req.budget_tokens - req.kv_len)
        left = req.max_new_tokens - req.launched
        return max(1, math.ceil(self.ratio * left)) if left > 0 else 0

    def cost(self, req: Req) -> int:
        """Rows to set aside to admit a waiting (new or retracted) request."""
        if self.reserved(req):
            return req.budget_tokens
        kept = len(req.output_ids)
        return len(req.prompt_ids) + kept + max(1, math.ceil(self.ratio * (req.max_new_tokens - kept)))

    def admitted(self, running: int) -> None:
        self.stats.peak_running = max(self.stats.peak_running, running)

    # ---- decode ----------------------------------------------------------------------
    def on_decode_step(self) -> None:
        c = self.config
        self.ratio = max(c.min_ratio, self.ratio - (c.init_ratio - c.min_ratio) / c.decay_steps)

    def victims(self, decoding: list[Req], free_rows: int) -> list[Req]:
        """None when each decoding request gets a row now; else whom to retract so that the others each
        get a row for `headroom_steps` steps (fewer victims if the candidates run out: at least one step)."""
        if free_rows >= len(decoding):
            return []
        want = self.config.headroom_steps
        candidates = sorted((r for r in decoding if not self.reserved(r)), key=lambda r: (len(r.output_ids), -r.arrival))
        out: list[Req] = []
        n = len(decoding)
        for r in candidates:
            if free_rows >= n * want or n <= 1:
                break
            out.append(r)
            free_rows += r.kv_len
            n -= 1
        return out

    def after_retraction(self, survivors: list[Req]) -> None:
        """Back off: at least the share of max_new_tokens the survivors used, plus the headroom."""
        if not survivors:
            return
        used = sum(r.launched + self.config.headroom_steps for r in survivors)
        budget = sum(r.max_new_tokens for r in survivors)
        self.ratio = min(1.0, max(self.ratio, used / budget))


class RetractionFeature(Feature):
    """The module's declaration, per-request counters and penalty-state restore.

    A request carries this feature once it was retracted (the scheduler attaches a
    `Retracted` payload): its batches are counted in the matrix, its responses carry
    `usage.retractions`, and its re-prefill re-counts the kept tokens for penalties.
    """

    name = "retraction"
    support = OverlapSupport.FULL
    reads_raw_logits = False
    reason = ("a shortage first processes the results in flight (one counted sync point per retraction): victims "
              "have no batch on the forward thread; re-prefills overlap as usual")

    def __init__(self) -> None:
        self._engine: Any = None

    def bind(self, engine: Any) -> None:
        self._engine = engine

    # ---- caller thread -------------------------------------------------------------------
    def validate(self, payload: Any, engine: Any, prompt_ids: list[int]) -> Any:
        raise RequestError("INVALID_ARGUMENT", "retraction: set by the scheduler, not by a request")

    def to_proto(self, response: Any, fields: list[dict[str, Any]]) -> None:
        response.usage.retractions = max(f["retractions"] for f in fields)

    # ---- scheduler thread ----------------------------------------------------------------
    def on_batch_formed(self, batch: Any, rows: list[int]) -> None:
        """A re-prefill of a penalised request: its kept output tokens count again (forward thread)."""
        if batch.mode is not ForwardMode.EXTEND:
            return
        reqs = [batch.reqs[r] for r in rows if batch.reqs[r].uses_penalties and batch.reqs[r].output_ids]
        if not reqs:
            return
        slots = torch.repeat_interleave(torch.tensor([r.slot for r in reqs], dtype=torch.int64),
                                        torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64))
        tokens = torch.tensor([t for r in reqs for t in r.output_ids], dtype=torch.int64)
        device = getattr(self._engine, "device", None)
        if device is not None:
            slots, tokens = device.to_device(slots, tokens)
        batch.fb.feature_data[self.name] = (slots, tokens)

    def on_result(self, batch: Any, row: int, req: Any, extras: Any) -> dict[str, Any]:
        return {"retractions": retractions_of(req)}

    def on_finish(self, req: Any) -> dict[str, Any] | None:
        return {"retractions": retractions_of(req)}

    # ---- forward thread ------------------------------------------------------------------
    def process_logits(self, fb: Any, logits: torch.Tensor) -> torch.Tensor:
        """Runs after the new slots' sampler state was reset and before sampling."""
        restore = fb.feature_data.get(self.name)
        if restore is not None:
            self._engine.worker.sampler.count_tokens(*restore)
        return logits
