"""uniqueItems at decode time (features/json_tracker.py), without a model: the grammar's own
matcher walks random allowed tokens of SmolLM2's vocabulary; the tracker's mask keeps every
unique array free of duplicates where the grammar alone writes them."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import xgrammar as xgr

from features import json_schema as js
from features import json_tracker as jt
from features.constrained import ConstraintSpec, forbid_tokens, prepare

UNIQUE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["tags", "n", "f", "s", "c"],
    "properties": {
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "c", "ab"]},
            "uniqueItems": True,
            "maxItems": 4,
        },
        "n": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 3},
            "uniqueItems": True,
            "maxItems": 4,
        },
        "f": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
        "s": {
            "type": "array",
            "items": {"type": "string", "maxLength": 2},
            "uniqueItems": True,
            "maxItems": 6,
        },
        "c": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 2,
            "uniqueItems": True,
        },
    },
}


@pytest.fixture(scope="module")
def vocab(hf_tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=len(hf_tokenizer), stop_token_ids=[hf_tokenizer.eos_token_id]
    )
    return info, xgr.GrammarCompiler(info, max_threads=1), jt.TokenIndex(list(info.decoded_vocab))


def _walk(grammar, info, index, root, seed: int, track: bool, steps: int = 80) -> str:
    matcher = xgr.GrammarMatcher(grammar)
    tracker = jt.UniqueTracker(root, index)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    rng = random.Random(seed)
    out = bytearray()
    stops = set(info.stop_token_ids)  # both properties rebuild their list at each access: read once
    for _ in range(steps):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(mask, 0)
        row = mask.numpy()[0]
        if track:
            forbid_tokens(row, tracker.forbidden())
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: info.vocab_size])
        token = int(allowed[rng.randrange(len(allowed))])
        assert matcher.accept_token(token)
        tracker.feed_token(token)
        if token not in stops:
            out += index.bytes[token]
    return out.decode("utf-8", "replace")


def test_unique_items_of_scalars_are_enforced_at_decode_time(vocab):
    info, compiler, index = vocab
    prepared = prepare(ConstraintSpec("json_schema", json.dumps(UNIQUE)), "strict")  # accepted: enforced
    assert not prepared.relaxed and prepared.unique_root is not None
    grammar = compiler.compile_json_schema(prepared.backend_text, any_whitespace=False, separators=(",", ":"))
    validator = js.OutputValidator(UNIQUE)
    dup = {False: 0, True: 0}
    for seed in range(40):  # the grammar alone wrote duplicates in 27 of 40 walks
        for track in (False, True):
            text = _walk(grammar, info, index, prepared.unique_root, seed, track)
            try:
                value = json.loads(text)
            except ValueError:
                continue  # cut by the step budget
            dup[track] += any(
                len({json.dumps(v) for v in value[k]}) != len(value[k]) for k in UNIQUE["required"]
            )
            if track:
                assert validator.violations(text) == [], text
    assert dup[False] > 0 and dup[True] == 0, dup  # the grammar alone writes duplicates; the engine cannot


def test_tracker_follows_paths_refs_and_branches(vocab):
    _, _, index = vocab
    root = {
        "$defs": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/tags"},
            "b": {"anyOf": [{"$ref": "#/$defs/tags"}, {"type": "array"}]},  # duplicates valid by branch 2
            "c": {
                "type": "array",
                "items": {"type": "object", "properties": {"t": {"$ref": "#/$defs/tags"}}},
            },
        },
    }
    t = jt.UniqueTracker(root, index)
    t.feed(b'{"a":["x","y",')
    assert all(index.bytes[i].startswith((b'"x"', b'"y"')) for i in t.forbidden())
    t.feed(b'"x')  # every token that closes the string here writes a duplicate
    assert t.forbidden() and {index.bytes[i][:1] for i in t.forbidden()} == {b'"'}
    t.feed(b'z"],"b":["x","x')
    assert t.forbidden() == []  # not every branch says uniqueItems
    t.feed(b'"],"c":[{"t":["q","q')
    assert t.forbidden() and {index.bytes[i][:1] for i in t.forbidden()} == {b'"'}
    t.feed(b'r"]},{"t":["q')
    assert t.forbidden() == []  # a new array: nothing written in it yet


@pytest.mark.parametrize(
    "schema, enforced",
    [
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, True),
        ({"type": "array", "items": {"enum": [1, "a", None]}, "uniqueItems": True}, True),
        (
            {
                "type": "array",
                "prefixItems": [{"type": "integer"}],
                "items": {"type": "boolean"},
                "uniqueItems": True,
            },
            True,
        ),
        ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, False),
        ({"type": "array", "uniqueItems": True}, False),  # any item: objects and arrays too
        ({"type": "array", "items": {"enum": [[1], 2]}, "uniqueItems": True}, False),
    ],
)
def test_walk_names_only_the_unique_items_left_unenforced(schema, enforced):
    normalised, _, problems = js.normalise(schema)
    flagged = "uniqueItems" in {i.keyword for i in js.unenforced(normalised, problems)}
    assert flagged == (not enforced)
