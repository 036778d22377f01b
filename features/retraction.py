"""Retraction under memory pressure, with optimistic admission — fully overlapped.

This module is the request-level side (the `Retracted` payload, usage counters, the penalty-state
restore); the admission policy and the retraction itself are the scheduler's managers
(service/engine/scheduler/admission.py, retraction.py).

Admission. `reserve` sets aside a request's whole budget (prompt + max_new_tokens)
when it is admitted: nothing ever runs out, and the pool mostly idles because
most requests stop long before max_new_tokens. `optimistic` (the default) sets
aside the prompt plus an estimate: `new_token_ratio` × the tokens it may still
generate, at most 4,096 of them (`EXPECTED_TOKENS_CLIP`: a request that may run to
the end of a long context would otherwise set most of the pool aside). The ratio starts at `init_ratio`, decays towards `min_ratio` with every
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

from dataclasses import dataclass
from typing import Any

import torch

from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch, ForwardMode
from service.core.request import Req, RequestError


@dataclass
class Retracted:
    """A retracted request's payload (`req.features['retraction']`)."""

    count: int = 0  # times retracted


@dataclass
class PenaltyRecount:
    """A re-prefill batch's data (`fb.feature_data[PenaltyRecount]`): the kept output tokens to count
    again into the sampler's penalty state, as (slot, token) pairs on the device."""

    slots: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class RetractionFields:
    """Result fields: the times the request was retracted so far (`usage.retractions`)."""

    retractions: int


def retractions_of(req: Req) -> int:
    state = req.features.get(RetractionFeature.name)
    return state.count if isinstance(state, Retracted) else 0


class RetractionFeature(Feature):
    """The module's declaration, per-request counters and penalty-state restore.

    A request carries this feature once it was retracted (the scheduler attaches a
    `Retracted` payload): its batches are counted in the matrix, its responses carry
    `usage.retractions`, and its re-prefill re-counts the kept tokens for penalties.
    """

    name = "retraction"
    support = OverlapSupport.FULL
    sync_event = "retraction event"
    reads_raw_logits = False
    reason = (
        "a KV shortage first processes the results in flight (the declared sync point, counted per event): "
        "victims have no batch on the forward thread; re-prefills overlap as usual"
    )

    def __init__(self) -> None:
        self._ctx: FeatureContext | None = None

    def bind(self, ctx: FeatureContext) -> None:
        self._ctx = ctx

    # ---- caller thread -------------------------------------------------------------------
    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> Any:
        raise RequestError("INVALID_ARGUMENT", "retraction: set by the scheduler, not by a request")

    def to_proto(self, response: Any, fields: list[RetractionFields]) -> None:
        response.usage.retractions = max(f.retractions for f in fields)

    # ---- scheduler thread ----------------------------------------------------------------
    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        """A re-prefill of a penalised request: its kept output tokens count again (forward thread)."""
        if batch.mode is not ForwardMode.EXTEND:
            return
        reqs = [batch.reqs[r] for r in rows if batch.reqs[r].uses_penalties and batch.reqs[r].output_ids]
        if not reqs:
            return
        slots = torch.repeat_interleave(
            torch.tensor([r.slot for r in reqs], dtype=torch.int64),
            torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64),
        )
        tokens = torch.tensor([t for r in reqs for t in r.output_ids], dtype=torch.int64)
        if self._ctx is not None:
            slots, tokens = self._ctx.device.to_device(slots, tokens)
        batch.fb.feature_data.put(PenaltyRecount(slots, tokens))

    def on_result(self, batch: BatchView, row: int, req: Req, extras: Any) -> RetractionFields:
        return RetractionFields(retractions_of(req))

    def on_finish(self, req: Req) -> RetractionFields:
        return RetractionFields(retractions_of(req))

    # ---- forward thread ------------------------------------------------------------------
    def process_logits(self, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        """Runs after the new slots' sampler state was reset and before sampling."""
        restore = fb.feature_data.get(PenaltyRecount)
        if restore is not None:
            assert self._ctx is not None
            self._ctx.count_tokens(restore.slots, restore.tokens)
        return logits
