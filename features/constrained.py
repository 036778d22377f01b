"""Constrained decoding with xgrammar: JSON Schema, any JSON, regex, EBNF, structural tags — overlapped.

Per step, for the batch's constrained rows: the scheduler thread fills a token
bitmask from each matcher's state — once the previous batch's tokens were
accepted, while this batch's forward already runs — and the forward thread
waits for it only at sampling, where it masks the logits. After the result is
on the host each matcher accepts its token; a terminated grammar stops the
request (STOP). EOS is allowed only where the grammar allows it. Grammars
compile off the scheduling thread (features/grammar_backend.py); a request
waits for its grammar without holding up others.

Before compiling, a constraint is *prepared* off the caller thread
(features/json_schema.py): a JSON schema is checked against its metaschema,
normalised (exact rewrites only) and walked for what the grammar cannot enforce —
refused in strict mode, relaxed and reported in lenient mode. When the request
ends, its output is checked (jsonschema, full regex match, or the grammar itself)
and the result goes out on the final message (`constraint_result`).
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from features import json_schema as js
from features import json_tracker as jt
from features.grammar_backend import KINDS, GrammarBackend, GrammarLimits, check_limits, settle
from features.json_schema import SchemaIssue
from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch
from service.core.request import FinishReason, Req, RequestError
from service.models import cpu_kernels

log = logging.getLogger("zerogap.constrained")

UNIQUE = "constrained.unique"  # feature_state key of a request's uniqueItems tracker
MASK_WAIT_S = 120.0  # a forward never waits forever for a mask
MODES = ("strict", "lenient")
MAX_PREPARED = 256  # prepared constraints kept (LRU)
MAX_LISTED_ISSUES = 5  # in a strict-mode refusal
# Whitespace characters allowed at each place JSON inside a structural tag may have some (xgrammar's
# default is any number: a model can then run to max_tokens in blanks). One keeps `": "` and `", "`.
TAG_JSON_MAX_WHITESPACE = 1


@dataclass(frozen=True)
class ConstraintSpec:
    kind: str  # one of KINDS
    text: str = ""  # the schema / regex / grammar / structural tag ("" for json_object)
    mode: str = ""  # strict | lenient | "" (the server's default)


@dataclass(frozen=True)
class Prepared:
    """A constraint ready to compile, and how its outputs are checked."""

    kind: str
    backend_text: str  # what the grammar backend compiles (e.g. the normalised schema)
    normalized: tuple[SchemaIssue, ...] = ()
    relaxed: tuple[SchemaIssue, ...] = ()
    # (output text, compiled grammar) -> violations; runs on the scheduler thread at finish
    check: Callable[[str, Any], list[SchemaIssue]] = field(default=lambda text, compiled: [])
    unique_root: Any = None  # the backend schema when it has uniqueItems: tracked at decode time


@dataclass(frozen=True)
class CompilingConstraint:
    spec: ConstraintSpec
    prepared: Future  # of Prepared
    compiled: Future  # of xgr.CompiledGrammar


def _grammar_check(text: str, compiled: Any) -> list[SchemaIssue]:
    """Whether the whole text is a complete sentence of the compiled grammar."""
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    if not matcher.accept_string(text):
        return [SchemaIssue("", "grammar", "the output is not in the grammar's language")]
    if not matcher.is_completed():
        return [SchemaIssue("", "grammar", "the output is an incomplete sentence of the grammar")]
    return []


def _refusal(kind: str, issues: list[js.Unenforced]) -> RequestError:
    listed = "; ".join(str(i) for i in issues[:MAX_LISTED_ISSUES])
    more = f" (and {len(issues) - MAX_LISTED_ISSUES} more)" if len(issues) > MAX_LISTED_ISSUES else ""
    return RequestError(
        "INVALID_ARGUMENT",
        f"constraint.{kind}: strict mode: the grammar cannot enforce {listed}{more}; "
        "set constraint.mode to LENIENT to relax these and check the output instead",
    )


def prepare_schema(
    kind: str, schema: js.Schema, mode: str
) -> tuple[js.Schema, list[SchemaIssue], list[js.Unenforced]]:
    """(schema for the backend, rewrites, relaxed issues); strict mode raises when anything is unenforced.
    A $ref that cannot be resolved within the schema (another document, or nothing) is refused in
    every mode: neither the grammar nor the output check could apply it, and nothing is fetched."""
    try:
        normalised, rewrites, problems = js.normalise(schema)
    except js.SchemaError as e:
        raise RequestError("INVALID_ARGUMENT", f"constraint.{kind}: {e}") from None
    if problems:
        listed = "; ".join(str(i) for i in problems[:MAX_LISTED_ISSUES])
        more = f" (and {len(problems) - MAX_LISTED_ISSUES} more)" if len(problems) > MAX_LISTED_ISSUES else ""
        raise RequestError("INVALID_ARGUMENT", f"constraint.{kind}: unresolvable $ref: {listed}{more}")
    issues = js.unenforced(normalised, problems)
    if issues and mode == "strict":
        raise _refusal(kind, issues)
    return js.relax(normalised, issues), rewrites, issues


def prepare(spec: ConstraintSpec, mode: str) -> Prepared:
    """Check, normalise and plan the output check of one constraint (any thread)."""
    if spec.kind == "json_schema":
        try:
            schema = js.load(spec.text)
        except js.SchemaError as e:
            raise RequestError("INVALID_ARGUMENT", f"constraint.json_schema: {e}") from None
        backend_schema, rewrites, relaxed = prepare_schema("json_schema", schema, mode)
        validator = js.OutputValidator(schema)
        return Prepared(
            spec.kind,
            json.dumps(backend_schema),
            tuple(rewrites),
            tuple(relaxed),
            lambda text, compiled: validator.violations(text),
            backend_schema if jt.has_unique_items(backend_schema) else None,
        )
    if spec.kind == "structural_tag":
        return _prepare_structural_tag(spec.text, mode)
    if spec.kind == "json_object":
        return Prepared(spec.kind, "", check=lambda text, compiled: js.OutputValidator(True).violations(text))
    if spec.kind == "regex":
        full = js.text_checker("regex", spec.text)
        if full is not None:
            return Prepared(
                spec.kind,
                spec.text,
                check=lambda text, compiled: (
                    []
                    if full(text)
                    else [SchemaIssue("", "regex", "the output does not fully match the regex")]
                ),
            )
    return Prepared(spec.kind, spec.text, check=_grammar_check)


def _prepare_structural_tag(text: str, mode: str) -> Prepared:
    """Normalise every JSON schema inside a structural tag; check each tagged part at the end."""
    try:
        tag = json.loads(text)
        xgr.StructuralTag.from_json(tag)  # the format's own checks (pydantic), for a clean message
    except Exception as e:  # noqa: BLE001 (ValueError / pydantic ValidationError)
        first = str(e).strip().splitlines()
        raise RequestError(
            "INVALID_ARGUMENT", f"constraint.structural_tag: {'; '.join(first[:3])[:400]}"
        ) from None
    rewrites: list[SchemaIssue] = []
    relaxed: list[SchemaIssue] = []
    parts: list[tuple[str, list[str], js.OutputValidator]] = []

    def visit(node: Any, at: str) -> Any:
        if isinstance(node, list):
            return [visit(v, js.ptr(at, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            where = js.ptr(at, "json_schema")
            schema = node["json_schema"]
            try:
                js.load(json.dumps(schema))
            except js.SchemaError as e:
                raise RequestError("INVALID_ARGUMENT", f"constraint.structural_tag: {where}: {e}") from None
            try:
                backend_schema, rw, rel = prepare_schema("structural_tag", schema, mode)
            except RequestError as e:
                raise RequestError(e.code, e.message.replace("enforce /", f"enforce {where}/", 1)) from None
            rewrites.extend(SchemaIssue(where + i.pointer, i.keyword, i.message) for i in rw)
            relaxed.extend(SchemaIssue(where + i.pointer, i.keyword, i.message) for i in rel)
            # bounded whitespace (every style: json, qwen_xml, ...), unless the tag sets its own
            return {"max_whitespace_cnt": TAG_JSON_MAX_WHITESPACE, **node, "json_schema": backend_schema}
        out = {k: visit(v, js.ptr(at, k)) for k, v in node.items()}
        content = node.get("content")
        if (
            node.get("type") == "tag"
            and isinstance(node.get("begin"), str)
            and isinstance(content, dict)
            and content.get("type") == "json_schema"
            and content.get("style", "json") == "json"
        ):
            ends = [node["end"]] if isinstance(node.get("end"), str) else list(node.get("end") or [])
            parts.append(
                (
                    node["begin"],
                    [e for e in ends if isinstance(e, str) and e],
                    js.OutputValidator(content["json_schema"]),
                )
            )
        return out

    backend = visit(tag, "")

    def check(output: str, compiled: Any) -> list[SchemaIssue]:
        return _grammar_check(output, compiled) + _check_tagged_parts(output, parts)

    return Prepared("structural_tag", json.dumps(backend), tuple(rewrites), tuple(relaxed), check)


def _check_tagged_parts(
    text: str, parts: list[tuple[str, list[str], js.OutputValidator]]
) -> list[SchemaIssue]:
    """Each `begin ... end` span of the output validated by its tag's schema."""
    out: list[SchemaIssue] = []
    for begin, ends, validator in parts:
        pos = 0
        while (i := text.find(begin, pos)) >= 0:
            start = i + len(begin)
            hits = [(j, e) for e in ends if (j := text.find(e, start)) >= 0]
            if not hits:
                out.append(SchemaIssue(f"@{i}", "tag", f"{begin!r} is never closed"))
                break
            j, e = min(hits)
            out.extend(
                SchemaIssue(f"@{i}{v.pointer}", v.keyword, v.message)
                for v in validator.violations(text[start:j])
            )
            pos = j + len(e)
    return out


@dataclass(frozen=True)
class ConstraintResult:
    """Result fields of a constrained request's final message (`constraint_result`): whether the
    output satisfies the constraint as sent, and what preparation relaxed or normalised."""

    satisfied: bool
    relaxed: list[SchemaIssue]
    violations: list[SchemaIssue]
    normalized: list[SchemaIssue]


@dataclass
class GrammarMaskBatch:
    """A batch's grammar masks (`fb.feature_data[GrammarMaskBatch]`): filled by after_launch on the
    scheduler thread, read by process_logits on the forward thread once `ready` is set."""

    mask: torch.Tensor  # indexed by batch row; all ones = free
    rows: list[int] = field(default_factory=list)  # the rows whose mask is filled
    row_index: torch.Tensor | None = None  # the same, as an int64 tensor for the native mask kernel
    ready: threading.Event = field(default_factory=threading.Event)
    waited: bool = False  # the forward reached sampling before the mask was filled (a sync point)


def forbid_tokens(row: Any, tokens: list[int]) -> None:
    """Clear `tokens` from one row of an int32 bitmask (numpy), unless that leaves nothing allowed
    (then the grammar's mask stands and the output check reports what the tracker could not stop)."""
    if not tokens:
        return
    ids = np.asarray(tokens, dtype=np.int64)
    ids = ids[ids < row.size * 32]
    words = row.view(np.uint32)
    before = words.copy()
    np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    if not words.any():
        words[:] = before


class ConstrainedDecoding(Feature):
    name = "constrained"
    support = OverlapSupport.FULL
    reads_raw_logits = False  # masks the logits in whatever dtype the model produced
    reason = (
        "the mask is filled by the scheduler while the forward runs, after the previous tokens were "
        "accepted; the forward waits for it only at sampling"
    )

    def __init__(self) -> None:
        self._prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerogap-constraint")
        self._prepared: OrderedDict[tuple[str, str, str], Future] = OrderedDict()  # LRU of Prepared
        self._prepared_lock = threading.Lock()
        self.prepare_s: deque[float] = deque(maxlen=10_000)  # preparation (normalisation) times
        self.check_us: deque[float] = deque(maxlen=100_000)  # output check times at finish
        self._backend: GrammarBackend | None = None
        self._closed = False
        self._backend_lock = threading.Lock()
        self._ctx: FeatureContext | None = None
        self.fill_us: deque[float] = deque(maxlen=100_000)  # mask fill time per row, averaged per batch
        # Fills a batch's masks in one call. One thread: the forward already has both cores here,
        # and a whole batch takes ~1 µs per row.
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        self._init_thread: threading.Thread | None = None

    def bind(self, ctx: FeatureContext) -> None:
        self._ctx = ctx
        # Build the tokenizer info in the background: the first constrained request must not
        # stall the gRPC event loop for it.
        self._init_thread = threading.Thread(
            target=self._build_in_background, name="zerogap-grammar-init", daemon=True
        )
        self._init_thread.start()

    def _build_in_background(self) -> None:
        try:
            self.backend  # noqa: B018 (built on first use)
            self.token_index  # noqa: B018
        except RequestError:  # shut down before it was built
            pass

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:  # built on first use: tokenizer info takes a moment
            if self._backend is None:
                if self._closed:
                    raise RequestError("UNAVAILABLE", "the server is shutting down")
                c = self.ctx
                self._backend = GrammarBackend(c.tokenizer.hf, c.vocab_size, sorted(c.eos_ids), self.limits())
            return self._backend

    @property
    def ctx(self) -> FeatureContext:
        assert self._ctx is not None, "bind() first"
        return self._ctx

    def limits(self) -> GrammarLimits:
        a = self.ctx.args
        return GrammarLimits(
            max_bytes=a.max_constraint_bytes,
            max_depth=a.max_constraint_depth,
            max_properties=a.max_constraint_properties,
            compile_timeout_s=a.grammar_compile_timeout_s,
            max_worker_rss_mb=a.grammar_worker_max_rss_mb,
            workers=a.grammar_workers,
        )

    def shutdown(self) -> None:
        # No thread may still be inside xgrammar's native code when the process exits (it would
        # abort the process: "terminate called without an active exception").
        if self._init_thread is not None:
            self._init_thread.join(timeout=120)
        with self._backend_lock:
            self._closed = True
            if self._backend is not None:
                self._backend.shutdown()

    def mask_fill_stats_us(self) -> tuple[float, float]:
        """(median, p99) over batches of the mask fill time per row, in µs."""
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
        mode = {1: "strict", 2: "lenient"}.get(request.constraint.mode, "")
        return ConstraintSpec(kind, text, mode)

    def to_proto(self, response: Any, fields: list[ConstraintResult]) -> None:
        for f in fields:
            r = response.constraint_result
            r.satisfied = f.satisfied
            for name, issues in (
                ("relaxed", f.relaxed),
                ("violations", f.violations),
                ("normalized", f.normalized),
            ):
                for i in issues:
                    getattr(r, name).add(pointer=i.pointer, keyword=i.keyword, message=i.message)

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> CompilingConstraint:
        spec = ConstraintSpec(**payload) if isinstance(payload, dict) else payload
        if spec.kind not in KINDS:
            raise RequestError("INVALID_ARGUMENT", f"constraint: set one of {', '.join(KINDS)}")
        if spec.kind != "json_object" and not spec.text:
            raise RequestError("INVALID_ARGUMENT", f"constraint.{spec.kind}: empty")
        mode = spec.mode or getattr(ctx.args, "constraint_mode", "lenient")
        if mode not in MODES:
            raise RequestError(
                "INVALID_ARGUMENT", f"constraint.mode: {mode!r} is not one of {', '.join(MODES)}"
            )
        if spec.kind != "json_object":
            check_limits(
                spec.kind, spec.text, self.limits()
            )  # before parsing: bounded size, nesting, objects
        prepared = self._prepare(spec, mode)
        compiled: Future = Future()

        def on_prepared(f: Future) -> None:
            if f.exception() is not None:
                settle(compiled, f)
                return
            p: Prepared = f.result()
            try:
                inner = self.backend.compile(
                    p.kind, p.backend_text
                )  # a ticket: cancelling it stops the compile
            except RequestError as e:
                settle(compiled, e)
                return
            compiled.add_done_callback(lambda c: c.cancelled() and inner.cancel())
            inner.add_done_callback(lambda g: settle(compiled, g))

        prepared.add_done_callback(on_prepared)
        if compiled.done() and compiled.exception() is not None:  # a known-bad constraint fails at once
            raise self._compile_error(spec, compiled.exception())
        return CompilingConstraint(spec, prepared, compiled)

    def _prepare(self, spec: ConstraintSpec, mode: str) -> Future:
        """The Prepared constraint, shared by identical (kind, text, mode); built off the caller thread."""
        key = (spec.kind, spec.text, mode)
        with self._prepared_lock:
            fut = self._prepared.get(key)
            if fut is None:
                fut = self._prepare_pool.submit(self._timed_prepare, spec, mode)
                self._prepared[key] = fut
                while len(self._prepared) > MAX_PREPARED:
                    self._prepared.popitem(last=False)
            else:
                self._prepared.move_to_end(key)
            return fut

    def _timed_prepare(self, spec: ConstraintSpec, mode: str) -> Prepared:
        start = time.perf_counter()
        try:
            return prepare(spec, mode)
        except RequestError:
            raise
        except Exception as e:  # never UNKNOWN: the client learns which constraint and why
            log.exception("preparing a constraint failed")
            raise RequestError(
                "INVALID_ARGUMENT",
                f"constraint.{spec.kind}: cannot prepare this constraint: {type(e).__name__}: {str(e)[:300]}",
            ) from None
        finally:
            self.prepare_s.append(time.perf_counter() - start)

    @staticmethod
    def _compile_error(spec: ConstraintSpec, e: BaseException) -> RequestError:
        if isinstance(e, RequestError):
            return e
        return RequestError("INVALID_ARGUMENT", f"constraint.{spec.kind}: {js.clean_backend_message(str(e))}")

    def pending(self, payload: Any) -> Future:
        return (
            payload.compiled
        )  # its errors are RequestErrors; cancelling it stops the compile (nobody waits)

    # ---- scheduler thread ----------------------------------------------------------------
    def on_admit(self, req: Req) -> None:
        req.ban_stop_before_min = False  # the grammar decides where EOS may come

    def admission_ready(self, req: Req) -> bool:
        c: CompilingConstraint = req.features[self.name]
        if not c.compiled.done():
            timeout = self.ctx.args.grammar_compile_timeout_s
            if time.monotonic() - req.arrival > timeout:
                raise RequestError(
                    "DEADLINE_EXCEEDED",
                    f"constraint.{c.spec.kind}: grammar compilation took longer than {timeout:g}s",
                )
            return False
        if c.compiled.exception() is not None:
            raise self._compile_error(c.spec, c.compiled.exception())
        if self.name not in req.feature_state:
            p: Prepared = c.prepared.result()
            if p.unique_root is not None:
                req.feature_state[UNIQUE] = jt.UniqueTracker(p.unique_root, self.token_index)
            req.feature_state[self.name] = self.backend.matcher(c.compiled.result())
        return True

    @property
    def token_index(self) -> jt.TokenIndex:
        return self.backend.tables.token_index  # built once, in the background at bind (else on first use)

    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        mask = self.backend.allocate_bitmask(len(batch.reqs))
        if self.ctx.device.is_cuda:
            mask = mask.pin_memory()  # its copy to the device is then asynchronous: no host sync
        batch.fb.feature_data.put(GrammarMaskBatch(mask))

    def after_launch(self, batch: BatchView, rows: list[int]) -> None:
        """Fill every live constrained row's mask in one native call (no Python work per row
        but listing the matchers); a row whose grammar allows nothing is left free: on_result
        then fails that request with a clear message."""
        data = batch.fb.feature_data[GrammarMaskBatch]
        try:
            live = [
                r for r in rows if not batch.reqs[r].finished and self.name in batch.reqs[r].feature_state
            ]
            if live:
                matchers = [batch.reqs[r].feature_state[self.name] for r in live]
                mask = data.mask
                start = time.perf_counter()
                self._batch_matcher.batch_fill_next_token_bitmask(matchers, mask, live)
                words = mask.numpy()  # numpy: one vectorized check, no torch op (thread team) per step
                for r in live:
                    tracker = batch.reqs[r].feature_state.get(UNIQUE)
                    if tracker is not None:
                        forbid_tokens(words[r], tracker.forbidden())
                self.fill_us.append((time.perf_counter() - start) * 1e6 / len(live))
                words[~words.any(axis=1)] = -1  # only live rows can be all zeros
            data.rows = live
            data.row_index = torch.tensor(live, dtype=torch.int64)
        finally:
            data.ready.set()

    def waited_on_host(self, batch: BatchView) -> bool:
        data = batch.fb.feature_data.get(GrammarMaskBatch)
        return data is not None and data.waited

    def on_result(self, batch: BatchView, row: int, req: Req, extras: Any) -> None:
        matcher = req.feature_state[self.name]
        token = req.output_ids[-1]
        if not matcher.accept_token(token):
            raise self._rejection(req, matcher, token)
        tracker = req.feature_state.get(UNIQUE)
        if tracker is not None:
            tracker.feed_token(token)
        if matcher.is_terminated():
            req.feature_stop = True
        return None

    def _rejection(self, req: Req, matcher: Any, token: int) -> Exception:
        """A grammar with a dead end (no token may follow) is the client's; anything else is ours."""
        mask = self.backend.allocate_bitmask(1)
        mask.zero_()
        matcher.fill_next_token_bitmask(mask, 0)
        if not bool(mask.any()):
            kind = req.features[self.name].spec.kind
            return RequestError(
                "INVALID_ARGUMENT",
                f"constraint.{kind}: the grammar allows no continuation after "
                f"{len(req.output_ids) - 1} tokens (it matches no complete string there)",
            )
        return RuntimeError(f"the grammar rejected token {token}")

    def on_finish(self, req: Req) -> ConstraintResult | None:
        """The check of the finished output, for the final message (STOP / LENGTH only)."""
        matcher = req.feature_state.pop(self.name, None)
        req.feature_state.pop(UNIQUE, None)
        c: CompilingConstraint | None = req.features.get(self.name)
        if c is not None:
            c.compiled.cancel()  # nobody waits any more: an unfinished compile stops (no-op once compiled)
        if matcher is None or c is None or req.finished not in (FinishReason.STOP, FinishReason.LENGTH):
            return None
        start = time.perf_counter()
        p: Prepared = c.prepared.result()
        text = self.output_text(req)
        try:
            violations = p.check(text, c.compiled.result())
        except Exception as e:  # noqa: BLE001 (a check must never fail the request)
            violations = [SchemaIssue("", "check", f"could not check the output: {type(e).__name__}: {e}")]
        self.check_us.append((time.perf_counter() - start) * 1e6)
        return ConstraintResult(not violations, list(p.relaxed), violations, list(p.normalized))

    def output_text(self, req: Req) -> str:
        """The client's text without the end-of-sequence token that completed the grammar, cut at a
        matched stop string."""
        ids = list(req.output_ids)
        if ids and ids[-1] in self.ctx.eos_ids:
            ids.pop()
        text = self.ctx.tokenizer.decode(ids, req.params.skip_special_tokens)
        cuts = [i for s in req.params.stop if s and (i := text.find(s)) >= 0]
        return text[: min(cuts)] if cuts else text

    def on_retract(self, req: Req) -> None:
        self.rebuild_state(req)

    def rebuild_state(self, req: Req) -> None:
        """Rebuild a request's matcher from its kept output tokens (e.g. after retraction)."""
        matcher = req.feature_state[self.name]
        matcher.reset()
        tracker = req.feature_state.get(UNIQUE)
        if tracker is not None:
            tracker.reset()
        for token in req.output_ids:
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar rejected kept token {token}")
            if tracker is not None:
                tracker.feed_token(token)

    # ---- forward thread ------------------------------------------------------------------
    def process_logits(self, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        data = fb.feature_data[GrammarMaskBatch]
        queued = None
        if not data.ready.is_set() and self.ctx.device.is_cuda:
            queued = self.ctx.device.record_event()  # the end of the work enqueued so far
        late = not data.ready.is_set()
        if not data.ready.wait(MASK_WAIT_S):
            raise RuntimeError("the grammar mask was not filled in time")
        # A sync point when the device ran dry meanwhile (CUDA: the enqueued work had finished when
        # the mask came; CPU: the forward thread is the device, so any wait).
        data.waited = late and (queued is None or bool(queued.query()))
        if any(f.reads_raw_logits for f, _ in fb.features):
            logits = logits.clone()  # keep the raw logits intact (logprobs)
        if not data.rows:
            return logits
        if not cpu_kernels.apply_token_bitmask_(logits, data.mask, data.row_index):
            mask = data.mask.to(logits.device, non_blocking=True)  # filled on the host (pinned on CUDA)
            # Every row (the others' masks are all ones): a host list of indices would be copied with a sync.
            xgr.apply_token_bitmask_inplace(logits, mask)  # CUDA: xgrammar's Triton kernel
        return logits
