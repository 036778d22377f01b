"""Streamed text: an incremental detokenizer and a stop-string matcher.

The detokenizer emits text only once it is stable (never a broken UTF-8 sequence, shown by
tokenizers as U+FFFD), and the stop matcher holds back any tail that could still become a stop
string, so a stream never shows text that is later trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (service/tokenizer.py's `Tokenizer`)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a character."""

    # Decoding a few tokens before the first new one keeps tokenizers' spacing
    # rules (e.g. SentencePiece's leading space) as they are in the full text.
    CONTEXT = 5

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], skip_special_tokens: bool):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly stable text."""
        self.ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever text remains, even if incomplete."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if len(self.ids) == self.read_offset:
            return ""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


@dataclass
class StopMatch:
    text: str  # text safe to emit now
    matched: str | None  # the stop string found, if any (text ends just before it)


class StopStringMatcher:
    """Finds stop strings in streamed text, also across token boundaries."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def feed(self, delta: str, active: bool = True) -> StopMatch:
        self.buf += delta
        if not self.stops:
            out, self.buf = self.buf, ""
            return StopMatch(out, None)
        if active:
            best: tuple[int, str] | None = None
            for s in self.stops:
                i = self.buf.find(s)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                out, self.buf = self.buf[: best[0]], ""
                return StopMatch(out, best[1])
        hold = self._partial_tail()
        cut = len(self.buf) - hold
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return StopMatch(out, None)

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out

    def _partial_tail(self) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), best, -1):
                if self.buf.endswith(s[:n]):
                    best = n
                    break
        return best
