"""The grammar engine behind constrained decoding: xgrammar, compiled off-thread.

Compilation runs on a small thread pool, never on the scheduling thread; one
future per (kind, text) is shared by every request that asks for the same
grammar, so a grammar compiles once however many requests wait for it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
MAX_CACHED_GRAMMARS = 1024


@dataclass
class CompileStats:
    compiles: int = 0
    cache_hits: int = 0
    last_compile_s: float = 0.0


class GrammarBackend:
    """Compiles grammars for one tokenizer/vocabulary and builds matchers."""

    def __init__(self, hf_tokenizer, model_vocab_size: int, stop_token_ids: list[int], threads: int = 2):
        # The model's vocabulary may be larger than the tokenizer's: xgrammar masks the padding rows.
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=model_vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = model_vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerogap-grammar")
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()  # LRU of compiled grammars
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def compile(self, kind: str, text: str) -> Future:
        """A future of the CompiledGrammar; shared by identical (kind, text)."""
        key = (kind, text)
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self.stats.cache_hits += 1
                self._futures.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, kind, text)
            self._futures[key] = fut
            while len(self._futures) > MAX_CACHED_GRAMMARS:
                self._futures.popitem(last=False)
            return fut

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        if kind == "json_schema":
            out = self.compiler.compile_json_schema(text, any_whitespace=False)
        elif kind == "json_object":
            out = self.compiler.compile_builtin_json_grammar()
        elif kind == "regex":
            out = self.compiler.compile_regex(text)
        elif kind == "ebnf":
            out = self.compiler.compile_grammar(text)
        elif kind == "structural_tag":
            out = self.compiler.compile_structural_tag(text)
        else:
            raise ValueError(f"unknown constraint kind {kind!r}")
        self.stats.compiles += 1
        self.stats.last_compile_s = time.perf_counter() - start
        return out

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def allocate_bitmask(self, rows: int):
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
