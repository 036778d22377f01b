"""Test-only feature modules, one per overlap support level.

They are never registered by default; tests and benchmarks pass them to the
engine to exercise the framework (per-batch fallback, policies, matrix) with
behaviour that is easy to check: each bans tokens for its rows, so a wrong
hook order or a stale state changes the output.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch
from service.core.request import Req


@dataclass(frozen=True)
class StepFields:
    """test_full's result fields: the output index of the delta's token."""

    step: int


@dataclass
class BannedTokens:
    """test_full's batch data: batch row -> the token ids its request bans."""

    by_row: dict[int, list[int]]


@dataclass
class PreviousTokenBan:
    """test_sync's batch data: filled by after_launch, read at sampling once `ready` is set."""

    ban: dict[int, int] = field(default_factory=dict)  # batch row -> its previous token
    ready: threading.Event = field(default_factory=threading.Event)


@dataclass
class LiveRequests:
    """test_none's batch data: the live requests themselves (what makes it unsafe to overlap)."""

    by_row: dict[int, Req]


class BanTokensFeature(Feature):
    """full: bans the request's listed token ids at every step (state-free)."""

    name = "test_full"
    support = OverlapSupport.FULL
    reason = "test-only: a fixed logits mask needs nothing from the previous step"

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> list[int]:
        return [int(t) for t in payload]

    def process_logits(self, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        for row, banned in fb.feature_data[BannedTokens].by_row.items():
            logits[row, banned] = float("-inf")
        return logits

    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        batch.fb.feature_data.put(BannedTokens({r: batch.reqs[r].features[self.name] for r in rows}))

    def on_result(self, batch: BatchView, row: int, req: Req, extras: Any) -> StepFields:
        return StepFields(len(req.output_ids))


class NoRepeatFeature(Feature):
    """sync point: bans the request's previous token, which must be real at launch."""

    name = "test_sync"
    support = OverlapSupport.SYNC_POINT
    reason = "test-only: its mask depends on the token the previous batch sampled"

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> bool:
        return True

    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        batch.fb.feature_data.put(PreviousTokenBan())

    def after_launch(self, batch: BatchView, rows: list[int]) -> None:
        data = batch.fb.feature_data[PreviousTokenBan]
        for r in rows:
            out = batch.reqs[r].output_ids
            # Decode rows: the previous batch's token must be processed (no placeholder).
            if batch.reqs[r].launched > 1:
                assert len(out) == batch.reqs[r].launched - 1, "stale state: previous result not processed"
                data.ban[r] = out[-1]
        data.ready.set()

    def process_logits(self, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        data = fb.feature_data[PreviousTokenBan]
        data.ready.wait()
        if data.ban:
            logits = logits.clone()
            for row, tok in data.ban.items():
                logits[row, tok] = float("-inf")
        return logits


class SerialFeature(Feature):
    """none: keeps a per-request counter that the forward thread reads (not overlap-safe)."""

    name = "test_none"
    support = OverlapSupport.NONE
    reason = "test-only: reads scheduler state from the forward thread"

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> int:
        return int(payload)

    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        batch.fb.feature_data.put(LiveRequests({r: batch.reqs[r] for r in rows}))

    def process_logits(self, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        for row, req in fb.feature_data[LiveRequests].by_row.items():
            # Bans token (payload + tokens so far): correct only if output_ids is current.
            logits[row, (req.features[self.name] + len(req.output_ids)) % logits.shape[1]] = float("-inf")
        return logits


class ImagesOnlyFeature(Feature):
    """A feature no text-only model can serve (for the 'not available' path)."""

    name = "test_unavailable"
    support = OverlapSupport.FULL
    reason = "test-only: needs a vision tower"

    def unavailable_reason(self, model: FeatureContext | None) -> str | None:
        return "the model has no vision tower (text-only)"


def fake_features() -> list[Feature]:
    return [BanTokensFeature(), NoRepeatFeature(), SerialFeature(), ImagesOnlyFeature()]
