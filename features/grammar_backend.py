"""The grammar engine behind constrained decoding: xgrammar, compiles bounded by worker processes.

xgrammar's compile cannot be interrupted in-process, and its cost is hard to
predict (about quadratic in an object's properties). So every new grammar is
first compiled in a worker process, as a trial that can really be stopped: the
worker is killed when the compile outlives its deadline, grows past its memory
bound, when no request waits for it any more, or at shutdown; a fresh worker
(forked from a forkserver with xgrammar preloaded) takes its place. Once the
trial succeeded, the server compiles the same text in-process (same input,
same bounded cost) and checks that the grammar accepts some output. The result
is not shipped back: `CompiledGrammar.serialize_json` is cheap for most
grammars but took more than 8 GB for a 64 KB SchemaStore schema whose compiled
form is 7 MB.

Before anything compiles, `check_limits` bounds the client's text (size,
nesting, object size). One job per (kind, text) is shared by every request that
asks for the same grammar, and compiled grammars are cached (LRU). Small
grammars are never starved by big ones: at most `workers - 1` large compiles
run at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from features import json_tracker as jt
from features.json_schema import clean_backend_message
from service.core.request import RequestError

log = logging.getLogger("zerogap.grammar")

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
JSON_KINDS = ("json_schema", "structural_tag")  # texts that are JSON
MAX_CACHED_GRAMMARS = 1024
JSON_SEPARATORS = (",", ":")  # compact JSON: no free whitespace anywhere
ANY_JSON = '{"anyOf": [{"type": "object"}, {"type": "array"}]}'  # json_object: what xgrammar's builtin JSON grammar allows
POLL_S = 0.05  # how often a running compile is checked for deadline, memory and waiters


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = (
        8 << 20
    )  # grammar text (schema / regex / EBNF) size: deadline and memory bound the compile
    max_depth: int = 64  # bracket nesting of a schema, parenthesis nesting of a regex / EBNF
    max_properties: int = 1024  # properties of one schema object (1,000: ~1 s to compile, 2,000: ~22 s)
    compile_timeout_s: float = 30.0  # from the first request for it, queueing included
    max_worker_rss_mb: int = 2048  # a compile that grows its worker past this is stopped
    workers: int = 2
    large_bytes: int = 8 << 10  # a text above this is a "large" compile
    small_compile_s: float = 2.0  # a compile running longer than this counts as large too


class GrammarError(RequestError):
    """A grammar that cannot be served, with the gRPC status for the client and the field named.
    `heavy`: stopped at a compile limit (time, memory) that its own compile reached, not the wait for
    a worker: the same grammar fails the same way again (a gateway's retries are in vain)."""

    def __init__(self, code: str, kind: str, detail: str, heavy: bool = False):
        super().__init__(code, f"constraint.{kind}: {detail}")
        self.heavy = heavy


def nesting_depth(text: str, kind: str) -> int:
    """Deepest bracket nesting, scanned without recursion: `{[` for JSON, `(` for regex and EBNF
    (outside strings, escapes and character classes)."""
    opens, closes = ("{[", "}]") if kind in JSON_KINDS else ("(", ")")
    quoted = kind != "regex"
    depth = best = 0
    i, n = 0, len(text)
    in_str = in_class = False
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if in_str:
            in_str = c != '"'
        elif in_class:
            in_class = c != "]"
        elif c == '"' and quoted:
            in_str = True
        elif c == "[" and kind not in JSON_KINDS:
            in_class = True
        elif c in opens:
            depth += 1
            best = max(best, depth)
        elif c in closes:
            depth -= 1
        i += 1
    return best


def check_limits(kind: str, text: str, limits: GrammarLimits) -> None:
    """Refuse, before compiling, a grammar text beyond the size, nesting or object-size limits."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarError(
            "INVALID_ARGUMENT",
            kind,
            f"{size} bytes exceed the limit of {limits.max_bytes} (--max-constraint-bytes)",
        )
    depth = nesting_depth(text, kind)
    if depth > limits.max_depth:
        raise GrammarError(
            "INVALID_ARGUMENT",
            kind,
            f"nesting depth {depth} exceeds the limit of {limits.max_depth} (--max-constraint-depth)",
        )
    if kind in JSON_KINDS:
        try:
            schema = json.loads(text.removeprefix("\ufeff"))  # safe: the nesting is bounded
        except ValueError:
            return  # reported as invalid JSON by the caller
        most = max_object_properties(schema)
        if most > limits.max_properties:
            raise GrammarError(
                "INVALID_ARGUMENT",
                kind,
                f"an object with {most} properties exceeds the limit of "
                f"{limits.max_properties} (--max-constraint-properties)",
            )


def max_object_properties(schema: Any) -> int:
    """The largest `properties` map anywhere in a JSON schema (iterative walk)."""
    most, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                most = max(most, len(props))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return most


def compile_text(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
    if kind == "json_object":  # an object or array, compact
        return compiler.compile_json_schema(
            ANY_JSON, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
        )
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(text)
    raise ValueError(f"unknown constraint kind {kind!r}")


def worker_main(conn: Connection) -> None:
    """A compile worker (see _WorkerSlot): the tokenizer info first, then (kind, text) in,
    ("ok", "") or ("error", message) out, until the pipe closes."""
    _die_with_parent()
    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compile_text(compiler, kind, text)
            reply = ("ok", "")
        except Exception as e:  # xgrammar's parse / schema errors: the client's grammar
            reply = ("error", str(e).strip() or type(e).__name__)
        conn.send(reply)


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent (the forkserver, which exits with the
    server) exits, however that happens."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def settle(dst: Future, src: Future | BaseException) -> None:
    """Copy a finished future (or an exception) into dst, unless dst was cancelled meanwhile."""
    try:
        if isinstance(src, BaseException):
            dst.set_exception(src)
        elif src.cancelled():
            dst.cancel()
        elif src.exception() is not None:
            dst.set_exception(src.exception())
        else:
            dst.set_result(src.result())
    except InvalidStateError:  # cancelled by its waiter meanwhile
        pass


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError, IndexError):
        return 0.0


class TokenizerTables:
    """What the grammar engine derives from a tokenizer: xgrammar's TokenizerInfo (and the JSON the
    workers receive it as) and the token index of the JSON tracker (built on first use)."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.info = info
        self.info_json = info.serialize_json()
        self._token_index: jt.TokenIndex | None = None
        self._lock = threading.Lock()

    @property
    def token_index(self) -> jt.TokenIndex:
        with self._lock:
            if self._token_index is None:
                self._token_index = jt.TokenIndex(list(self.info.decoded_vocab))
            return self._token_index


_TABLES: OrderedDict[tuple, TokenizerTables] = OrderedDict()
_TABLES_LOCK = threading.Lock()
MAX_SHARED_TABLES = 4


def tokenizer_tables(hf_tokenizer, vocab_size: int, stop_token_ids: list[int]) -> TokenizerTables:
    """The tables of a tokenizer, built once per process for each tokenizer content (a hash of its
    serialised form), model vocabulary size and stop ids: the engines a process starts (benchmarks,
    the GPU check, the test suite's hundreds) share them instead of rebuilding ~0.5 s of CPU each."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:  # not a fast tokenizer: nothing cheap to know it by
        return _build_tables(hf_tokenizer, vocab_size, stop_token_ids)
    content = hashlib.sha256(backend.to_str().encode()).hexdigest()
    key = (type(hf_tokenizer).__qualname__, content, len(hf_tokenizer), vocab_size, tuple(stop_token_ids))
    with _TABLES_LOCK:
        if key not in _TABLES:
            _TABLES[key] = _build_tables(hf_tokenizer, vocab_size, stop_token_ids)
            while len(_TABLES) > MAX_SHARED_TABLES:
                _TABLES.popitem(last=False)
        _TABLES.move_to_end(key)
        return _TABLES[key]


def _build_tables(hf_tokenizer, vocab_size: int, stop_token_ids: list[int]) -> TokenizerTables:
    return TokenizerTables(
        xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    )


@dataclass
class CompileStats:
    compiles: int = 0
    cache_hits: int = 0
    last_compile_s: float = 0.0
    stopped: dict[str, int] = field(default_factory=dict)  # compiles whose worker was killed, by status


@dataclass(eq=False)
class _Job:
    kind: str
    text: str
    result: Future  # of xgr.CompiledGrammar, shared by the job's waiters
    created: float
    large: bool
    waiters: int = 0
    started: float | None = None
    trial_s: float | None = None  # the worker's compile (the trial), seconds
    peak_rss_mb: float = 0.0  # the worker's largest resident size seen while it compiled


class GrammarTicket(Future):
    """One waiter's view of a compile. Cancelling it (or `release()`) says that nobody behind it
    waits any more; a compile that nobody waits for is stopped."""

    def __init__(self, backend: "GrammarBackend", job: _Job):
        super().__init__()
        self.job = job  # its timings (benchmarks)
        self._release = lambda: backend._release(job)
        job.result.add_done_callback(lambda src: settle(self, src))
        self.add_done_callback(lambda f: f.cancelled() and self._release())

    def release(self) -> None:
        self.cancel()  # no-op once done


class GrammarBackend:
    """Compiles grammars for one tokenizer/vocabulary in worker processes and builds matchers."""

    def __init__(
        self,
        hf_tokenizer,
        model_vocab_size: int,
        stop_token_ids: list[int],
        limits: GrammarLimits | None = None,
    ):
        # The model's vocabulary may be larger than the tokenizer's: xgrammar masks the padding rows.
        self.tables = tokenizer_tables(hf_tokenizer, model_vocab_size, stop_token_ids)
        self.info = self.tables.info
        self.vocab_size = model_vocab_size
        self.limits = limits or GrammarLimits()
        self.stats = CompileStats()
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)  # after a trial
        self._jobs: OrderedDict[tuple[str, str], _Job] = OrderedDict()  # running, queued and compiled (LRU)
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._in_process = 0  # trial-approved compiles running in this process (shutdown waits for them)
        self._ready_at: float | None = (
            None  # when the first worker was ready: deadlines never count its start-up
        )
        self._slots = [_WorkerSlot(self, i) for i in range(max(1, self.limits.workers))]
        for slot in self._slots:  # only now: a slot's thread reads the others'
            slot.start()

    # ---- any thread ----------------------------------------------------------------------
    def compile(self, kind: str, text: str) -> GrammarTicket:
        """A ticket (future) for the CompiledGrammar. The client's text is checked by `check_limits`
        before it is prepared (a prepared schema may be longer); deadline and memory bound the rest."""
        key = (kind, text)
        with self._cv:
            job = self._jobs.get(
                key
            )  # pending, compiled or known-bad: failures for other reasons are dropped
            if job is not None:
                self.stats.cache_hits += 1  # compiled, compiling or known-bad: shared
                self._jobs.move_to_end(key)
            else:
                if self._closed:
                    raise GrammarError("UNAVAILABLE", kind, "the server is shutting down")
                job = _Job(kind, text, Future(), time.monotonic(), len(text) > self.limits.large_bytes)
                self._jobs[key] = job
                self._queue.append(job)
                self._evict_locked()
                self._cv.notify_all()
            job.waiters += 1
            return GrammarTicket(self, job)

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """xgrammar's bitmask (int32 [rows, ceil(vocab / 32)], all ones: every token allowed), filled
        by numpy: torch.full runs a thread team, which a busy machine can stall for milliseconds."""
        return torch.from_numpy(np.full(xgr.get_bitmask_shape(rows, self.vocab_size), -1, dtype=np.int32))

    def accepts_nothing(self, compiled: xgr.CompiledGrammar) -> bool:
        """Whether no token (not even a stop token) may come first: the grammar matches no string."""
        mask = self.allocate_bitmask(1)
        mask.zero_()
        self.matcher(compiled).fill_next_token_bitmask(mask, 0)
        return not bool(mask.any())

    def shutdown(self) -> None:
        """Stop every compile now (workers killed); waiters get UNAVAILABLE. Only an in-process compile
        that a trial already showed to be short is waited for (native code must not outlive the interpreter)."""
        with self._cv:
            self._closed = True
            queued, self._queue = self._queue, []
            self._cv.notify_all()
        for job in queued:
            self._fail(job, GrammarError("UNAVAILABLE", job.kind, "the server is shutting down"))
        for slot in self._slots:
            slot.kill()
        with self._cv:
            self._cv.wait_for(lambda: self._in_process == 0, timeout=self.limits.compile_timeout_s)

    # ---- internals -----------------------------------------------------------------------
    def _evict_locked(self) -> None:
        while len(self._jobs) > MAX_CACHED_GRAMMARS:
            key = next((k for k, j in self._jobs.items() if j.result.done()), None)
            if key is None:
                return
            del self._jobs[key]

    def _release(self, job: _Job) -> None:
        """A waiter left. A queued job nobody waits for is dropped here; a running one by its slot."""
        with self._cv:
            job.waiters -= 1
            if job.waiters > 0 or job.result.done() or job not in self._queue:
                return
            self._queue.remove(job)
        self._fail(job, GrammarError("CANCELLED", job.kind, "nobody waits for this grammar any more"))

    def _fail(self, job: _Job, err: GrammarError) -> None:
        with self._cv:
            if err.code == "CANCELLED" and job.waiters > 0 and not self._closed:
                job.started = None  # a waiter came meanwhile: compile it again
                self._queue.insert(0, job)
                self._cv.notify_all()
                return
            if err.code != "INVALID_ARGUMENT" and self._jobs.get((job.kind, job.text)) is job:
                del self._jobs[(job.kind, job.text)]  # not the grammar's fault: a later request may retry
        if not job.result.done():
            job.result.set_exception(err)

    def _next_job(self, slot: "_WorkerSlot") -> _Job | None:
        """Blocks until a job may run on this slot; None once closed."""
        while True:
            self.expire_queued()
            with self._cv:
                if self._closed:
                    return None
                job = self._pick_locked()
                if job is not None:
                    self._queue.remove(job)
                    job.started = time.monotonic()
                    slot.job = job
                    return job
                self._cv.wait(0.1)

    def _pick_locked(self) -> _Job | None:
        small = next((j for j in self._queue if not j.large), None)
        if small is not None:
            return small
        now = time.monotonic()
        running_large = sum(
            1
            for s in self._slots
            if s.job is not None
            and (s.job.large or now - (s.job.started or now) > self.limits.small_compile_s)
        )
        if running_large < max(1, len(self._slots) - 1):
            return next(iter(self._queue), None)
        return None

    def _deadline(self, job: _Job) -> float:
        """`compile_timeout_s` after its first request, queueing included (not the first worker's start-up)."""
        if self._ready_at is None:
            return float("inf")
        return max(job.created, self._ready_at) + self.limits.compile_timeout_s

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until a compile worker runs (tests, benchmarks)."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self._ready_at is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self._ready_at is not None

    def expire_queued(self) -> None:
        """Fail the queued jobs whose deadline passed (they never got a worker in time)."""
        now = time.monotonic()
        with self._cv:
            expired = [j for j in self._queue if self._deadline(j) <= now]
            for job in expired:
                self._queue.remove(job)
        for job in expired:
            self._fail(job, self._timeout_error(job))

    def _timeout_error(self, job: _Job) -> GrammarError:
        """Heavy when the compile itself ran for at least half the timeout (else the wait for a worker
        took most of it: the load's fault, not the grammar's)."""
        ran = time.monotonic() - job.started if job.started is not None else 0.0
        return GrammarError(
            "DEADLINE_EXCEEDED",
            job.kind,
            f"grammar compilation took longer than {self.limits.compile_timeout_s:g}s",
            heavy=ran >= self.limits.compile_timeout_s / 2,
        )

    def _why_stop(self, job: _Job, pid: int | None) -> GrammarError | None:
        if self._closed:
            return GrammarError("UNAVAILABLE", job.kind, "the server is shutting down")
        if job.waiters <= 0:
            return GrammarError("CANCELLED", job.kind, "nobody waits for this grammar any more")
        if time.monotonic() > self._deadline(job):
            return self._timeout_error(job)
        rss = _rss_mb(pid) if pid is not None else 0.0
        job.peak_rss_mb = max(job.peak_rss_mb, rss)
        if rss > self.limits.max_worker_rss_mb:
            return GrammarError(
                "RESOURCE_EXHAUSTED",
                job.kind,
                f"compiling the grammar needs more than {self.limits.max_worker_rss_mb} MB",
                heavy=True,
            )
        return None

    def _complete(self, job: _Job, reply: tuple[str, str]) -> None:
        """Slot thread: turn a worker's reply into the job's result."""
        status, payload = reply
        if status != "ok":
            self._fail(job, GrammarError("INVALID_ARGUMENT", job.kind, clean_backend_message(payload)))
            return
        with self._cv:
            if self._closed:
                self._fail(job, GrammarError("UNAVAILABLE", job.kind, "the server is shutting down"))
                return
            self._in_process += 1
        try:
            compiled = compile_text(self.compiler, job.kind, job.text)  # the trial showed it is bounded
        finally:
            with self._cv:
                self._in_process -= 1
                self._cv.notify_all()
        if self.accepts_nothing(compiled):
            self._fail(
                job, GrammarError("INVALID_ARGUMENT", job.kind, "the grammar accepts no output at all")
            )
            return
        self.stats.compiles += 1
        self.stats.last_compile_s = time.monotonic() - (job.started or time.monotonic())
        if not job.result.done():
            job.result.set_result(compiled)


class _WorkerSlot:
    """One worker process and the thread that feeds it jobs, watches them and kills it when told."""

    def __init__(self, backend: GrammarBackend, index: int):
        self.backend = backend
        self.job: _Job | None = None
        self.proc: Any = None
        self.conn: Any = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"zerogap-grammar-{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        b = self.backend
        while True:
            try:
                self._ensure_worker()  # warm before the next job arrives
            except Exception:
                if not b._closed:
                    log.exception("cannot start a grammar worker")
            job = b._next_job(self)
            if job is None:
                break
            try:
                self._serve(job)
            except Exception as e:
                log.exception("grammar compile failed")
                self.kill()
                b._fail(job, GrammarError("INTERNAL", job.kind, f"grammar compile failed: {e!r}"))
            finally:
                with b._cv:
                    self.job = None
                    b._cv.notify_all()
        self.kill()

    def _ensure_worker(self) -> None:
        with self._lock:
            if self.proc is not None and self.proc.is_alive() or self.backend._closed:
                return
            ctx = _worker_context()
            conn, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(theirs,), name="zerogap-grammar-worker", daemon=True)
            proc.start()
            theirs.close()
            self.proc, self.conn = proc, conn
        conn.send(
            self.backend.tables.info_json
        )  # read once the worker imported xgrammar; kill() may close it meanwhile
        while not conn.poll(POLL_S):
            if not proc.is_alive() or self.backend._closed:
                raise RuntimeError(f"the grammar worker exited at start-up (exit code {proc.exitcode})")
        if conn.recv()[0] != "ready":
            raise RuntimeError("the grammar worker did not start")
        with self.backend._cv:
            if self.backend._ready_at is None:
                self.backend._ready_at = time.monotonic()

    def _serve(self, job: _Job) -> None:
        b = self.backend
        self._ensure_worker()
        proc, conn = self.proc, self.conn
        if proc is None:
            raise RuntimeError("no grammar worker")
        conn.send((job.kind, job.text))
        while True:
            try:
                reply = conn.recv() if conn.poll(POLL_S) else None
            except (EOFError, OSError, ValueError):  # the worker died, or kill() closed the pipe
                err = b._why_stop(job, None) or GrammarError(
                    "INVALID_ARGUMENT", job.kind, f"the grammar compiler crashed (exit code {proc.exitcode})"
                )
                self.kill()
                b._fail(job, err)
                return
            if reply is not None:
                job.trial_s = time.monotonic() - (job.started or time.monotonic())
                b._complete(job, reply)
                return
            b.expire_queued()
            err = b._why_stop(job, proc.pid)
            if err is not None:
                self.kill()
                b.stats.stopped[err.code] = b.stats.stopped.get(err.code, 0) + 1
                log.warning(
                    "grammar compile stopped after %.1fs: %s", time.monotonic() - (job.started or 0), err
                )
                b._fail(job, err)
                return

    def kill(self) -> None:
        with self._lock:
            proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        if conn is not None:
            conn.close()


def _worker_context():
    """Workers fork from a forkserver with xgrammar preloaded: a fresh worker is a cheap fork of a
    clean single-threaded process (never of the server, whose threads a fork would not survive).
    As with any forkserver, a server started from a script needs the `if __name__ == "__main__"` guard."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["features.grammar_backend"])
    return ctx
