"""Constrained decoding with xgrammar: JSON Schema, any JSON, regex, EBNF — overlapped.

Per step, for the batch's constrained rows: the scheduler thread fills a token
bitmask from each matcher's state — once the previous batch's tokens were
accepted, while this batch's forward already runs — and the forward thread
waits for it only at sampling, where it masks the logits. After the result is
on the host each matcher accepts its token; a terminated grammar stops the
request (STOP). EOS is allowed only where the grammar allows it. Grammars
compile off the scheduling thread (features/grammar_backend.py); a request
waits for its grammar without holding up others.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from concurrent.futures import Future
from typing import Any

import torch
import xgrammar as xgr

from features.base import Feature, OverlapSupport
from features.grammar_backend import KINDS, GrammarBackend
from service.engine.request import RequestError

MASK_WAIT_S = 120.0  # a forward never waits forever for a mask


@dataclass(frozen=True)
class ConstraintSpec:
    kind: str  # one of KINDS
    text: str = ""  # the schema / regex / grammar ("" for json_object)


@dataclass(frozen=True)
class CompilingConstraint:
    spec: ConstraintSpec
    compiled: Future  # of xgr.CompiledGrammar


class ConstrainedDecoding(Feature):
    name = "constrained"
    support = OverlapSupport.FULL
    reason = ("the mask is filled by the scheduler while the forward runs, after the previous tokens were "
              "accepted; the forward waits for it only at sampling")

    def __init__(self) -> None:
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._engine: Any = None
        self.fill_us: deque[float] = deque(maxlen=100_000)  # per-row mask fill times

    def bind(self, engine: Any) -> None:
        self._engine = engine
        # Build the tokenizer info in the background: the first constrained request must not
        # stall the gRPC event loop for it.
        threading.Thread(target=lambda: self.backend, name="zerogap-grammar-init", daemon=True).start()

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:  # built on first use: tokenizer info takes a moment
            if self._backend is None:
                e = self._engine
                self._backend = GrammarBackend(e.tokenizer.hf, e.vocab_size, sorted(e.eos_ids))
            return self._backend

    def mask_fill_stats_us(self) -> tuple[float, float]:
        """(median, p99) of per-row mask fill times in µs."""
        xs = sorted(self.fill_us)
        if not xs:
            return 0.0, 0.0
        return statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))]

    # ---- caller thread -------------------------------------------------------------------
    def from_proto(self, request: Any) -> ConstraintSpec | None:
        if not request.HasField("constraint"):
            return None
        kind = request.constraint.WhichOneof("kind") or ""
        text = "" if kind in ("", "json_object") else getattr(request.constraint, kind)
        return ConstraintSpec(kind, text)

    def validate(self, payload: Any, engine: Any, prompt_ids: list[int]) -> CompilingConstraint:
        spec = ConstraintSpec(**payload) if isinstance(payload, dict) else payload
        if spec.kind not in KINDS:
            raise RequestError("INVALID_ARGUMENT", f"constraint: set one of {', '.join(KINDS)}")
        if spec.kind != "json_object" and not spec.text:
            raise RequestError("INVALID_ARGUMENT", f"constraint.{spec.kind}: empty")
        if spec.kind == "json_schema":
            try:
                json.loads(spec.text)
            except ValueError as e:
                raise RequestError("INVALID_ARGUMENT", f"constraint.json_schema: not valid JSON: {e}") from None
        fut = self.backend.compile(spec.kind, spec.text)
        if fut.done() and fut.exception() is not None:  # a known-bad grammar fails at once
            raise RequestError("INVALID_ARGUMENT", f"constraint.{spec.kind}: {fut.exception()}")
        return CompilingConstraint(spec, fut)

    # ---- scheduler thread ----------------------------------------------------------------
    def on_admit(self, req: Any) -> None:
        req.ban_stop_before_min = False  # the grammar decides where EOS may come

    def admission_ready(self, req: Any) -> bool:
        c: CompilingConstraint = req.features[self.name]
        if not c.compiled.done():
            timeout = self._engine.args.grammar_compile_timeout_s
            if time.monotonic() - req.arrival > timeout:
                raise RequestError("DEADLINE_EXCEEDED", f"constraint.{c.spec.kind}: grammar compilation took longer than {timeout:g}s")
            return False
        if c.compiled.exception() is not None:
            raise RequestError("INVALID_ARGUMENT", f"constraint.{c.spec.kind}: {c.compiled.exception()}")
        if self.name not in req.feature_state:
            req.feature_state[self.name] = self.backend.matcher(c.compiled.result())
        return True

    def on_batch_formed(self, batch: Any, rows: list[int]) -> None:
        batch.fb.feature_data[self.name] = {
            "rows": rows,
            "mask": self.backend.allocate_bitmask(len(batch.reqs)),  # indexed by batch row
            "ready": threading.Event(),
        }

    def after_launch(self, batch: Any, rows: list[int]) -> None:
        data = batch.fb.feature_data[self.name]
        try:
            for r in rows:
                req = batch.reqs[r]
                matcher = req.feature_state.get(self.name)
                if req.finished or matcher is None:
                    continue  # its token will be dropped; leave the row unconstrained
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(data["mask"], r)
                self.fill_us.append((time.perf_counter() - start) * 1e6)
        finally:
            data["ready"].set()

    def on_result(self, batch: Any, row: int, req: Any, extras: Any) -> None:
        matcher = req.feature_state[self.name]
        token = req.output_ids[-1]
        if not matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token}")
        if matcher.is_terminated():
            req.feature_stop = True
        return None

    def on_finish(self, req: Any) -> None:
        req.feature_state.pop(self.name, None)

    def on_retract(self, req: Any) -> None:
        self.rebuild_state(req)

    def rebuild_state(self, req: Any) -> None:
        """Rebuild a request's matcher from its kept output tokens (e.g. after retraction)."""
        matcher = req.feature_state[self.name]
        matcher.reset()
        for token in req.output_ids:
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar rejected kept token {token}")

    # ---- forward thread ------------------------------------------------------------------
    def process_logits(self, fb: Any, logits: torch.Tensor) -> torch.Tensor:
        data = fb.feature_data[self.name]
        if not data["ready"].wait(MASK_WAIT_S):
            raise RuntimeError("the grammar mask was not filled in time")
        logits = logits.clone()  # keep the raw logits intact (logprobs)
        mask = data["mask"].to(logits.device, non_blocking=True)  # filled on the host
        xgr.apply_token_bitmask_inplace(logits, mask, indices=data["rows"])
        return logits
