"""Plain typed carriers of the client API and their conversion to and from the protos.

Requests are described by `Sampling`, `Logprobs` and `Constraint`; results come
back as `Completion` (a whole result) or `Delta` (one streamed message). Each
result keeps the raw protobuf message in `.raw` for fields added later.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from zerogap.v1 import generation_pb2 as pb2

# GenerateStream's initial metadata carries this key once the server has queued the request (before
# its first token, which may wait for a free slot); a refused request ends with its status instead.
QUEUED_METADATA_KEY = "zerogap-queued"

FINISH_REASONS = {
    pb2.FINISH_REASON_UNSPECIFIED: None,
    pb2.FINISH_REASON_STOP: "stop",
    pb2.FINISH_REASON_LENGTH: "length",
    pb2.FINISH_REASON_ABORT: "abort",
}


class ZerogapError(grpc.RpcError):
    """A failed call: the gRPC status code and the server's message.

    A `grpc.RpcError`, with the same `code()` / `details()` accessors, so code
    that catches gRPC errors keeps working."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.status = code
        self.message = details

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.message

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> ZerogapError:
        code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
        details = err.details() if callable(getattr(err, "details", None)) else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


# ---- request side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """Sampling settings (proto SamplingParams). None leaves the server's default:
    max_new_tokens 128, temperature 1.0 (0 = greedy), top_p 1, repetition_penalty 1,
    no seed, skip_special_tokens true."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool | None = None
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit, in [-100, 100]

    def to_proto(self):
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kw = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in kw.items() if v is not None}
        return pb2.SamplingParams(**kw)

    def with_overrides(self, overrides: Mapping[str, Any]) -> Sampling:
        """A copy with `overrides` (Sampling field names) applied; unknown names raise TypeError."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown sampling argument(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides) if overrides else self


GREEDY = Sampling(temperature=0.0)


@dataclass(frozen=True)
class Logprobs:
    """What logprobs to return (the model's raw next-token distribution).

    output: each output token's logprob; top: also the N most likely tokens per
    position (0-20); token_ids: also these ids per position; input_from: the
    prompt's logprobs from this position on (with output=False: only those)."""

    top: int = 0
    token_ids: Sequence[int] = ()
    input_from: int | None = None
    output: bool = True

    def apply(self, req) -> None:
        req.return_logprob = self.output
        req.top_logprobs_num = self.top
        req.token_ids_logprob.extend(self.token_ids)
        if self.input_from is not None:
            req.logprob_start_len = self.input_from


@dataclass(frozen=True)
class Constraint:
    """Constrained decoding: build with Constraint.json_schema / json_object / regex / ebnf /
    structural_tag. `mode` ("strict" or "lenient"; None: the server's --constraint-mode) says what
    happens to JSON-schema keywords the grammar cannot enforce: strict refuses the request
    (INVALID_ARGUMENT naming them), lenient relaxes them and lists them in the result's
    constraint_result.relaxed."""

    kind: str
    value: str | bool
    mode: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(m for m in MODES if m)}, got {self.mode!r}")

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str, mode: str | None = None) -> Constraint:
        return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema), mode)

    @staticmethod
    def json_object() -> Constraint:
        return Constraint("json_object", True)

    @staticmethod
    def regex(pattern: str) -> Constraint:
        return Constraint("regex", pattern)

    @staticmethod
    def ebnf(grammar: str) -> Constraint:
        return Constraint("ebnf", grammar)

    @staticmethod
    def structural_tag(tag: Mapping[str, Any] | str, mode: str | None = None) -> Constraint:
        """xgrammar's structural tag, e.g. free text with `<tool_call>{...}</tool_call>` parts
        whose JSON follows a schema (README "Tool calls")."""
        return Constraint("structural_tag", tag if isinstance(tag, str) else json.dumps(tag), mode)

    def to_proto(self):
        return pb2.Constraint(**{self.kind: self.value}, mode=MODES[self.mode])


MODES = {
    None: pb2.CONSTRAINT_MODE_UNSPECIFIED,
    "strict": pb2.CONSTRAINT_MODE_STRICT,
    "lenient": pb2.CONSTRAINT_MODE_LENIENT,
}


@dataclass(frozen=True)
class Image:
    """An image part of a chat message: the raw bytes of a PNG, JPEG or WebP file (the server
    decodes and checks them; a bad image is refused with INVALID_ARGUMENT naming the part)."""

    data: bytes

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Image:
        with open(path, "rb") as f:
            return cls(f.read())

    @classmethod
    def from_pil(cls, img: Any, format: str = "PNG") -> Image:
        """A PIL image, encoded (PNG by default: lossless). PIL is needed only by the caller."""
        buf = io.BytesIO()
        img.save(buf, format=format)
        return cls(buf.getvalue())


def image(source: Any) -> Image:
    """An Image from bytes, a path (pathlib.Path or os.PathLike; a str is text, not a path) or a
    PIL image."""
    if isinstance(source, Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return Image(bytes(source))
    if isinstance(source, os.PathLike):
        return Image.from_path(source)
    if callable(getattr(source, "save", None)) and hasattr(source, "mode"):  # a PIL image (duck-typed)
        return Image.from_pil(source)
    raise TypeError(f"an image part must be bytes, a path or a PIL image, not {type(source).__name__}")


# A message's content: text, or parts in order: str (text), or an image (Image, bytes, a path, a
# PIL image, {"type": "image", "image": ...}), or {"type": "text", "text": ...}.
Content = str | Sequence[Any]


@dataclass(frozen=True)
class Message:
    role: str
    content: Content


@dataclass(frozen=True)
class Chat:
    """Chat input; the server applies the model's chat template (images go where it puts them)."""

    messages: Sequence[Message | Mapping[str, Any] | tuple[str, Content]]
    add_generation_prompt: bool | None = None  # None: true, or false with continue_final_message
    continue_final_message: bool = False  # the last (assistant) message is left open and continued

    def to_proto(self):
        msgs = [_message_proto(r, c) for r, c in map(_role_content, self.messages)]
        chat = pb2.ChatInput(messages=msgs, continue_final_message=self.continue_final_message)
        if self.add_generation_prompt is not None:
            chat.add_generation_prompt = self.add_generation_prompt
        return chat


def _part_proto(part: Any):
    if isinstance(part, str):
        return pb2.ContentPart(text=part)
    if isinstance(part, Mapping):
        if part.get("type") == "text":
            return pb2.ContentPart(text=part["text"])
        if part.get("type") == "image":
            return pb2.ContentPart(image=image(part["image"]).data)
        raise ValueError(f"unknown content part type {part.get('type')!r} (text or image)")
    return pb2.ContentPart(image=image(part).data)


def _message_proto(role: str, content: Content):
    if isinstance(content, str):
        return pb2.ChatMessage(role=role, content=content)
    return pb2.ChatMessage(role=role, parts=[_part_proto(p) for p in content])


def _role_content(m: Message | Mapping[str, Any] | tuple[str, Content]) -> tuple[str, Content]:
    if isinstance(m, Message):
        return m.role, m.content
    if isinstance(m, Mapping):
        return m["role"], m["content"]
    role, content = m
    return role, content


# What generate/stream/json accept as input: text, token ids, chat messages or a Chat.
Input = str | Sequence[int] | Sequence[Message | Mapping[str, Any] | tuple[str, Content]] | Chat


def build_request(
    prompt: Input,
    sampling: Sampling | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    logprobs: Logprobs | bool | None = None,
    constraint: Constraint | None = None,
    request_id: str = "",
):
    """A GenerateRequest from the client helpers' arguments."""
    s = (sampling or Sampling()).with_overrides(overrides or {})
    req = pb2.GenerateRequest(request_id=request_id, sampling=s.to_proto())
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, Chat):
        req.chat.CopyFrom(prompt.to_proto())
    elif len(prompt) and not isinstance(prompt[0], int):
        req.chat.CopyFrom(Chat(prompt).to_proto())  # type: ignore[arg-type]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    if logprobs:
        (logprobs if isinstance(logprobs, Logprobs) else Logprobs()).apply(req)
    if constraint is not None:
        req.constraint.CopyFrom(constraint.to_proto())
    return req


# ---- result side ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
    asked: list[TopLogprob] = field(default_factory=list)  # GenerateRequest.token_ids_logprob order
    text: str = ""  # the token decoded alone (special tokens kept); "" from servers before it

    @staticmethod
    def from_proto(p) -> TokenLogprob:
        def tops(xs) -> list[TopLogprob]:
            return [TopLogprob(t.token_id, t.logprob, t.text) for t in xs]

        return TokenLogprob(p.token_id, p.logprob, tops(p.top_logprobs), tops(p.token_ids_logprobs), p.text)


@dataclass(frozen=True)
class ConstraintIssue:
    pointer: str  # a JSON pointer into the schema (relaxed, normalized) or the output (violations)
    keyword: str
    message: str


@dataclass(frozen=True)
class ConstraintResult:
    """The server's check of a finished constrained output: STOP with satisfied=True means valid."""

    satisfied: bool
    relaxed: list[ConstraintIssue]  # keywords the grammar did not enforce (lenient mode)
    violations: list[ConstraintIssue]
    normalized: list[ConstraintIssue]  # exact rewrites applied to the schema

    @staticmethod
    def from_response(r) -> ConstraintResult | None:
        if not r.HasField("constraint_result"):
            return None
        c = r.constraint_result

        def issues(xs) -> list[ConstraintIssue]:
            return [ConstraintIssue(x.pointer, x.keyword, x.message) for x in xs]

        return ConstraintResult(c.satisfied, issues(c.relaxed), issues(c.violations), issues(c.normalized))


def _matched_stop(resp) -> str | int | None:
    which = resp.WhichOneof("matched_stop")
    return getattr(resp, which) if which else None


@dataclass(frozen=True)
class Delta:
    """One streamed message: the new tokens and text; the last one has finish_reason and usage."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob]
    input_logprobs: list[TokenLogprob]
    constraint_result: ConstraintResult | None  # on the last message of a constrained request
    raw: Any = field(repr=False, compare=False)
    cached_tokens: int = 0  # prompt tokens served from the server's prefix cache (last message)

    @staticmethod
    def from_proto(r) -> Delta:
        return Delta(
            r.request_id,
            r.text,
            list(r.token_ids),
            FINISH_REASONS[r.finish_reason],
            _matched_stop(r),
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            [TokenLogprob.from_proto(x) for x in r.output_logprobs],
            [TokenLogprob.from_proto(x) for x in r.input_logprobs],
            ConstraintResult.from_response(r),
            r,
            cached_tokens=r.usage.cached_tokens,
        )


@dataclass(frozen=True)
class Completion:
    """A whole result (Generate, or a stream's deltas joined)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs_start: int = 0
    normalized_prompt_logprob: float = 0.0
    constraint_result: ConstraintResult | None = None
    raw: Any = field(default=None, repr=False, compare=False)
    cached_tokens: int = 0  # prompt tokens served from the server's prefix cache

    @staticmethod
    def from_proto(r) -> Completion:
        d = Delta.from_proto(r)
        return Completion(
            d.request_id,
            d.text,
            d.token_ids,
            d.finish_reason,
            d.matched_stop,
            d.prompt_tokens,
            d.completion_tokens,
            d.logprobs,
            d.input_logprobs,
            r.input_logprobs_start,
            r.normalized_prompt_logprob,
            d.constraint_result,
            r,
            cached_tokens=d.cached_tokens,
        )

    @staticmethod
    def from_deltas(deltas: Sequence[Delta]) -> Completion:
        if not deltas:
            raise ValueError("no deltas")
        first, last = deltas[0], deltas[-1]
        return Completion(
            last.request_id,
            "".join(d.text for d in deltas),
            [t for d in deltas for t in d.token_ids],
            last.finish_reason,
            last.matched_stop,
            last.prompt_tokens,
            last.completion_tokens,
            [x for d in deltas for x in d.logprobs],
            first.input_logprobs,
            first.raw.input_logprobs_start,
            first.raw.normalized_prompt_logprob,
            last.constraint_result,
            cached_tokens=last.cached_tokens,
        )

    def json(self) -> Any:
        """The text parsed as JSON. ValueError if it is not complete JSON (naming the finish reason)
        or if the server's check found it violating its schema (naming the violations)."""
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"output is not complete JSON (finish_reason={self.finish_reason}): {e}"
            ) from None
        if self.constraint_result is not None and not self.constraint_result.satisfied:
            why = "; ".join(f"{v.pointer or '/'}: {v.message}" for v in self.constraint_result.violations)
            raise ValueError(f"output violates its schema: {why}")
        return value


def json_constraint(schema: Mapping[str, Any] | str | None) -> Constraint:
    """The constraint of a `json(...)` helper call: a schema, or any JSON object when None."""
    return Constraint.json_object() if schema is None else Constraint.json_schema(schema)
