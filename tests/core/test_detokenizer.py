"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest

from service.core.text import IncrementalDetokenizer, StopStringMatcher
from service.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smol_dir):
    return Tokenizer(smol_dir)


@pytest.mark.parametrize(
    "text", ["Hello, world!", "naïve café — 日本語のテキスト 🎉🚀 ok", "tabs\tand\nnewlines  ", "😀" * 5]
)
def test_streamed_text_equals_full_decode_and_never_breaks_utf8(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=True)
    parts = [d.add([t]) for t in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi", add_special_tokens=False) + [2]
    for skip, want in ((True, "Hi"), (False, "Hi<|im_end|>")):
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(d.add([t]) for t in ids) + d.flush() == want


def test_stop_string_across_token_boundaries():
    m = StopStringMatcher(["STOP", "xyz"])
    out = []
    for piece in ["Hello S", "T", "O", "P there"]:
        r = m.feed(piece)
        out.append(r.text)
        if r.matched:
            break
    assert "".join(out) == "Hello " and r.matched == "STOP"


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopStringMatcher(["abc"])
    assert m.feed("xxa").text == "xx"
    assert m.feed("bd").text == "abd"
    assert m.feed("ab").text == ""
    assert m.flush() == "ab"


def test_earliest_stop_wins_and_inactive_does_not_match():
    m = StopStringMatcher(["b", "a"])
    r = m.feed("xxab")
    assert r.matched == "a" and r.text == "xx"
    m2 = StopStringMatcher(["a"])
    assert m2.feed("xa", active=False).matched is None
