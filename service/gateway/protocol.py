"""The OpenAI wire format: request bodies to generation calls, results to response bodies.

Pure functions over dicts (no I/O): `parse_chat` / `parse_completion` validate a
request body and return a `Call`; the `*_body` / `*_chunk` functions build the
JSON of responses and stream chunks. `n` samples are n generation calls (`samplings`: sample i's
seed derived from the request's), answered as choices 0..n-1; a completions batch of prompts is a
call per prompt and sample, choice k * n + i prompt k's sample i. Parameters this server cannot honour
(tools, suffix, best_of > 1) are refused with a 400
naming them rather than silently ignored. Completions' `echo` puts the prompt before each choice's
text (and, with `logprobs`, the prompt tokens' logprobs before the output's, the first token's null:
nothing scores it); with `max_tokens: 0` the prompt alone (how lm-eval scores a text). Chat `image_url` parts carry `data:` URIs
(base64 PNG / JPEG / WebP, decoded here); a remote http(s) URL is refused unless its
host is allowed (`--allow-image-urls`), and then left as a `RemoteImage` for the app
to fetch.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from service.core.request import MAX_SAMPLES, sample_seed
from service.gateway.errors import invalid, unsupported
from zerogap.client import Chat, Constraint, Image, Logprobs, Sampling, TokenLogprob

CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
FINISH = {"stop": "stop", "length": "length", "abort": "abort", None: None}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint


@dataclass(frozen=True)
class Call:
    """One parsed request: what to send to the generation service and how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    prompts: tuple[str | list[int] | Chat, ...]  # choice k * n + i is prompt k's sample i (OpenAI's order)
    sampling: Sampling
    logprobs: Logprobs | None
    constraint: Constraint | None
    stream: bool
    include_usage: bool
    n: int = 1  # samples: choices 0..n-1
    echo: bool = False  # completions: the prompt before the text (and its logprobs before the output's)
    prompt_only: bool = False  # echo with max_tokens 0: one token is generated and left out

    @property
    def prompt(self) -> str | list[int] | Chat:
        """The first prompt (a chat's only one)."""
        return self.prompts[0]


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before a choice: the prompt's text and, for logprobs, its first token."""

    text: str
    first_token: int | None = None


@dataclass(frozen=True)
class RemoteImage:
    """An image part at an allowed http(s) URL, to be fetched before the call (`param` names the part)."""

    url: str
    param: str


DATA_URI_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")


# ---- validation helpers ---------------------------------------------------------------------------


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return None
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type:
        raise invalid(name, f"must be {'an integer' if integer else 'a number'}")
    if not lo <= v <= hi:
        raise invalid(name, f"must be in [{lo:g}, {hi:g}], got {v}")
    return v


def _bool(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(name, "must be a boolean")
    return v


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "must be a non-empty string or a list of them")
    return stops


def _refuse(body: Mapping[str, Any], names: Sequence[str]) -> None:
    for name in names:
        if body.get(name):
            raise unsupported(name)


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (the service checks the ids against the vocab).

    Keys are decimal token ids ("12", not " 12", "1_000" or "012": two spellings of one id would
    silently merge); values are numbers (null is refused, not read as 0).
    """
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise invalid("logit_bias", "must be an object of token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        digits = isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit()
        if not (digits and (key == "0" or key[0] != "0")):
            raise invalid("logit_bias", f"keys must be token ids, got {str(key)[:24]!r}")
        token = int(key)
        if token >= 2**31:
            raise invalid("logit_bias", f"token id {key} is out of range")
        if value is None:
            raise invalid("logit_bias", f"the bias of token {key} must be a number, got null")
        out[token] = _number({"logit_bias": value}, "logit_bias", -100, 100)
    return out or None


def _sampling(body: Mapping[str, Any], max_tokens: int | None) -> Sampling:
    seed = _number(body, "seed", 0, 2**64 - 1, integer=True)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise invalid("stop_token_ids", "must be a list of integers")
    return Sampling(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2) or 0.0,
        presence_penalty=_number(body, "presence_penalty", -2, 2) or 0.0,
        seed=seed,
        stop=_stop(body),
        # extensions (the names vLLM uses)
        top_k=_number(body, "top_k", -1, 2**31 - 1, integer=True) or 0,
        min_p=_number(body, "min_p", 0, 1) or 0.0,
        repetition_penalty=_number(body, "repetition_penalty", 0, 100),
        min_new_tokens=_number(body, "min_tokens", 0, 2**31 - 1, integer=True) or 0,
        ignore_eos=_bool(body, "ignore_eos"),
        stop_token_ids=ids,
        logit_bias=_logit_bias(body),
    )


def _max_tokens(
    body: Mapping[str, Any], names: Sequence[str], default: int | None, lowest: int = 1
) -> int | None:
    for name in names:
        v = _number(body, name, lowest, 2**31 - 1, integer=True)
        if v is not None:
            return v
    return default


def _response_format(body: Mapping[str, Any]) -> Constraint | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise invalid("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_schema({"type": "object"})
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, Mapping) else None
        if not isinstance(schema, Mapping):
            raise invalid("response_format.json_schema.schema", "must be a JSON Schema object")
        # strict: true refuses keywords the grammar cannot enforce; false relaxes them (lenient);
        # absent: the server's --constraint-mode
        strict = js.get("strict")
        return Constraint.json_schema(schema, None if strict is None else "strict" if strict else "lenient")
    raise invalid("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _common(body: Any) -> tuple[str, bool, bool, int]:
    if not isinstance(body, Mapping):
        raise invalid("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required")
    n = _number(body, "n", 1, MAX_SAMPLES, integer=True) or 1
    stream = _bool(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise invalid("stream_options", "must be an object")
    return model, stream, bool(stream and opts.get("include_usage")), n


# ---- requests ------------------------------------------------------------------------------------


def _image_url(param: str, part: Mapping[str, Any], image_hosts: frozenset[str]) -> Image | RemoteImage:
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str) or not url:
        raise invalid(param, "must hold a url (a data: URI or an allowed http(s) URL)")
    if url.startswith("data:"):
        head, comma, data = url[5:].partition(",")
        kind, _, encoding = head.partition(";")
        if not comma or encoding.lower() != "base64":
            raise invalid(param, "a data: URI must be base64 (data:image/png;base64,...)")
        if kind.lower() not in DATA_URI_TYPES:
            raise invalid(param, f"unsupported data: URI type {kind!r} (image/png, image/jpeg or image/webp)")
        try:
            return Image(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            raise invalid(param, "the data: URI is not valid base64") from None
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise invalid(param, "must be a data: URI or an http(s) URL")
    if parsed.hostname.lower() not in image_hosts:
        allowed = ", ".join(sorted(image_hosts)) or "none"
        raise invalid(
            param,
            f"remote image URLs are refused for host {parsed.hostname!r} (allowed hosts: {allowed}; "
            "the gateway's --allow-image-urls); send the image as a data: URI",
        )
    return RemoteImage(url, param)


def _content(i: int, content: Any, image_hosts: frozenset[str]) -> str | list[Any]:
    """A message's content: its text, or (with images) its parts in order: str, Image, RemoteImage."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[Any] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image_url":
                parts.append(_image_url(f"messages[{i}].content[{j}].image_url", part, image_hosts))
            else:
                raise unsupported(
                    f"messages[{i}].content[{j}]", "only text and image_url parts are supported"
                )
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
        return parts
    raise invalid(f"messages[{i}].content", "must be a string or a list of text and image_url parts")


def remote_images(call: Call) -> list[RemoteImage]:
    """The call's image parts still to be fetched."""
    if not isinstance(call.prompt, Chat):
        return []
    return [
        p for _, c in call.prompt.messages if not isinstance(c, str) for p in c if isinstance(p, RemoteImage)
    ]


def with_images(call: Call, fetched: Mapping[str, bytes]) -> Call:
    """The call with each RemoteImage (by its param) replaced by the fetched bytes."""
    assert isinstance(call.prompt, Chat)
    msgs = [
        (
            r,
            c
            if isinstance(c, str)
            else [Image(fetched[p.param]) if isinstance(p, RemoteImage) else p for p in c],
        )
        for r, c in call.prompt.messages
    ]
    return dataclasses.replace(call, prompts=(Chat(msgs),))


def parse_chat(
    body: Any, default_max_tokens: int | None = None, image_hosts: frozenset[str] = frozenset()
) -> Call:
    model, stream, include_usage, n = _common(body)
    _refuse(body, ("tools", "functions", "audio", "prediction"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "must be a non-empty list")
    chat = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or m.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}")
        chat.append((CHAT_ROLES[m["role"]], _content(i, m.get("content"), image_hosts)))
    top = _number(body, "top_logprobs", 0, 20, integer=True)
    want = _bool(body, "logprobs")
    if top and not want:
        raise invalid("top_logprobs", "needs logprobs: true")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), default_max_tokens)
    # vLLM's extensions: continue the last (assistant) message instead of opening a new turn
    cont = _bool(body, "continue_final_message")
    add = body.get("add_generation_prompt")
    if add is not None and not isinstance(add, bool):
        raise invalid("add_generation_prompt", "must be a boolean")
    if cont and add:
        raise invalid("continue_final_message", "not with add_generation_prompt: true")
    if cont and chat[-1][0] != "assistant":
        raise invalid("continue_final_message", "the last message must be the assistant's")
    return Call(
        "chat",
        model,
        (Chat(chat, add_generation_prompt=add, continue_final_message=cont),),
        _sampling(body, max_tokens),
        Logprobs(top=top or 0) if want else None,
        _response_format(body),
        stream,
        include_usage,
        n,
    )


def parse_completion(body: Any, default_max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS) -> Call:
    model, stream, include_usage, n = _common(body)
    _refuse(body, ("suffix",))
    if _number(body, "best_of", 1, 128, integer=True) not in (None, 1):
        raise unsupported("best_of", "must be 1 on this server")
    batch = _prompts(body.get("prompt"))
    if len(batch) * n > MAX_SAMPLES:
        raise invalid("prompt", f"{len(batch)} prompts x n {n} exceed {MAX_SAMPLES} choices")
    top = _number(body, "logprobs", 0, 20, integer=True)
    echo = _bool(body, "echo")
    max_tokens = _max_tokens(body, ("max_tokens",), default_max_tokens, lowest=0 if echo else 1)
    if max_tokens == 0 and body.get("min_tokens"):
        raise invalid("min_tokens", "must be 0 with max_tokens 0")
    return Call(
        "completion",
        model,
        tuple(batch),
        _sampling(body, 1 if max_tokens == 0 else max_tokens),
        None if top is None else Logprobs(top=top, input_from=0 if echo else None),
        _response_format(body),
        stream,
        include_usage,
        n,
        echo=echo,
        prompt_only=max_tokens == 0,
    )


def _is_ids(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in v)
    )


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completions prompt: a string, a list of token ids, or a batch (a list) of either."""
    if (isinstance(prompt, str) and prompt) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all((isinstance(x, str) and x) or _is_ids(x) for x in prompt):
        return list(prompt)
    raise invalid("prompt", "must be a non-empty string, a list of token ids, or a list of either")


def samplings(call: Call) -> list[Sampling]:
    """The sampling settings of each of the call's n samples (sample 0's are the call's own)."""
    return [
        dataclasses.replace(call.sampling, seed=sample_seed(call.sampling.seed, i)) for i in range(call.n)
    ]


def openai_param(grpc_field: str | None, kind: str) -> str | None:
    """The request parameter a gRPC error's field names (e.g. sampling.max_new_tokens -> max_tokens)."""
    if not grpc_field:
        return None
    head, _, rest = grpc_field.partition(".")
    if head == "sampling":
        return {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(rest, rest)
    if head == "constraint":
        return "response_format"
    if head == "input":
        return "messages" if kind == "chat" else "prompt"
    return grpc_field


# ---- responses -----------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # from the prefix cache
    }


def content_logprobs(
    entries: Sequence[TokenLogprob], finish_reason: str | None, matched_stop: str | int | None
) -> list[TokenLogprob]:
    """The entries of the tokens that are part of the text: a stop token that ended generation is not."""
    if finish_reason == "stop" and isinstance(matched_stop, int) and entries:
        return list(entries[:-1])
    return list(entries)


def token_text(entry: TokenLogprob, texts: Mapping[int, str]) -> str:
    if entry.text:
        return entry.text
    for t in entry.top:
        if t.token_id == entry.token_id:
            return t.text
    return texts[entry.token_id]


def missing_texts(entries: Sequence[TokenLogprob]) -> set[int]:
    """Ids whose text token_text() needs from elsewhere (from a server that does not send the
    chosen token's text, when it is outside its top list)."""
    return {e.token_id for e in entries if not e.text and all(t.token_id != e.token_id for t in e.top)}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: Mapping[int, str]) -> dict[str, Any]:
    content = []
    for e in entries:
        item = _token(token_text(e, texts), e.logprob)
        item["top_logprobs"] = [_token(t.text, t.logprob) for t in e.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: Mapping[int, str], offset: int, first_token: int | None = None
) -> dict[str, Any]:
    """The legacy completions' logprobs of `entries` (their text from `offset` on); an echoed
    prompt's `first_token` leads them with nulls (nothing scores a prompt's first token)."""
    tokens = [token_text(e, texts) for e in entries]
    logprobs: list[float | None] = [e.logprob for e in entries]
    tops: list[dict[str, float] | None] = [{t.text: t.logprob for t in e.top} for e in entries]
    if first_token is not None:
        tokens, logprobs, tops = [texts[first_token], *tokens], [None, *logprobs], [None, *tops]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def choice_text(call: Call, text: str, echo: Echo | None) -> str:
    """A choice's text (or a stream's delta of it): `echo`'s prompt first (on the first delta only:
    pass None after), the output left out with max_tokens 0."""
    out = "" if call.prompt_only else text
    return out if echo is None else echo.text + out


def envelope(call: Call, rid: str, created: int, chunk: bool) -> dict[str, Any]:
    obj = {"chat": "chat.completion", "completion": "text_completion"}[call.kind]
    if chunk and call.kind == "chat":
        obj += ".chunk"
    return {"id": rid, "object": obj, "created": created, "model": call.model}


def choice(
    call: Call,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict | None,
    chunk: bool,
    first: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    end = FINISH[finish_reason]
    if call.kind == "completion":
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": end}
    if not chunk:
        msg = {"role": "assistant", "content": text}
        return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": end}
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": end}


def sse(data: Mapping[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def now() -> int:
    return int(time.time())
