"""Output and finish: a processed token's stop checks, the client's deltas, and a request's end.

Each request ends exactly once (`finish`): its KV and request slot go back (through the cache
manager), its features may add fields to its last message, and the delta joins the outbox that
`flush` hands to the output sink once per loop iteration.
"""

from __future__ import annotations

from collections import deque

from features.registry import FeatureRegistry
from service.core.request import FinishReason, OutputSink, Req, RequestOutput
from service.engine.scheduler.cache import CacheManager


class OutputManager:
    def __init__(
        self,
        sink: OutputSink,
        features: FeatureRegistry,
        cache: CacheManager,
        waiting: deque[Req],
        reqs: dict[str, Req],
    ):
        self.sink = sink
        self.features = features
        self.cache = cache
        self.waiting = waiting
        self.reqs = reqs
        self.outbox: list[RequestOutput] = []

    def accept(self, req: Req, token: int) -> None:
        """A real sampled token joins the request's output (before its features and stop checks see it)."""
        req.output_ids.append(token)

    def check_finished_and_emit(self, req: Req, token: int, extras: dict | None = None) -> None:
        """After `token` was appended: stop checks, then the delta for the client."""
        n = len(req.output_ids)
        active = n > req.params.min_new_tokens  # the first min_new_tokens never stop
        match = req.stops.feed(req.detok.add([token]), active)
        if match.matched is not None:
            self.finish(req, FinishReason.STOP, match.matched, match.text, [token], extras=extras)
        elif active and token in req.stop_ids:
            self.finish(req, FinishReason.STOP, token, match.text, [token], extras=extras)
        elif req.feature_stop:
            self.finish(req, FinishReason.STOP, None, match.text, [token], extras=extras)
        elif n >= req.max_new_tokens:
            self.finish(req, FinishReason.LENGTH, None, match.text, [token], extras=extras)
        else:
            self.emit(req, [token], match.text, extras=extras)

    def finish(
        self,
        req: Req,
        reason: FinishReason,
        matched: str | int | None = None,
        text: str = "",
        token_ids: list[int] | None = None,
        error: str | None = None,
        extras: dict | None = None,
        error_code: str = "INTERNAL",
    ) -> None:
        """End a request exactly once: free its KV and request slot, tell the client."""
        if req.finished is not None:
            return
        if reason is FinishReason.LENGTH or (reason is FinishReason.STOP and not isinstance(matched, str)):
            tail = req.stops.feed(req.detok.flush(), len(req.output_ids) > req.params.min_new_tokens)
            text += tail.text
            if tail.matched is not None and matched is None:
                reason, matched = FinishReason.STOP, tail.matched
            elif tail.matched is None:
                text += req.stops.flush()
        req.finished = reason
        self.release(req)
        final: dict = {}
        try:
            final = self.features.on_finish(req)
        finally:
            if final:
                extras = {**(extras or {}), **final}
            self.emit(req, token_ids or [], text, reason, matched, error, extras, error_code)

    def release(self, req: Req) -> None:
        if req.slot >= 0:
            self.cache.free_slot(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.reqs.pop(req.rid, None)

    def emit(
        self,
        req: Req,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None = None,
        matched: str | int | None = None,
        error: str | None = None,
        extras: dict | None = None,
        error_code: str = "INTERNAL",
    ) -> None:
        self.outbox.append(
            RequestOutput(
                req.rid,
                token_ids,
                text,
                len(req.prompt_ids),
                len(req.output_ids),
                reason,
                matched,
                error,
                extras or {},
                error_code,
                cached_tokens=req.cached_tokens,
            )
        )

    def flush(self) -> None:
        if self.outbox:
            out, self.outbox = self.outbox, []
            self.sink(out)
