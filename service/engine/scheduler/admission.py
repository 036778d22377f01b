"""The admission policy: how much KV a request sets aside, and whom a shortage should retract.

The policy (`reserve` / `optimistic`, the new-token ratio) is documented in features/retraction.py,
the request-level side of the same mechanism (its matrix row, payload and counters); the retraction
itself (freeing the victims) is retraction.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from features.retraction import retractions_of
from service.core.request import Req

POLICIES = ("optimistic", "reserve")
# Optimistic admission expects at most this many more tokens of a request, whatever its max_new_tokens
# (SGLang clips its estimate the same way): a request that may run to the end of a long context
# (max_tokens unset on the vLLM contract) would otherwise set aside most of the pool for tokens it
# rarely makes; retraction covers the ones that do.
EXPECTED_TOKENS_CLIP = 4096


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
class RetractionStats:
    retractions: int = 0  # requests retracted (a request retracted twice counts twice)
    events: int = 0  # decode steps that retracted
    sync_points: int = 0  # of those, how many first processed results in flight
    peak_running: int = 0  # most requests admitted at once
    reprefill_tokens: int = 0  # tokens prefilled again


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
        return self._expected(left) if left > 0 else 0

    def cost(self, req: Req) -> int:
        """Rows to set aside to admit a waiting (new or retracted) request."""
        if self.reserved(req):
            return req.budget_tokens
        kept = len(req.output_ids)
        return len(req.prompt_ids) + kept + self._expected(req.max_new_tokens - kept)

    def _expected(self, left: int) -> int:
        """Rows expected of a request that may make `left` more tokens (at least one)."""
        return max(1, math.ceil(self.ratio * min(left, EXPECTED_TOKENS_CLIP)))

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
        candidates = sorted(
            (r for r in decoding if not self.reserved(r)), key=lambda r: (len(r.output_ids), -r.arrival)
        )
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
        budget = sum(min(r.max_new_tokens, EXPECTED_TOKENS_CLIP) for r in survivors)
        self.ratio = min(1.0, max(self.ratio, used / budget))
