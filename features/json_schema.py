"""JSON Schema fidelity for constrained decoding: normalise, know the backend's limits, validate.

xgrammar 0.2.9 compiles a JSON schema into a grammar, but silently ignores some
keywords and forms (a second `allOf` branch, keywords beside `anyOf`/`oneOf`/`$ref`,
`not`, `if`, `uniqueItems`, anchors, ...) and rejects others with raw C++ messages.
This module makes what the grammar enforces explicit:

- `normalise` rewrites a schema into an equivalent one the backend enforces better.
  Every rewrite is exact (the same instances validate) or not done: `allOf` merged
  into one schema, sibling keywords distributed into `anyOf`/`oneOf` branches,
  `$ref` with siblings (2019-09+), anchor / `$id` / absolute refs retargeted to JSON
  pointers, draft-7 `items` arrays to `prefixItems`, integer bounds to whole numbers,
  `enum` filtered by `type`, `required` names missing from `properties` added,
  `format: date` / `date-time` as calendar-exact patterns (the backend admits 02-31), ...
- `unenforced` walks the normalised schema for what the grammar still cannot
  enforce, each issue naming the JSON pointer and the keyword.
- `relax` drops what the backend would reject (lenient mode).
- `OutputValidator` checks a finished output against the original schema with
  jsonschema (its declared draft, formats checked).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

import jsonschema
import xgrammar as xgr

Schema = Any  # a dict or a bool

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_COPIED_NODES = 200_000  # inlining/merging budget per schema: beyond it a rewrite is not done
MAX_INLINE_DEPTH = 16  # $refs inlined inside one another
MAX_SYNTH_DEFS = 256  # definitions synthesized for keywords merged into a recursive $ref
SYNTH_PREFIX = "zerogap-merged-"

# Keywords that decide which instances validate; every other key is an annotation (title,
# description, default, vendor extensions, ...) or a container of definitions (_HELD).
VALIDATION_KW = frozenset(
    {
        "type",
        "enum",
        "const",
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "pattern",
        "format",
        "maxItems",
        "minItems",
        "uniqueItems",
        "maxContains",
        "minContains",
        "maxProperties",
        "minProperties",
        "required",
        "dependentRequired",
        "dependencies",
        "dependentSchemas",
        "properties",
        "patternProperties",
        "additionalProperties",
        "propertyNames",
        "items",
        "prefixItems",
        "additionalItems",
        "contains",
        "unevaluatedItems",
        "unevaluatedProperties",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
    }
)
_HELD = ("$defs", "definitions", "$id", "$anchor")
# Subschema positions: a map of schemas / one schema / a list of schemas.
MAP_KW = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
ONE_KW = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
LIST_KW = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# Formats the grammar enforces (probed on xgrammar 0.2.9, pinned by tests/test_json_schema.py).
GRAMMAR_FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uuid",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Calendar-exact patterns for the formats whose backend grammar admits impossible days (xgrammar
# 0.2.9's `date` takes 2021-02-31, 2021-04-31 and year 0000): what `datetime.date.fromisoformat`
# accepts after jsonschema's 4-2-2 digit check — years 0001-9999, each month's days, Feb 29 in leap
# years (multiples of 4 but not of 100, or of 400).
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_2 = r"(?:0[48]|[2468][048]|[13579][26])"  # two digits, a multiple of 4 other than 00
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
DATE_RE = rf"(?:{_YEAR}-{_MONTH_DAY}|(?:[0-9]{{2}}{_LEAP_2}|{_LEAP_2}00)-02-29)"
# RFC 3339 date-time with that date, exactly as rfc3339-validator (jsonschema's date-time checker)
# reads it: upper-case T/Z, seconds 00-59 (no leap second), offsets up to 23:59.
_HOUR = r"(?:[01][0-9]|2[0-3])"
DATE_TIME_RE = rf"{DATE_RE}T{_HOUR}:[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-]{_HOUR}:[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{DATE_RE}$", "date-time": f"^{DATE_TIME_RE}$"}
NUMERIC_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRING_KW = ("minLength", "maxLength", "pattern", "format")
ARRAY_KW = ("minItems", "maxItems", "items", "prefixItems", "uniqueItems", "contains")
OBJECT_KW = (
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "propertyNames",
)
TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
_BACKEND_MSG = re.compile(r"^\s*\[[0-9:]+\]\s+\S+\.(?:cc|h|cpp):\d+:\s*(?:Check failed:.*? is false:\s*)?")


@dataclass(frozen=True)
class SchemaIssue:
    """A place in a schema (or an output) and what about it: pointer, keyword, message."""

    pointer: str
    keyword: str
    message: str

    def __str__(self) -> str:
        return f"{self.pointer or '/'}: {self.keyword}: {self.message}"


class SchemaError(ValueError):
    """A schema that is not valid JSON Schema (or not JSON at all)."""

    def __init__(self, issue: SchemaIssue):
        super().__init__(str(issue))
        self.issue = issue


def clean_backend_message(msg: str) -> str:
    """xgrammar's message without its timestamp, C++ source path and check expression."""
    lines = [_BACKEND_MSG.sub("", line).strip() for line in str(msg).strip().splitlines()]
    return "; ".join(line for line in lines if line) or "rejected by the grammar backend"


def ptr(base: str, *parts: Any) -> str:
    """A JSON pointer (RFC 6901) extended by `parts`."""
    for p in parts:
        base += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return base


def load(text: str) -> Schema:
    """The schema from JSON text; SchemaError names where it breaks its metaschema."""
    try:
        schema = json.loads(text.removeprefix("\ufeff"))  # a byte order mark: RFC 8259 lets a parser skip it
    except ValueError as e:
        raise SchemaError(SchemaIssue("", "json", f"not valid JSON: {e}")) from None
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(SchemaIssue("", "type", "a schema must be a JSON object or a boolean"))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    except Exception as e:  # noqa: BLE001
        raise SchemaError(SchemaIssue("", "schema", f"{type(e).__name__}: {e}"[:300])) from None
    if error is not None:
        raise SchemaError(SchemaIssue(ptr("", *error.path), str(error.validator), error.message[:300]))
    return schema


def draft_of(schema: Schema) -> int:
    """4, 6, 7, 2019 or 2020 (the default) from $schema."""
    s = schema.get("$schema", "") if isinstance(schema, dict) else ""
    for tag, draft in (("draft-04", 4), ("draft-06", 6), ("draft-07", 7), ("draft-03", 4), ("2019-09", 2019)):
        if tag in s:
            return draft
    return 2020


def children(node: Schema, at: str) -> Iterator[tuple[str, Schema]]:
    """(pointer, subschema) for each direct subschema of `node`."""
    if not isinstance(node, dict):
        return
    for kw in MAP_KW:
        v = node.get(kw)
        if isinstance(v, dict):
            for k, s in v.items():
                yield ptr(at, kw, k), s
    for kw in ONE_KW:
        v = node.get(kw)
        if isinstance(v, (dict, bool)):
            yield ptr(at, kw), v
    for kw in LIST_KW:
        v = node.get(kw)
        if isinstance(v, list):
            for i, s in enumerate(v):
                yield ptr(at, kw, i), s
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for k, s in deps.items():
            if isinstance(s, (dict, bool)):
                yield ptr(at, "dependencies", k), s


def walk(node: Schema, at: str = "") -> Iterator[tuple[str, Schema]]:
    yield at, node
    for p, s in children(node, at):
        yield from walk(s, p)


def walk_all(schema: Schema) -> Iterator[tuple[str, Schema]]:
    """`walk`, then the subschemas that only a local $ref reaches (a target outside any schema
    keyword, e.g. `#/definitions/3/vars` under a plain object), each once."""
    seen: set[str] = set()
    pending = [""]
    while pending:
        start = pending.pop()
        node = resolve_pointer(schema, start)
        if node is None:
            continue
        for at, n in walk(node, start):
            if at in seen:
                continue
            seen.add(at)
            yield at, n
            ref = n.get("$ref") if isinstance(n, dict) else None
            if isinstance(ref, str) and ref.startswith("#") and ref[1:] not in seen:
                pending.append(ref[1:])


def _id_keyword(root: Schema) -> str:
    """The identifier keyword of the schema's draft: `id` up to draft-04, `$id` after."""
    dialect = root.get("$schema", "") if isinstance(root, dict) else ""
    return "id" if isinstance(dialect, str) and re.search(r"draft-0[34]/", dialect) else "$id"


def join_uri(base: str, ref: str) -> str:
    """ref resolved against base; a fragment-only ref keeps any base (urljoin leaves a base of a
    scheme it does not know, e.g. "ng-cli://config/schema.json", out of it)."""
    if ref.startswith("#"):
        return urldefrag(base).url + ref
    return urljoin(base, ref)


def resolve_pointer(root: Schema, pointer: str) -> Schema | None:
    node = root
    for raw in pointer.split("/")[1:] if pointer else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _json_key(v: Any) -> str:
    """Equality as JSON Schema sees it (1 == 1.0, True != 1)."""

    def canon(x: Any) -> Any:
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, (int, float)):
            return float(x) if not (isinstance(x, float) and not x.is_integer()) else x
        if isinstance(x, list):
            return [canon(i) for i in x]
        if isinstance(x, dict):
            return {k: canon(i) for k, i in x.items()}
        return x

    return json.dumps(canon(v), sort_keys=True)


def _type_matches(value: Any, t: str) -> bool:
    if t == "null":
        return value is None
    if t == "boolean":
        return isinstance(value, bool)
    if t == "integer":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "array": list, "object": dict}[t])


def _types(node: dict) -> list[str] | None:
    t = node.get("type")
    if t is None:
        return None
    return [t] if isinstance(t, str) else list(t)


# ---------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------
class _Normaliser:
    def __init__(self, root: Schema):
        self.root = root
        self.draft = draft_of(root)
        self.rewrites: list[SchemaIssue] = []
        self.problems: list[SchemaIssue] = []  # found while normalising (e.g. a remote $ref)
        self.budget = MAX_COPIED_NODES
        self.ref_targets: set[str] = set()
        self._inlining: set[str] = set()  # $ref targets being inlined now (a cycle keeps its $ref)
        self._inlined: dict[str, Schema] = {}  # target pointer -> its normalised copy
        self._synth: dict[
            tuple[str, str], str
        ] = {}  # (keywords, $ref target) -> name of their merged definition
        self.defs: dict[str, Schema] = {}  # synthesized definitions, added to the root's $defs

    def note(self, at: str, keyword: str, message: str) -> None:
        self.rewrites.append(SchemaIssue(at, keyword, message))

    # ---- pass 1: every resolvable $ref becomes a root JSON pointer ----------------------
    def retarget_refs(self, root: Schema) -> Schema:
        root = copy.deepcopy(root)
        id_kw = _id_keyword(root)
        base0 = urldefrag(root.get(id_kw, "")).url if isinstance(root, dict) else ""
        if not isinstance(base0, str):
            base0 = ""
        index: dict[str, str] = {base0: ""}  # absolute URI (resource or anchor) -> pointer
        bases: dict[str, str] = {}  # pointer -> the base URI its refs resolve against
        resources: dict[str, str] = {}  # pointer -> the pointer of the resource it lies in

        def scan(node: Schema, at: str, base: str, resource: str) -> None:
            if isinstance(node, dict):
                if isinstance(node.get(id_kw), str) and at:
                    uri = join_uri(base, node[id_kw])
                    u, frag = urldefrag(uri)
                    if frag and not frag.startswith("/"):  # draft-7 "$id": "#anchor"
                        index[uri] = at
                    elif u != base:  # a new resource: refs inside resolve against it
                        index.setdefault(u, at)  # a duplicate $id: refs inside still find their own
                        base, resource = u, at
                if isinstance(node.get("$anchor"), str):
                    index[f"{base}#{node['$anchor']}"] = at
            bases[at], resources[at] = base, resource
            for p, s in children(node, at):
                scan(s, p, base, resource)

        scan(root, "", base0, "")
        for at, node in list(walk(root)):
            if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
                continue
            ref = node["$ref"]
            base = bases.get(at, base0)
            target = join_uri(base, ref)
            u, frag = urldefrag(target)
            pointer_frag = not frag or frag.startswith("/")
            if u == base and pointer_frag:  # within the ref's own resource (the enclosing one)
                new = "#" + resources.get(at, "") + frag
            elif target in index:
                new = "#" + index[target]
            elif u in index and pointer_frag:
                new = "#" + index[u] + frag
            elif u and u not in index:
                self.problems.append(
                    SchemaIssue(
                        ptr(at, "$ref"),
                        "$ref",
                        f"external reference {ref!r} (another document: "
                        "never fetched; inline it under $defs)",
                    )
                )
                continue
            else:
                self.problems.append(
                    SchemaIssue(ptr(at, "$ref"), "$ref", f"cannot resolve {ref!r} within the schema")
                )
                continue
            if "%" in new and resolve_pointer(root, unquote(new[1:])) is not None:
                new = "#" + unquote(new[1:])  # the backend reads pointers as written (no percent-decoding)
            if (
                resolve_pointer(root, new[1:]) is None
                and ref.startswith("#/")
                and resolve_pointer(root, unquote(ref[1:])) is not None
            ):
                # Not in its resource, but in the document: generators that put "$id"s on every
                # subschema mean the document's root (what a validator would refuse to resolve).
                new = "#" + unquote(ref[1:])
                self.note(ptr(at, "$ref"), "$ref", f"{ref!r} resolved against the document's root")
            if resolve_pointer(root, new[1:]) is None:
                self.problems.append(SchemaIssue(ptr(at, "$ref"), "$ref", f"{ref!r} points at nothing"))
                continue
            if new != ref:
                node["$ref"] = new
                self.note(ptr(at, "$ref"), "$ref", f"{ref!r} retargeted to {new!r}")
            self.ref_targets.add(new[1:])
        return root

    # ---- pass 2: bottom-up rewrites -----------------------------------------------------
    def norm(self, node: Schema, at: str) -> Schema:
        if not isinstance(node, dict):
            return node
        node = dict(node)
        for kw in MAP_KW:
            if isinstance(node.get(kw), dict):
                node[kw] = {k: self.norm(s, ptr(at, kw, k)) for k, s in node[kw].items()}
        for kw in ONE_KW:
            if isinstance(node.get(kw), dict):
                node[kw] = self.norm(node[kw], ptr(at, kw))
        for kw in LIST_KW:
            if isinstance(node.get(kw), list):
                node[kw] = [self.norm(s, ptr(at, kw, i)) for i, s in enumerate(node[kw])]
        return self.local(node, at)

    def local(self, node: dict, at: str) -> Schema:
        """Rewrites of one schema object whose subschemas are already normalised."""
        if self.draft <= 4:
            node = self._draft4_exclusive(node, at)
        if self.draft <= 2019 and isinstance(node.get("items"), list):
            node = self._items_array(node, at)
        if "$ref" in node:
            node = self._ref_siblings(node, at) if self.draft >= 2019 else self._drop_ref_siblings(node, at)
            if self.draft < 2019:
                return node
        if "not" in node:
            node = self._not(node, at)
            if not isinstance(node, dict):
                return node
        if "if" in node:
            node = self._if_then_else(node, at)
        if isinstance(node.get("allOf"), list):
            node = self._merge_all_of(node, at)
            if not isinstance(node, dict):
                return node
        for kw in ("anyOf", "oneOf"):
            if isinstance(node.get(kw), list):
                node = self._distribute(node, kw, at)
        node = self._integer_bounds(node, at)
        node = self._enum_by_type(node, at)
        node = self._required_properties(node, at)
        node = self._false_properties(node, at)
        node = self._backend_defaults(node, at)
        node = self._pattern_controls(node, at)
        node = self._format_patterns(node, at)
        return node

    def _draft4_exclusive(self, node: dict, at: str) -> dict:
        for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(ex), bool):
                node = dict(node)
                if node.pop(ex) and bound in node:
                    node[ex] = node.pop(bound)
                self.note(ptr(at, ex), ex, "draft-4 boolean form to a number")
        return node

    def _items_array(self, node: dict, at: str) -> dict:
        node = dict(node)
        node["prefixItems"] = node.pop("items")
        extra = node.pop("additionalItems", True)
        if extra is not True and extra != {}:
            node["items"] = extra
        self.note(ptr(at, "items"), "items", "array form to prefixItems (+ additionalItems to items)")
        return node

    def _ref_siblings(self, node: dict, at: str) -> dict:
        rest = {k: v for k, v in node.items() if k in VALIDATION_KW and k != "$ref"}
        if not rest:
            return node
        keep = {k: v for k, v in node.items() if k not in rest and k != "$ref"}
        self.note(ptr(at, "$ref"), "$ref", "sibling keywords of $ref moved into allOf")
        return {**keep, "allOf": [{"$ref": node["$ref"]}, rest] + list(node.get("allOf", []))}

    def _drop_ref_siblings(self, node: dict, at: str) -> dict:
        """Up to draft 7, keywords beside $ref are ignored; the backend would apply some of them."""
        rest = [k for k in node if k in VALIDATION_KW and k != "$ref"]
        if not rest or self._moves_children(at):
            return node
        self.note(
            ptr(at, "$ref"),
            "$ref",
            f"keywords beside $ref dropped (ignored up to draft 7): {', '.join(rest)}",
        )
        return {k: v for k, v in node.items() if k not in rest}

    def _inline_ref(self, branch: Schema, stack: tuple[str, ...]) -> Schema:
        """A branch that is only a local $ref (plus annotations), replaced by its normalised target.

        Cycle-aware: a target being inlined further up (a recursive schema: trees, threads) keeps
        its $ref, which is exact; each target is normalised once (memoised by pointer)."""
        while (
            isinstance(branch, dict)
            and isinstance(branch.get("$ref"), str)
            and branch["$ref"].startswith("#")
        ):
            if any(k in VALIDATION_KW and k != "$ref" for k in branch):
                return branch
            target_ptr = branch["$ref"][1:]
            target = resolve_pointer(self.root, target_ptr)
            if (
                target is None
                or target_ptr in stack
                or target_ptr in self._inlining
                or len(stack) + len(self._inlining) > MAX_INLINE_DEPTH
            ):
                return branch
            size = sum(1 for _ in walk(target))
            if size > self.budget:
                return branch
            self.budget -= size
            if target_ptr not in self._inlined:
                self._inlining.add(target_ptr)
                try:
                    self._inlined[target_ptr] = self.norm(copy.deepcopy(target), target_ptr)
                finally:
                    self._inlining.discard(target_ptr)
            branch = self._inlined[target_ptr]
            stack = stack + (target_ptr,)
        return branch

    def _merge_into(self, kws: Schema, branch: Schema) -> Schema | None:
        """merge(kws, branch); a recursive local $ref that could not be inlined gets a synthesized
        definition `kws & target` (normalised once: the same pair further down refers to it), so
        rewrites through a cycle stay exact and terminate."""
        m = merge(kws, branch)
        if m is not None or not (
            isinstance(branch, dict)
            and isinstance(branch.get("$ref"), str)
            and branch["$ref"].startswith("#")
            and not any(k in VALIDATION_KW and k != "$ref" for k in branch)
        ):
            return m
        target_ptr = branch["$ref"][1:]
        key = (_json_key(kws), target_ptr)
        name = self._synth.get(key)
        if name is None:
            target = resolve_pointer(self.root, target_ptr)
            size = sum(1 for _ in walk(target)) if target is not None else 0
            if target is None or len(self._synth) >= MAX_SYNTH_DEFS or size > self.budget:
                return None
            self.budget -= size
            name = f"{SYNTH_PREFIX}{len(self._synth)}"
            self._synth[key] = name
            body = self.norm(copy.deepcopy(target), target_ptr)  # may meet this pair again: a $ref to name
            merged = merge(kws, body)
            self.defs[name] = merged if merged is not None else {"allOf": [kws, {"$ref": branch["$ref"]}]}
            self.note(
                ptr("", "$defs", name), "$ref", f"keywords merged into the recursive {branch['$ref']!r}"
            )
        return {"$ref": "#" + ptr("", "$defs", name)}

    def _moves_children(self, at: str) -> bool:
        """Whether a $ref points below `at` other than into its definitions (a rewrite would move it)."""
        prefix = at + "/"
        return any(
            t.startswith(prefix) and not t.startswith((prefix + "definitions/", prefix + "$defs/"))
            for t in self.ref_targets
        )

    def _merge_all_of(self, node: dict, at: str, depth: int = 0) -> Schema:
        if self._moves_children(at):
            return node
        branches = [self._inline_ref(b, (at,)) for b in node["allOf"]]
        held = {k: v for k, v in node.items() if k in _HELD}  # definitions stay where refs expect them
        merged: Schema = {k: v for k, v in node.items() if k != "allOf" and k not in _HELD}
        conditionals = [
            b
            for b in branches
            if isinstance(b, dict)
            and "if" in b
            and {k for k in b if k in VALIDATION_KW} <= {"if", "then", "else"}
        ]
        for b in branches:
            if any(b is c for c in conditionals):
                continue
            m = self._merge_into(merged, b)
            if m is None:
                return node
            merged = m
        for c in conditionals:  # each splits the merged schema into the cases of its if/then/else
            if not isinstance(merged, dict):
                break
            cases = {k: v for k, v in c.items() if k in ("if", "then", "else")}
            if "if" in merged:  # the node's own if/then/else first
                merged = self._if_then_else(merged, at)
            m = (
                self._if_then_else({**merged, **cases}, at)
                if isinstance(merged, dict) and "if" not in merged
                else None
            )
            if not isinstance(m, dict) and m is not False or isinstance(m, dict) and "if" in m:
                return node
            merged = m
        self.note(ptr(at, "allOf"), "allOf", f"{len(branches)} branch(es) merged into one schema")
        if not isinstance(merged, dict):
            return merged
        merged = {**merged, **held}
        if isinstance(merged.get("allOf"), list) and depth < 8:  # an inlined branch brought its own allOf
            return self._merge_all_of(merged, at, depth + 1)
        return merged

    def _distribute(self, node: dict, kw: str, at: str) -> dict:
        """{S, anyOf: [B...]} -> {anyOf: [S & B...]}: the backend ignores keywords beside anyOf/oneOf."""
        siblings = {k: v for k, v in node.items() if k != kw and k in VALIDATION_KW}
        if not siblings or self._moves_children(at):
            return node
        branches = []
        for b in node[kw]:
            m = self._merge_into(siblings, self._inline_ref(b, (at,)))
            if m is None:
                return node
            branches.append(m)
        out = {k: v for k, v in node.items() if k not in siblings}
        out[kw] = branches
        self.note(
            ptr(at, kw), kw, f"sibling keywords ({', '.join(sorted(siblings))}) distributed into each branch"
        )
        return out

    def _not(self, node: dict, at: str) -> Schema:
        """`not` of a type, const or enum, exactly: a narrower type, a shorter enum, or false."""
        n = node["not"]
        core = {k: v for k, v in n.items() if k in VALIDATION_KW} if isinstance(n, dict) else None
        rest = {k: v for k, v in node.items() if k != "not"}
        if n is True or core == {}:
            self.note(ptr(at, "not"), "not", "not of anything: nothing validates")
            return False
        if not core:
            return node
        types = _types(node)
        if set(core) == {"type"} and isinstance(core["type"], (str, list)):
            excluded = {core["type"]} if isinstance(core["type"], str) else set(core["type"])
            if "number" in excluded:
                excluded.add("integer")
            current = types if types is not None else [t for t in TYPES if t != "integer"]
            if "integer" in excluded and "number" in current and "number" not in excluded:
                return node  # numbers that are not integers: no such type
            left = [t for t in current if t not in excluded]
            if not left:
                self.note(ptr(at, "not"), "not", "not of every allowed type: nothing validates")
                return False
            self.note(ptr(at, "not"), "not", f"not of type {sorted(excluded)} as type {left}")
            return {**rest, "type": left[0] if len(left) == 1 else left}
        if set(core) in ({"enum"}, {"const"}):
            values = core["enum"] if "enum" in core else [core["const"]]
            if not isinstance(values, list):
                return node
            keys = {_json_key(v) for v in values}
            if isinstance(node.get("enum"), list) or "const" in node:
                own = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]]
                kept = [v for v in own if _json_key(v) not in keys]
                self.note(ptr(at, "not"), "not", "not of values removed from the enum")
                if not kept:
                    return False
                return {**{k: v for k, v in rest.items() if k != "const"}, "enum": kept}
            if types is not None and set(types) <= {"boolean", "null"}:
                domain = [v for t in types for v in ((True, False) if t == "boolean" else (None,))]
                kept = [v for v in domain if _json_key(v) not in keys]
                self.note(ptr(at, "not"), "not", f"not of values over {types} as an enum")
                return {**rest, "enum": kept} if kept else False
        return node

    def _if_then_else(self, node: dict, at: str) -> Schema:
        """if/then/else on a property's value (`if: {properties: {p: {const|enum}}, required?: [p]}`)
        as the anyOf of its cases, exactly: p in the values (then), p outside them (else: needs p's
        own values listed, an enum or a boolean), p absent (then when `if` does not require p, else
        when it does; no case when the object requires p; expressible when it lists all its
        properties), and non-objects (then: `properties` and `required` do not apply to them, unless
        `if` says type object). Beside an anyOf, each of its branches is split so."""
        if self._moves_children(at) or ("then" not in node and "else" not in node):
            return node  # an `if` alone decides nothing
        cond = self._condition(node.get("if"))
        if cond is None:
            return node
        then, other = node.get("then", True), node.get("else", True)
        core = {k: v for k, v in node.items() if k not in ("if", "then", "else") and k in VALIDATION_KW}
        held = {k: v for k, v in node.items() if k not in ("if", "then", "else") and k not in VALIDATION_KW}
        if isinstance(core.get("anyOf"), list):
            rest = {k: v for k, v in core.items() if k != "anyOf"}
            bases = [merge(rest, self._inline_ref(b, (at,))) for b in core["anyOf"]]
        else:
            bases = [core]
        branches: list[Schema] = []
        for base in bases:
            split = None if base is None else self._split_if(base, cond, then, other)
            if split is None:
                return node
            branches.extend(split)
        if len(branches) > MAX_CROSS_BRANCHES or sum(sum(1 for _ in walk(b)) for b in branches) > self.budget:
            return node
        self.budget -= sum(sum(1 for _ in walk(b)) for b in branches)
        self.note(ptr(at, "if"), "if", f"if/then/else on {cond[0]!r} as {len(branches)} anyOf branch(es)")
        return {**held, "anyOf": branches} if branches else False

    @staticmethod
    def _condition(cond: Schema) -> tuple[str, list, bool, bool] | None:
        """(property, values, `if` requires it, `if` says type object) of an `if` on one property's values."""
        if not isinstance(cond, dict):
            return None
        ccore = {k: v for k, v in cond.items() if k in VALIDATION_KW}
        props = ccore.get("properties")
        if (
            not isinstance(props, dict)
            or len(props) != 1
            or not set(ccore) <= {"properties", "required", "type"}
        ):
            return None
        ((name, pschema),) = props.items()
        req = ccore.get("required", [])
        if (
            not isinstance(pschema, dict)
            or _values(pschema) is None
            or not isinstance(req, list)
            or not set(req) <= {name}
            or {k for k in pschema if k in VALIDATION_KW} - {"const", "enum"}
            or ccore.get("type", "object") not in ("object", ["object"])
        ):
            return None
        values = pschema["enum"] if isinstance(pschema.get("enum"), list) else [pschema["const"]]
        return name, values, name in req, "type" in ccore

    def _split_if(
        self, base: Schema, cond: tuple[str, list, bool, bool], then: Schema, other: Schema
    ) -> list | None:
        """The non-empty cases of `base & if/then/else` (see _if_then_else), None when not expressible."""
        if base is False:
            return []
        if not isinstance(base, dict):
            base = {}
        name, in_values, if_requires, cond_object = cond
        keys = {_json_key(v) for v in in_values}
        types = _types(base)
        pairs: list[tuple[Schema, Schema]] = []
        if types is None or "object" in types:
            own = property_schema(base, name)
            if isinstance(own, dict) and isinstance(own.get("$ref"), str) and own["$ref"].startswith("#"):
                own = resolve_pointer(self.root, own["$ref"][1:])
            if isinstance(own, dict) and isinstance(own.get("enum"), list):
                raw = own["enum"]
            elif isinstance(own, dict) and "const" in own:
                raw = [own["const"]]
            elif isinstance(own, dict) and _types(own) == ["boolean"]:
                raw = [True, False]
            elif own is False:
                raw = []
            else:
                return None  # p outside the values: not expressible without p's own values
            rest_values = [v for v in raw if _json_key(v) not in keys]
            pairs.append(
                ({"type": "object", "required": [name], "properties": {name: {"enum": in_values}}}, then)
            )
            if rest_values:
                pairs.append(
                    (
                        {"type": "object", "required": [name], "properties": {name: {"enum": rest_values}}},
                        other,
                    )
                )
            if name not in base.get("required", []):
                absent = self._absent(base, name)
                if absent is None:
                    return None
                pairs.append((absent, other if if_requires else then))
        non_object = [t for t in (types or TYPES) if t != "object" and not (t == "integer" and types is None)]
        if non_object:
            pairs.append(
                (
                    {"type": non_object if len(non_object) > 1 else non_object[0]},
                    _strip_object_keywords(other if cond_object else then),
                )
            )
        branches = []
        for case, applies in pairs:
            b = merge(base if case.get("type") == "object" else _strip_object_keywords(base), case)
            b = merge(b, applies) if b is not None else None
            if b is None:
                return None
            b = _drop_false_properties(b)
            if not is_empty(b):
                branches.append(b)
        return branches

    @staticmethod
    def _absent(base: dict, name: str) -> dict | None:
        """A schema of exactly the objects (under `base`) without property `name`, when expressible:
        `base` refuses names it does not list, so the case lists every property but `name`."""
        if base.get("additionalProperties") is not False or base.get("patternProperties"):
            return None
        props = base.get("properties", {})
        if not isinstance(props, dict):
            return None
        return {
            "type": "object",
            "properties": {k: v for k, v in props.items() if k != name},
            "additionalProperties": False,
        }

    def _integer_bounds(self, node: dict, at: str) -> dict:
        if _types(node) != ["integer"]:
            return node
        out = dict(node)
        for kw, fn in (("minimum", math.ceil), ("maximum", math.floor)):
            v = out.get(kw)
            if isinstance(v, float) and math.isfinite(v) and not v.is_integer():
                out[kw] = fn(v)
        for ex, kw, step in (("exclusiveMinimum", "minimum", 1), ("exclusiveMaximum", "maximum", -1)):
            v = out.get(ex)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                bound = (math.floor(v) + 1) if step > 0 else (math.ceil(v) - 1)
                old = out.get(kw)
                out[kw] = bound if old is None else (max(old, bound) if step > 0 else min(old, bound))
                del out[ex]
        if out != node:
            self.note(at, "minimum/maximum", "integer bounds as whole inclusive numbers")
        return out

    def _enum_by_type(self, node: dict, at: str) -> dict:
        types = _types(node)
        if types is None or not isinstance(node.get("enum"), list):
            return node
        kept = [v for v in node["enum"] if any(_type_matches(v, t) for t in types)]
        if len(kept) == len(node["enum"]) or not kept:
            return node
        self.note(ptr(at, "enum"), "enum", f"values outside type {types} dropped")
        return {**node, "enum": kept}

    def _required_properties(self, node: dict, at: str) -> dict:
        """The backend enforces `required` only for names listed in `properties`."""
        req = node.get("required")
        if not isinstance(req, list) or "$ref" in node:
            return node
        props = node.get("properties", {})
        missing = [n for n in req if isinstance(n, str) and n not in props]
        if not missing or not isinstance(props, dict) or "unevaluatedProperties" in node:
            return node
        added = {}
        for name in missing:
            s = property_schema(node, name)
            if s is False:
                return node  # no object validates: leave it to the capability walk
            added[name] = s
        self.note(ptr(at, "required"), "required", f"{', '.join(missing)} added to properties")
        return {**node, "properties": {**props, **added}}

    def _false_properties(self, node: dict, at: str) -> dict:
        """`"x": false` (x must be absent) is rejected by the backend; dropping it is exact when the
        object would refuse x anyway and does not require it."""
        props = node.get("properties")
        if not isinstance(props, dict) or not any(v is False for v in props.values()):
            return node
        rest = {k: v for k, v in props.items() if v is not False}
        dropped = [
            k
            for k, v in props.items()
            if v is False
            and k not in node.get("required", [])
            and property_schema({**node, "properties": rest}, k) is False
        ]
        if not dropped:
            return node
        self.note(
            ptr(at, "properties"),
            "properties",
            f"false schemas of {', '.join(dropped)} dropped (additionalProperties refuses them already)",
        )
        return {**node, "properties": {k: v for k, v in props.items() if k not in dropped}}

    def _backend_defaults(self, node: dict, at: str) -> dict:
        """Absent `items` / `additionalProperties` mean "anything"; the backend reads them as "nothing"
        and then rejects minItems/minProperties beyond what is listed: spell the default out."""
        out = node
        if (
            "minItems" in node
            and "items" not in node
            and node.get("minItems", 0) > len(node.get("prefixItems", []))
        ):
            out = {**out, "items": True}
        if (
            "minProperties" in node
            and "additionalProperties" not in node
            and "patternProperties" not in node
            and "unevaluatedProperties" not in node
            and node["minProperties"] > len(node.get("properties", {}))
        ):
            out = {**out, "additionalProperties": True}
        if out is not node:
            self.note(at, "items/additionalProperties", "the default (any) spelled out")
        return out

    def _pattern_controls(self, node: dict, at: str) -> dict:
        p = node.get("pattern")
        if not isinstance(p, str) or not re.search(r"[\n\r\t]", p):
            return node
        self.note(ptr(at, "pattern"), "pattern", "literal control characters escaped")
        return {**node, "pattern": p.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")}

    def _format_patterns(self, node: dict, at: str) -> dict:
        """`format: date` / `date-time` as a pattern of real calendar days (FORMAT_PATTERNS): the
        backend's own grammar admits 02-31. Beside a pattern of its own the format stays (the walk
        then names it)."""
        fmt = node.get("format")
        if fmt not in FORMAT_PATTERNS or "pattern" in node:
            return node
        out = {k: v for k, v in node.items() if k != "format"}
        out["pattern"] = FORMAT_PATTERNS[fmt]
        exact = (
            "" if fmt == "date" else " (as rfc3339-validator reads RFC 3339: upper-case T/Z, no leap second)"
        )
        self.note(ptr(at, "format"), "format", f"{fmt} as a pattern of real calendar days{exact}")
        return out


def property_schema(node: dict, name: str) -> Schema:
    """The schema an object schema applies to property `name` (properties, patternProperties, additionalProperties)."""
    props = node.get("properties", {})
    if name in props:
        return props[name]
    matched = [s for pat, s in node.get("patternProperties", {}).items() if re.search(pat, name)]
    if matched:
        out: Schema = True
        for s in matched:
            m = merge(out, s)
            out = m if m is not None else {"allOf": matched}
        return out
    return node.get("additionalProperties", True)


def _drop_false_properties(s: Schema) -> Schema:
    """Without `"x": false` properties that additionalProperties refuses anyway (exact; the backend
    rejects false properties)."""
    if (
        not isinstance(s, dict)
        or not isinstance(s.get("properties"), dict)
        or s.get("additionalProperties") is not False
        or s.get("patternProperties")
        or not any(v is False for v in s["properties"].values())
    ):
        return s
    if any(s["properties"].get(n) is False for n in s.get("required", [])):
        return False
    return {**s, "properties": {k: v for k, v in s["properties"].items() if v is not False}}


def _strip_object_keywords(s: Schema) -> Schema:
    """`s` as it applies to a non-object (its object keywords do not)."""
    if not isinstance(s, dict):
        return s
    return {
        k: v
        for k, v in s.items()
        if k not in OBJECT_KW + ("dependentRequired", "dependentSchemas", "dependencies")
    }


def _is_true(s: Schema) -> bool:
    return s is True or (isinstance(s, dict) and not any(k in VALIDATION_KW or k in _HELD for k in s))


# Keywords merged by a rule; a keyword on one side only is kept as is (applies independently).
_GROUPS = (
    ("properties", "patternProperties", "additionalProperties"),
    ("prefixItems", "items"),
    ("if", "then", "else"),
    ("contains", "minContains", "maxContains"),
)
_NEVER_MERGE = (
    "$ref",
    "$id",
    "$anchor",
    "$defs",
    "definitions",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicRef",
    "$recursiveRef",
    "additionalItems",
    "dependencies",
)


def merge(a: Schema, b: Schema) -> Schema | None:
    """One schema exactly equivalent to allOf [a, b], or None when no exact merge is known."""
    if _is_true(a):
        return b if not isinstance(a, dict) or not a else _keep_annotations(a, b)
    if _is_true(b):
        return a
    if a is False or b is False:
        return False
    if any(k in a or k in b for k in _NEVER_MERGE):
        return None
    out = dict(a)
    for k, v in b.items():
        if k not in VALIDATION_KW:
            out.setdefault(k, v)
        elif k not in a:
            out[k] = v
    common = {k for k in a if k in b and k in VALIDATION_KW}
    for k in common:
        va, vb = a[k], b[k]
        if any(k in g for g in _GROUPS):
            continue
        if _json_key(va) == _json_key(vb):
            continue
        if k == "anyOf" and isinstance(va, list) and isinstance(vb, list):
            r = _cross_any_of(va, vb)
        else:
            r = _merge_keyword(k, va, vb)
        if r is None:
            return None
        if r is _EMPTY:
            return False
        out[k] = r
    obj = _merge_object_group(a, b)
    if obj is None:
        return None
    out.update(obj)
    for group in _GROUPS[1:]:
        ga = {k: a[k] for k in group if k in a}
        gb = {k: b[k] for k in group if k in b}
        if ga and gb and _json_key(ga) != _json_key(gb):
            if group[0] == "prefixItems" and "prefixItems" not in ga and "prefixItems" not in gb:
                m = merge(ga.get("items", True), gb.get("items", True))
                if m is None:
                    return None
                out["items"] = m
                continue
            return None
    return out


_EMPTY = object()  # a keyword merge that no instance satisfies
MAX_CROSS_BRANCHES = 64  # allOf of two anyOfs: at most this many merged branches


def _cross_any_of(xs: list, ys: list) -> list | object | None:
    """anyOf [x & y for x, y]: exactly allOf [anyOf xs, anyOf ys]; branches no instance satisfies
    dropped (e.g. two different discriminator values); None when a pair has no known merge."""
    if len(xs) * len(ys) > 4 * MAX_CROSS_BRANCHES:
        return None
    out = []
    for x in xs:
        for y in ys:
            m = merge(x, y)
            if m is None:
                return None
            if not is_empty(m):
                out.append(m)
    if len(out) > MAX_CROSS_BRANCHES:
        return None
    return out or _EMPTY


def is_empty(s: Schema) -> bool:
    """Provably satisfied by no instance (false, or an object requiring a false property)."""
    if s is False:
        return True
    if not isinstance(s, dict):
        return False
    if s.get("type") == "object" or _types(s) == ["object"]:
        props = s.get("properties", {})
        if isinstance(props, dict) and any(
            isinstance(n, str) and props.get(n) is False for n in s.get("required", [])
        ):
            return True
    return isinstance(s.get("enum"), list) and not s["enum"]


def _keep_annotations(a: dict, b: Schema) -> Schema:
    if not isinstance(b, dict):
        return b
    return {**{k: v for k, v in a.items() if k not in b}, **b}


def _merge_keyword(k: str, va: Any, vb: Any) -> Any | None:
    if k == "type":
        ta = [va] if isinstance(va, str) else list(va)
        tb = [vb] if isinstance(vb, str) else list(vb)
        both = [t for t in ta if t in tb or (t == "integer" and "number" in tb)]
        both += [t for t in tb if t == "integer" and "number" in ta and t not in both]
        return (both[0] if len(both) == 1 else both) if both else None
    if k == "required":
        return list(dict.fromkeys(list(va) + list(vb)))
    if k in ("minimum", "minLength", "minItems", "minProperties", "exclusiveMinimum", "minContains"):
        return max(va, vb) if _numbers(va, vb) else None
    if k in ("maximum", "maxLength", "maxItems", "maxProperties", "exclusiveMaximum", "maxContains"):
        return min(va, vb) if _numbers(va, vb) else None
    if k == "enum":
        keys = {_json_key(v) for v in vb}
        kept = [v for v in va if _json_key(v) in keys]
        return kept or _EMPTY  # no value in both: nothing validates
    if k == "uniqueItems":
        return bool(va or vb)
    if k == "propertyNames":
        return merge(va, vb)
    return None


def _numbers(*vs: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs)


def _merge_object_group(a: dict, b: dict) -> dict | None:
    """properties / patternProperties / additionalProperties of allOf [a, b] as one schema, when exact."""
    kws = ("properties", "patternProperties", "additionalProperties")
    if not any(k in b for k in kws) or not any(k in a for k in kws):
        return {}
    pa, pb = a.get("patternProperties", {}), b.get("patternProperties", {})
    # A name matching a pattern of one side only falls under the other's additionalProperties:
    # exact only when that side has none.
    if any(p not in pb for p in pa) and not _is_true(b.get("additionalProperties", True)):
        return None
    if any(p not in pa for p in pb) and not _is_true(a.get("additionalProperties", True)):
        return None
    props = {}
    for name in dict.fromkeys(list(a.get("properties", {})) + list(b.get("properties", {}))):
        m = merge(property_schema(a, name), property_schema(b, name))
        if m is None:
            return None
        props[name] = m
    patterns = {}
    for pat in dict.fromkeys(list(pa) + list(pb)):
        m = merge(pa.get(pat, True), pb.get(pat, True))
        if m is None:
            return None
        patterns[pat] = m
    out: dict[str, Any] = {}
    if props:
        out["properties"] = props
    if patterns:
        out["patternProperties"] = patterns
    extra = merge(a.get("additionalProperties", True), b.get("additionalProperties", True))
    if extra is None:
        return None
    if not _is_true(extra):
        out["additionalProperties"] = extra
    return out


def normalise(schema: Schema) -> tuple[Schema, list[SchemaIssue], list[SchemaIssue]]:
    """(normalised schema, rewrites done, problems found: unresolvable refs)."""
    if not isinstance(schema, dict):
        return schema, [], []
    n = _Normaliser(schema)
    root = n.retarget_refs(schema)
    n.root = root
    try:
        out = n.norm(root, "")
    except RecursionError:
        raise SchemaError(SchemaIssue("", "schema", "too deeply nested to normalise")) from None
    if n.defs and isinstance(out, dict):
        out = {**out, "$defs": {**(out.get("$defs") if isinstance(out.get("$defs"), dict) else {}), **n.defs}}
    out = _absent_by_backend_default(out, n)
    return out, n.rewrites, n.problems


def _absent_by_backend_default(schema: Schema, n: _Normaliser) -> Schema:
    """`"x": false` beside no additionalProperties (x must be absent): the backend rejects false
    schemas, but generates no property a schema does not list (unless additionalProperties,
    patternProperties or unevaluatedProperties admit it), so x is dropped. Done last, on the final
    schema: no later merge may give x a schema again."""
    found = [
        (at, node)
        for at, node in walk_all(schema)
        if isinstance(node, dict)
        and isinstance(node.get("properties"), dict)
        and any(v is False for v in node["properties"].values())
        and not any(k in node for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
    ]
    if not found:
        return schema
    schema = copy.deepcopy(schema)
    for at, _ in found:
        node = resolve_pointer(schema, at)
        if not isinstance(node, dict):
            continue
        drop = [k for k, v in node["properties"].items() if v is False and k not in node.get("required", [])]
        for k in drop:
            del node["properties"][k]
        if drop:
            n.note(
                ptr(at, "properties"),
                "properties",
                f"false schemas of {', '.join(drop)} dropped (the grammar "
                "generates no property the schema does not list)",
            )
    return schema


# ---------------------------------------------------------------------------------------
# What the grammar cannot enforce
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unenforced(SchemaIssue):
    """An issue the backend rejects (`rejected`: lenient mode removes the keyword) or ignores."""

    rejected: bool = False


@functools.lru_cache(maxsize=4096)  # a pure function of the pattern
def regex_supported(pattern: str) -> str | None:
    """None when xgrammar's regex converter takes the pattern, else its cleaned message."""
    try:  # as a regex, and as the schema converter reads a string's pattern (`\\b` fails there only)
        xgr.Grammar.from_regex(pattern)
        xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern}), any_whitespace=False)
        return None
    except Exception as e:  # noqa: BLE001 (any backend failure means unsupported)
        return clean_backend_message(str(e))


def _checked_formats() -> frozenset[str]:
    return frozenset(jsonschema.FormatChecker().checkers)


def unenforced(schema: Schema, problems: list[SchemaIssue] = ()) -> list[Unenforced]:  # type: ignore[assignment]
    """Every keyword of the (normalised) schema the grammar cannot enforce, in document order."""
    out: list[Unenforced] = [Unenforced(p.pointer, p.keyword, p.message, rejected=True) for p in problems]
    checked_formats = _checked_formats()
    for at, node in walk_all(schema):
        if not isinstance(node, dict):
            parent, _, last = at.rpartition("/")
            keyword_position = parent.rpartition("/")[2] not in MAP_KW + ("dependencies",) or not parent
            if (
                node is False
                and at
                and not (
                    keyword_position
                    and last
                    in (
                        "additionalProperties",
                        "items",
                        "additionalItems",
                        "unevaluatedProperties",
                        "unevaluatedItems",
                    )
                )
            ):
                out.append(Unenforced(at, "false", "a schema that accepts nothing", rejected=True))
            continue

        def flag(kw: str, msg: str, rejected: bool = False) -> None:
            out.append(Unenforced(ptr(at, kw), kw, msg, rejected))

        if isinstance(node.get("allOf"), list):
            flag("allOf", "branches that could not be merged exactly are not all enforced")
        if "not" in node:
            flag("not", "not enforced")
        if "if" in node and ("then" in node or "else" in node):
            flag("if", "if/then/else not enforced")
        if node.get("uniqueItems") is True:
            why = _unique_items_gap(node, at, schema)
            if why:
                flag("uniqueItems", why)
        for kw in ("dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef"):
            if kw in node:
                flag(kw, "not enforced")
        if "contains" in node:
            flag("contains", "not enforced")
        if any(k in node for k in ("unevaluatedProperties", "unevaluatedItems")) and any(
            k in node for k in ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")
        ):
            flag(
                "unevaluatedProperties" if "unevaluatedProperties" in node else "unevaluatedItems",
                "not enforced across applicators",
            )
        if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], schema):
            flag("oneOf", "enforced as anyOf: more than one branch may match")
        types = _types(node)
        if types is not None and "multipleOf" in node and "integer" not in types:
            flag("multipleOf", "enforced for integers only")
        if isinstance(node.get("pattern"), str):
            if "format" in node:
                flag("pattern", "ignored beside format")
            else:
                why = regex_supported(node["pattern"])
                if why:
                    flag("pattern", f"unsupported regex syntax: {why}", rejected=True)
        for pat in (
            node.get("patternProperties", {}) if isinstance(node.get("patternProperties"), dict) else ()
        ):
            why = regex_supported(pat)
            if why:
                out.append(
                    Unenforced(
                        ptr(at, "patternProperties", pat),
                        "patternProperties",
                        f"unsupported regex syntax: {why}",
                        rejected=True,
                    )
                )
        for kw in ("minLength", "maxLength"):
            if kw in node and ("pattern" in node or "format" in node):
                flag(kw, "ignored beside pattern/format")
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in checked_formats and fmt not in GRAMMAR_FORMATS:
            flag("format", f"format {fmt!r} not enforced")
        elif fmt in FORMAT_PATTERNS:  # left by the normaliser: a pattern beside it
            flag(
                "format",
                f"format {fmt!r} enforced loosely beside a pattern (impossible days such as 02-31 pass)",
            )
        if types is None and not any(k in node for k in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")):
            for kw in NUMERIC_KW + STRING_KW:
                if kw in node:
                    flag(kw, "ignored without a type")
            if not any(k in node for k in OBJECT_KW) and any(
                k in node for k in ("minItems", "maxItems", "uniqueItems")
            ):
                flag("minItems" if "minItems" in node else "maxItems", "ignored without a type")
        if types is not None and any(k in node for k in ("enum", "const")):
            values = node["enum"] if isinstance(node.get("enum"), list) else [node.get("const")]
            if any(not any(_type_matches(v, t) for t in types) for v in values):
                flag("type", "type ignored beside enum/const (a value outside the type)")
        if any(k in node for k in ("anyOf", "oneOf")):
            siblings = [k for k in node if k in VALIDATION_KW and k not in ("anyOf", "oneOf")]
            if siblings:
                flag(siblings[0], f"ignored beside anyOf/oneOf ({', '.join(siblings)})")
        if "$ref" in node:
            siblings = [k for k in node if k in VALIDATION_KW and k != "$ref"]
            if siblings and draft_of(schema) >= 2019:
                flag(siblings[0], f"ignored beside $ref ({', '.join(siblings)})")
        _backend_rejects(node, at, types, out)
    return out


def _unique_items_gap(node: dict, at: str, root: Schema) -> str:
    """Why `uniqueItems` is not enforced at decode time (features/json_tracker.py), or ""."""
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    if not all(unique_enforceable(s, root) for s in [*prefix, node.get("items", True)]):
        return "not enforced (items that are not all scalars)"
    parent_at, _, index = at.rpartition("/")
    holder_at, _, kw = parent_at.rpartition("/")
    if kw in ("anyOf", "oneOf") and index.isdigit():
        holder = resolve_pointer(root, holder_at)
        branches = holder.get(kw, []) if isinstance(holder, dict) else []
        for i, b in enumerate(branches):
            if str(i) != index and (
                b is True
                or isinstance(b, dict)
                and b.get("uniqueItems") is not True
                and (_types(b) is None or "array" in (_types(b) or []))
            ):
                return f"not enforced (branch {kw}/{i} admits arrays with duplicates)"
    return ""


def _backend_rejects(node: dict, at: str, types: list[str] | None, out: list[Unenforced]) -> None:
    """Forms xgrammar refuses to compile, named here instead of its raw message."""

    def flag(kw: str, msg: str) -> None:
        out.append(Unenforced(ptr(at, kw), kw, msg, rejected=True))

    prefix = node.get("prefixItems", [])
    if (
        (node.get("items") is False or "items" not in node and prefix)
        and isinstance(node.get("minItems"), int)
        and node["minItems"] > len(prefix if isinstance(prefix, list) else [])
    ):
        flag("minItems", f"{node['minItems']} > the {len(prefix)} items allowed: no array validates")
    props = node.get("properties", {})
    if (
        node.get("additionalProperties") is False
        and "patternProperties" not in node
        and isinstance(node.get("minProperties"), int)
        and node["minProperties"] > len(props)
    ):
        flag(
            "minProperties",
            f"{node['minProperties']} > the {len(props)} properties allowed: no object validates",
        )
    if types == ["integer"] or (types and "integer" in types and "number" not in types):
        for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = node.get(kw)
            if _numbers(v) and (not math.isfinite(v) or not INT64_MIN <= v <= INT64_MAX):
                flag(kw, "integer bound beyond 64 bits")
    for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if kw in node and not _numbers(node[kw]):
            flag(kw, "not a number")


def _branch_types(b: Schema, root: Schema) -> set[str] | None:
    if isinstance(b, dict) and isinstance(b.get("$ref"), str) and b["$ref"].startswith("#"):
        b = resolve_pointer(root, b["$ref"][1:])
    if not isinstance(b, dict):
        return None
    t = _types(b)
    if t is None and isinstance(b.get("enum"), list):
        t = sorted(
            {next((x for x in TYPES if _type_matches(v, x) and x != "integer"), "?") for v in b["enum"]}
        )
    if t is None and "const" in b:
        t = [next((x for x in TYPES if _type_matches(b["const"], x) and x != "integer"), "?")]
    if t is None:
        return None
    s = set(t)
    if "number" in s:
        s.add("integer")
    return s


def _disjoint(branches: list[Schema], root: Schema) -> bool:
    """Whether at most one oneOf branch can match any instance (by type, or by a const/enum discriminator)."""
    sets = [_branch_types(b, root) for b in branches]
    for i in range(len(branches)):
        for j in range(i + 1, len(branches)):
            if sets[i] is not None and sets[j] is not None and not (sets[i] & sets[j]):
                continue
            if not _discriminated(branches[i], branches[j], root):
                return False
    return True


def _values(s: Schema) -> set[str] | None:
    if isinstance(s, dict) and "const" in s:
        return {_json_key(s["const"])}
    if isinstance(s, dict) and isinstance(s.get("enum"), list):
        return {_json_key(v) for v in s["enum"]}
    return None


def _discriminated(a: Schema, b: Schema, root: Schema) -> bool:
    a = (
        resolve_pointer(root, a["$ref"][1:])
        if isinstance(a, dict) and str(a.get("$ref", "")).startswith("#")
        else a
    )
    b = (
        resolve_pointer(root, b["$ref"][1:])
        if isinstance(b, dict) and str(b.get("$ref", "")).startswith("#")
        else b
    )
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not (va & vb):
        return True
    for name in set(a.get("required", [])) & set(b.get("required", [])):
        va = _values(a.get("properties", {}).get(name))
        vb = _values(b.get("properties", {}).get(name))
        if va is not None and vb is not None and not (va & vb):
            return True
    return False


def relax(schema: Schema, issues: list[Unenforced]) -> Schema:
    """A copy without the keywords the backend rejects (a rejected false schema becomes true)."""
    rejected = [i for i in issues if i.rejected]
    if not rejected:
        return schema
    schema = copy.deepcopy(schema)
    for issue in rejected:
        parent_ptr, _, last = issue.pointer.rpartition("/")
        parent = resolve_pointer(schema, parent_ptr)
        key = last.replace("~1", "/").replace("~0", "~")
        if issue.keyword == "false":  # the pointer is the false schema itself
            if isinstance(parent, dict) and key in parent:
                parent[key] = True
            elif isinstance(parent, list) and key.isdigit():
                parent[int(key)] = True
        elif isinstance(parent, dict) and key in parent:
            del parent[key]  # e.g. an unresolvable $ref: anything is accepted there
    return schema


# ---------------------------------------------------------------------------------------
# Validation of outputs
# ---------------------------------------------------------------------------------------
class OutputValidator:
    """Checks finished outputs against the original schema (its own draft, formats asserted)."""

    MAX_VIOLATIONS = 10

    def __init__(self, schema: Schema):
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def violations(self, text: str) -> list[SchemaIssue]:
        try:
            value = json.loads(text)
        except ValueError as e:
            return [SchemaIssue("", "json", f"not valid JSON: {e}")]
        return self.violations_of(value)

    def violations_of(self, value: Any) -> list[SchemaIssue]:
        out = []
        try:
            for e in self._validator.iter_errors(value):
                out.append(SchemaIssue(ptr("", *e.absolute_path), str(e.validator), e.message[:300]))
                if len(out) >= self.MAX_VIOLATIONS:
                    break
        except Exception as e:  # noqa: BLE001 (e.g. a pattern Python cannot run): report, never raise
            out.append(SchemaIssue("", "schema", f"could not validate: {type(e).__name__}: {e}"[:300]))
        return out


def text_checker(kind: str, text: str) -> Callable[[str], bool] | None:
    """A full-match check for a regex (Python's re, when it reads the pattern), else None."""
    if kind != "regex":
        return None
    try:
        compiled = re.compile(text)
    except re.error:
        return None
    return lambda s: compiled.fullmatch(s) is not None


# ---- shared with the uniqueItems tracker (features/json_tracker.py) ----

MAX_CANDIDATES = 32  # schema nodes tracked for one place (anyOf branches, refs)


def schema_candidates(root: Schema, node: Schema, out: list, depth: int = 0) -> None:
    """The schema nodes an instance at `node` must (or, for branches, may) satisfy, flattened."""
    if len(out) >= MAX_CANDIDATES or depth > 8:
        out.append(True)  # unknown: enforce nothing there
        return
    if not isinstance(node, dict):
        out.append(node)
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = resolve_pointer(root, ref[1:])
        rest = {k: v for k, v in node.items() if k != "$ref"}
        schema_candidates(root, target if target is not None else True, out, depth + 1)
        if any(k in VALIDATION_KW for k in rest):
            out.append(rest)
        return
    branches = [b for kw in ("anyOf", "oneOf") for b in (node.get(kw) or [])]
    if branches:
        rest = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
        if any(k in VALIDATION_KW for k in rest):
            out.append(rest)
        for b in branches:
            schema_candidates(root, b, out, depth + 1)
        return
    out.append(node)
    for b in node.get("allOf") or []:
        schema_candidates(root, b, out, depth + 1)


def unique_enforceable(items: Schema, root: Schema) -> bool:
    """Whether every item an array's `items` admits is a scalar (what the tracker dedups)."""
    cands: list = []
    schema_candidates(root, items, cands)
    for c in cands:
        if not isinstance(c, dict):
            return False
        if isinstance(c.get("enum"), list):
            if any(isinstance(v, (dict, list)) for v in c["enum"]):
                return False
            continue
        if "const" in c:
            if isinstance(c["const"], (dict, list)):
                return False
            continue
        types = _types(c)
        if types is None or any(t in ("object", "array") for t in types):
            return False
    return True
