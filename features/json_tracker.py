"""Decode-time enforcement beyond the grammar: `uniqueItems` for arrays of scalars.

A context-free grammar cannot say "no item twice". Here a per-request tracker follows the JSON
text generated so far (byte by byte, as the compact grammar writes it) with the schema nodes
that apply at each place (properties, items, $ref, anyOf/oneOf branches). Inside an array whose
every applicable schema says `uniqueItems: true`, it knows the scalar items written so far and,
before each step, names the tokens that would complete a duplicate: for a string item, the tokens
that begin with the rest of an earlier item up to its closing quote; for a number, `true`,
`false` or `null`, the rest of an earlier item followed by `,` or `]`. The scheduler clears
those tokens from the row's grammar mask (a row left with nothing keeps the grammar's mask: the
output check then reports the duplicate).

Items are compared as written (the grammar writes compact JSON): a duplicate spelled with other
escapes or another number form (`1` and `1.0`), or a token that ends one item and writes a whole
duplicate in one go, is not masked; the output check reports it.
"""

from __future__ import annotations

import bisect
import json
from typing import Any

from features import json_schema as js

_WS = b" \t\r\n"


class TokenIndex:
    """Token ids by their bytes, sorted, for prefix look-ups."""

    def __init__(self, decoded_vocab: list[bytes]):
        self.bytes = decoded_vocab
        pairs = sorted((b, i) for i, b in enumerate(decoded_vocab) if b)
        self._keys = [b for b, _ in pairs]
        self._ids = [i for _, i in pairs]
        self._exact: dict[bytes, list[int]] = {}
        for b, i in pairs:
            self._exact.setdefault(b, []).append(i)

    def exact(self, text: bytes) -> list[int]:
        return self._exact.get(text, [])

    def leading_to(self, partial: bytes, value: bytes, lead: bytes = b"") -> set[int]:
        """Tokens that, written after `partial` (plus `lead`, e.g. the comma before an item), stay on
        the way to `value` or complete it (followed by anything: the grammar decides what)."""
        if not value.startswith(partial):
            return set()
        rest = value[len(partial) :]
        out: set[int] = set()
        for k in range(1, len(rest)):
            out.update(self.exact(lead + rest[:k]))
        out.update(self.with_prefix(lead + rest))
        return out

    def with_prefix(self, prefix: bytes) -> list[int]:
        lo = bisect.bisect_left(self._keys, prefix)
        hi = bisect.bisect_left(self._keys, prefix + b"\xff" * 8) if prefix else len(self._keys)
        return self._ids[lo:hi]


def _child(root: js.Schema, cands: list, key: str | None, index: int) -> list:
    out: list = []
    for c in cands:
        if c is True or c is False or not isinstance(c, dict):
            out.append(c)
            continue
        if key is not None:
            s = js.property_schema(c, key)
        else:
            prefix = c.get("prefixItems") if isinstance(c.get("prefixItems"), list) else []
            s = prefix[index] if index < len(prefix) else c.get("items", True)
        js.schema_candidates(root, s, out)
    return out


def _admits_arrays(c: Any) -> bool:
    if c is False:
        return False
    if not isinstance(c, dict):
        return True
    types = js._types(c)
    return types is None or "array" in types


def _unique(cands: list) -> bool:
    arrays = [c for c in cands if _admits_arrays(c)]
    return bool(arrays) and all(isinstance(c, dict) and c.get("uniqueItems") is True for c in arrays)


MAX_DOMAIN = 256
MAX_LEFT = 16  # values left of a domain below which tokens leading only to written values are masked too


def _domain(cands: list) -> list[bytes] | None:
    """Every item text an array's items admit (compact JSON), when few: enum/const values,
    booleans, null, small integer ranges; None when open (any string, any number...)."""
    values: dict[bytes, None] = {}
    for c in cands:
        if not isinstance(c, dict):
            return None
        if isinstance(c.get("enum"), list) or "const" in c:
            vs = c["enum"] if isinstance(c.get("enum"), list) else [c["const"]]
        else:
            types = js._types(c) or []
            vs = []
            for t in types:
                if t == "boolean":
                    vs += [True, False]
                elif t == "null":
                    vs.append(None)
                elif (
                    t == "integer"
                    and isinstance(c.get("minimum"), int)
                    and isinstance(c.get("maximum"), int)
                    and 0 <= c["maximum"] - c["minimum"] < MAX_DOMAIN
                    and "multipleOf" not in c
                ):
                    vs += list(range(c["minimum"], c["maximum"] + 1))
                else:
                    return None
        for v in vs:
            if isinstance(v, (dict, list)):
                return None
            values[json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode()] = None
        if len(values) > MAX_DOMAIN:
            return None
    return list(values)


def has_unique_items(schema: js.Schema) -> bool:
    return any(isinstance(n, dict) and n.get("uniqueItems") is True for _, n in js.walk(schema))


class _Frame:
    __slots__ = ("array", "cands", "domain", "index", "key", "seen", "unique")

    def __init__(self, array: bool, cands: list, unique: bool):
        self.array, self.cands, self.unique = array, cands, unique
        self.domain: list[bytes] | None = None  # the items' few possible texts (unique arrays)
        self.seen: list[bytes] = []  # the scalar items written so far (unique arrays only)
        self.index = 0
        self.key: bytes | None = None


class UniqueTracker:
    """Follows one request's output; `forbidden()` lists the tokens that would complete a duplicate."""

    def __init__(self, root: js.Schema, index: TokenIndex):
        self.root, self.tokens = root, index
        self.reset()

    def reset(self) -> None:
        cands: list = []
        js.schema_candidates(self.root, self.root, cands)
        self.stack: list[_Frame] = []
        self.pending = cands  # schema nodes of the value about to start
        self.mode = "value"  # value | string | escape | bare | after | key | colon
        self.is_key = False
        self.buf = bytearray()  # the key or scalar item being written
        self.recording = False  # the current scalar is an item of a unique array

    # ---- feeding -------------------------------------------------------------------------
    def feed_token(self, token: int) -> None:
        if 0 <= token < len(self.tokens.bytes):
            self.feed(self.tokens.bytes[token])

    def feed(self, data: bytes) -> None:
        for c in data:
            self._byte(c)

    def _start_value(self, c: int) -> None:
        top = self.stack[-1] if self.stack else None
        if c in b"{[":
            cands = self.pending
            frame = _Frame(c == ord("["), cands, c == ord("[") and _unique(cands))
            self.stack.append(frame)
            if c == ord("["):
                self.mode = "value"
                self.pending = _child(self.root, cands, None, 0)
                if frame.unique:
                    frame.domain = _domain(self.pending)
            else:
                self.mode = "key"
            return
        self.recording = top is not None and top.array and top.unique
        self.buf = bytearray([c])
        self.mode = "string" if c == ord('"') else "bare"
        self.is_key = False

    def _end_scalar(self) -> None:
        top = self.stack[-1] if self.stack else None
        if self.recording and top is not None:
            top.seen.append(bytes(self.buf))
        self.recording = False
        self.mode = "after"

    def _byte(self, c: int) -> None:
        mode = self.mode
        if mode == "string":
            self.buf.append(c)
            if c == ord("\\"):
                self.mode = "escape"
            elif c == ord('"'):
                if self.is_key:
                    top = self.stack[-1]
                    try:
                        top.key = json.loads(bytes(self.buf).decode("utf-8", "replace")).encode()
                    except ValueError:
                        top.key = bytes(self.buf[1:-1])
                    self.mode = "colon"
                else:
                    self._end_scalar()
            return
        if mode == "escape":
            self.buf.append(c)
            self.mode = "string"
            return
        if mode == "bare":
            if c in b",]}" or c in _WS:
                self._end_scalar()
                self._byte(c)
            else:
                self.buf.append(c)
            return
        if c in _WS:
            return
        if mode == "value":
            if c == ord("]") and self.stack and self.stack[-1].array:
                self._close()
            else:
                self._start_value(c)
        elif mode == "key":
            if c == ord('"'):
                self.buf = bytearray([c])
                self.mode, self.is_key = "string", True
            elif c == ord("}"):
                self._close()
        elif mode == "colon":
            if c == ord(":"):
                top = self.stack[-1]
                self.pending = _child(self.root, top.cands, (top.key or b"").decode("utf-8", "replace"), 0)
                self.mode = "value"
        elif mode == "after":
            top = self.stack[-1] if self.stack else None
            if top is None:
                return
            if c == ord(","):
                if top.array:
                    top.index += 1
                    self.pending = _child(self.root, top.cands, None, top.index)
                    self.mode = "value"
                else:
                    self.mode = "key"
            elif c in b"]}":
                self._close()

    def _close(self) -> None:
        self.stack.pop()
        self.mode = "after"

    # ---- masking -------------------------------------------------------------------------
    def forbidden(self) -> list[int]:
        """Tokens that would complete (or, for items of few possible values, only lead to) an item
        equal to an earlier one of a unique array."""
        top = self.stack[-1] if self.stack else None
        if top is None or not top.array or not top.unique or not top.seen:
            return []
        if self.mode == "value":  # an item starts here
            partial, lead = b"", b""
        elif self.mode in ("string", "bare") and self.recording:
            partial, lead = bytes(self.buf), b""
        elif self.mode == "after":  # `,` then (part of) a duplicate in one token
            partial, lead = b"", b","
        else:
            return []
        seen = set(top.seen)
        left = [v for v in top.domain if v not in seen] if top.domain is not None else None
        if left is not None and len(left) <= MAX_LEFT:  # few values: forbid what leads only to written ones
            bad: set[int] = set()
            for item in seen:
                for text in _terminated(item):
                    bad |= self.tokens.leading_to(partial, text, lead)
            for v in left:
                for text in _terminated(v):
                    bad -= self.tokens.leading_to(partial, text, lead)
            if self.mode == "after" and not left:
                bad.update(self.tokens.with_prefix(b","))  # no further item could be unique
            elif len(left) == 1 and left[0].startswith(partial):  # the last value, then no `,` for another
                bad.update(self.tokens.with_prefix(lead + left[0][len(partial) :] + b","))
            return list(bad)
        out: list[int] = []
        for item in top.seen:
            if not item.startswith(partial):
                continue
            rest = lead + item[len(partial) :]
            if item[:1] in (b'"', b"t", b"f", b"n"):  # a string or literal is complete at its last byte
                if rest:
                    out.extend(self.tokens.with_prefix(rest))
            else:
                for end in (b",", b"]"):
                    out.extend(self.tokens.with_prefix(rest + end))
        return out


def _terminated(item: bytes) -> tuple[bytes, ...]:
    """An item's text up to where it is complete: a string at its closing quote, anything else at
    the `,` or `]` after it."""
    return (item,) if item[:1] == b'"' else (item + b",", item + b"]")
