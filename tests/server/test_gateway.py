"""The OpenAI-compatible gateway (`python -m service gateway`), driven by the official openai SDK,
in front of a real gRPC server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pydantic
import pytest

from service.config import ServerArgs
from service.gateway import protocol
from service.gateway.app import Gateway, GatewayConfig
from service.gateway.errors import APIError
from service.server import BackgroundServer
from tests.helpers import kv_idle, need_tools, person_as_json, wait_until
from zerogap.client import GREEDY, Chat, Client, Delta, Logprobs, ZerogapError

ROOT = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "Hi! How are you?"}]
ENDLESS = {"ignore_eos": True}  # an extension (extra_body): never stops before max_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(smol_dir):
    srv = BackgroundServer(
        # bf16: a prefix-cache hit rounds differently from a full prefill, and these tests compare the
        # same request's logprobs through the gateway and gRPC (README "Prefix cache").
        ServerArgs(
            model=str(smol_dir),
            port=0,
            kv_cache_tokens=4096,
            max_running_requests=8,
            disable_prefix_cache=True,
        )
    )
    yield srv
    srv.stop()


@contextlib.contextmanager
def run_gateway(grpc_address: str, *extra: str) -> Iterator[str]:
    """`python -m service gateway` in a subprocess on a free port; yields its base URL once healthy."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
            "gateway",
            "--grpc",
            grpc_address,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_until(lambda: proc.poll() is None and _healthy(base + "/health"), 60, 0.1):
            proc.kill()
            pytest.fail(f"the gateway did not start: {proc.communicate()[0]}")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def gateway(server):
    with run_gateway(server.address) as base:
        yield base


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.engine.model_dir.name


@pytest.fixture
def oai(gateway, server):
    with openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    assert wait_until(lambda: kv_idle(server), 20), "a request kept its KV cache"


@pytest.fixture(scope="module")
def zg(server):
    with Client(server.address) as c:
        yield c


def test_models_list(oai, model):
    assert [m.id for m in oai.models.list().data] == [model]
    assert oai.models.retrieve(model).id == model


def test_chat_matches_the_grpc_service(oai, zg, model):
    r = oai.chat.completions.create(model=model, messages=HI, max_tokens=24, temperature=0)
    ref = zg.chat(HI, GREEDY, max_new_tokens=24)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, ref.completion_tokens)
    assert r.usage.total_tokens == ref.prompt_tokens + ref.completion_tokens


def test_chat_streaming_arrives_in_chunks(oai, zg, model):
    ref = zg.chat(HI, GREEDY, max_new_tokens=24)
    stream = oai.chat.completions.create(
        model=model,
        messages=HI,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1 and "".join(content) == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.completion_tokens


def test_completions_stop_seed_and_stream(oai, model):
    r = oai.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7,"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == " 5, 6,"
    parts = list(
        oai.completions.create(
            model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=" 7,", stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts) == " 5, 6," and len(parts) > 1
    seeded = [
        oai.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    assert (
        oai.completions.create(model=model, prompt="Once upon a time", max_tokens=3).usage.completion_tokens
        == 3
    )


def test_completions_echo_the_prompt_and_its_logprobs(oai, zg, model, hf_tokenizer):
    """`echo`: the prompt before the text; with logprobs the prompt tokens' before the output's (the
    first null), as lm-eval's loglikelihood reads them (token ids in, max_tokens 1, logprobs 1);
    max_tokens 0: the prompt alone. Streamed, the prompt leads each choice's first chunk."""
    text = "The capital of France is"
    plain = oai.completions.create(model=model, prompt=text, max_tokens=4, temperature=0)
    echoed = oai.completions.create(model=model, prompt=text, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == text + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 4

    ids = zg.tokenize(text, add_special_tokens=True)
    want = zg.generate(ids, GREEDY, max_new_tokens=1, logprobs=Logprobs(top=1, input_from=0))
    lm_eval = oai.completions.create(
        model=model, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    lp = lm_eval.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx([e.logprob for e in want.input_logprobs], abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(want.logprobs[0].logprob, abs=1e-5)
    assert all(
        len(top) == 1 and max(top.values()) >= tok
        for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:])
    )
    assert "".join(lp.tokens) == lm_eval.choices[0].text and lp.text_offset[0] == 0
    # each entry carries its token's text (the gateway needs no Detokenize call for it)
    assert (
        [e.text for e in want.input_logprobs]
        == [hf_tokenizer.decode([t]) for t in ids[1:]]
        == lp.tokens[1:-1]
    )
    assert lm_eval.choices[0].text.startswith(text)

    eos = zg.model_info().eos_token_ids[0]  # generated (forced), it keeps its entry: lm-eval's [:-1]
    ended = oai.completions.create(
        model=model, prompt=[ids], max_tokens=1, logprobs=1, echo=True, logit_bias={str(eos): 100}
    )
    assert (
        ended.choices[0].finish_reason == "stop"
        and len(ended.choices[0].logprobs.token_logprobs) == len(ids) + 1
    )
    assert ended.choices[0].logprobs.token_logprobs[1:-1] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-5)

    only = oai.completions.create(model=model, prompt=text, max_tokens=0, logprobs=0, echo=True)
    assert only.choices[0].text == text and only.usage.completion_tokens == 0
    assert len(only.choices[0].logprobs.token_logprobs) == len(ids)
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-5)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt=text, max_tokens=0)

    chunks = list(
        oai.completions.create(
            model=model, prompt=text, max_tokens=4, temperature=0, echo=True, n=2, stream=True
        )
    )
    for i in range(2):
        parts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i]
        assert parts[0].startswith(text) and "".join(parts) == echoed.choices[0].text


def test_chat_continue_final_message(oai, zg, model):
    """vLLM's extension: the answer continues the last (assistant) message's text."""
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}]
    r = oai.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    want = zg.generate(Chat(messages, continue_final_message=True), GREEDY, max_new_tokens=4)
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == want.prompt_tokens


def test_completions_prompt_batches(oai, zg, model):
    """A batch of prompts (strings or token id lists): choice k * n + i is prompt k's sample i, as
    each prompt alone gives it; usage counts each prompt once. lm-eval sends its batches so."""
    prompts = ["1, 2, 3,", "The capital of France is"]
    alone = [oai.completions.create(model=model, prompt=pr, max_tokens=4, temperature=0) for pr in prompts]
    both = oai.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 4 * 4
    chunks = list(
        oai.completions.create(
            model=model, prompt=prompts, max_tokens=4, temperature=0, n=2, stream=True, echo=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = [
        "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == k) for k in range(4)
    ]
    assert texts == [pr + a.choices[0].text for pr, a in zip(prompts, alone) for _ in range(2)]
    assert chunks[-1].usage.prompt_tokens == both.usage.prompt_tokens
    ids = [zg.tokenize(pr, add_special_tokens=True) for pr in prompts]
    scored = oai.completions.create(
        model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    assert [len(c.logprobs.token_logprobs) for c in scored.choices] == [len(i) + 1 for i in ids]


def test_n_samples_are_indexed_choices(oai, model):
    """n: n choices, each its own sample, streamed as chunks tagged with their index; usage counts the
    prompt once and every sample's tokens. (bf16 here: a sample's bits may depend on which samples
    share its steps, so the seeds' repeatability is checked in float32, tests/server/test_smg_worker.py.)"""
    kw = dict(model=model, messages=HI, max_tokens=12, temperature=2.0, seed=9, extra_body=ENDLESS)
    r = oai.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.finish_reason for c in r.choices} == {"length"}
    assert len({c.message.content for c in r.choices}) == 3
    one = oai.chat.completions.create(**kw)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (one.usage.prompt_tokens, 36)
    chunks = list(oai.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    streamed, roles, ends = ["", "", ""], [0, 0, 0], [None, None, None]
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        ends[choice.index] = ends[choice.index] or choice.finish_reason
    assert all(streamed) and roles == [1, 1, 1] and ends == ["length"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 36
    done = oai.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=1.0,
        n=2,
        logprobs=1,
        extra_body=ENDLESS,
    )
    assert [c.index for c in done.choices] == [0, 1]
    assert all("".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset[0] == 0 for c in done.choices)


def test_logit_bias(oai, model, zg):
    """OpenAI's logit_bias: +100 makes a token every answer; -100 keeps greedy's first choice out."""
    token = zg.tokenize(" banana")[0]
    kw = dict(model=model, messages=HI, max_tokens=4, temperature=0, extra_body=ENDLESS)
    forced = oai.chat.completions.create(logit_bias={str(token): 100}, **kw).choices[0].message.content
    assert forced == " banana" * 4
    plain = (
        oai.completions.create(model=model, prompt="1, 2, 3,", max_tokens=1, temperature=0).choices[0].text
    )
    first = zg.tokenize(plain)[0]
    other = oai.completions.create(
        model=model, prompt="1, 2, 3,", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert other.choices[0].text not in ("", plain)


def test_json_schema_and_json_object_response_formats(oai, model):
    person_as_json(oai, model)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)

    parsed = oai.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format=Person,
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    digits = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxItems": 3,
        "contains": {"const": 7},
    }  # the grammar cannot enforce contains: strict false relaxes it
    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Three digits."}],
        max_tokens=16,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "d", "schema": digits, "strict": False},
        },
    )
    assert isinstance(json.loads(r.choices[0].message.content), list)
    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": 'Reply {"ok": true} as JSON.'}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].message.content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_chat_logprobs_match_the_grpc_service(oai, zg, model):
    r = oai.chat.completions.create(
        model=model, messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    ref = zg.chat(HI, GREEDY, max_new_tokens=8, logprobs=Logprobs(top=3))
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert [t.logprob for t in content] == pytest.approx(
        [x.logprob for x in ref.logprobs][: len(content)], abs=1e-5
    )
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)
    assert bytes(content[0].bytes).decode() == content[0].token
    # without top_logprobs the token texts come from Detokenize
    chunks = list(
        oai.chat.completions.create(
            model=model, messages=HI, max_tokens=8, temperature=0, stream=True, logprobs=True
        )
    )
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert [t.token for t in streamed] == [t.token for t in content] and not streamed[0].top_logprobs
    c = oai.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0 and len(lp.top_logprobs[0]) == 2


@pytest.mark.parametrize(
    "kw, error, param",
    [
        (dict(model="no-such-model"), openai.NotFoundError, "model"),
        (dict(temperature=3.0), openai.BadRequestError, "temperature"),
        (dict(messages=[]), openai.BadRequestError, "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), openai.BadRequestError, "messages[0].role"),
        (dict(n=129), openai.BadRequestError, "n"),
        (dict(top_logprobs=2), openai.BadRequestError, "top_logprobs"),
        (
            dict(max_tokens=9000),
            openai.BadRequestError,
            "max_tokens",
        ),  # prompt + max_tokens beyond the context
        (dict(max_tokens=6000), openai.BadRequestError, None),  # can never fit the KV pool (4096): final
        (dict(stream=True, frequency_penalty=5.0), openai.BadRequestError, "frequency_penalty"),
        (dict(stream=True, max_tokens=9000), openai.BadRequestError, "max_tokens"),  # refused by the service
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            ),
            openai.BadRequestError,
            "response_format",
        ),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {"type": "array", "uniqueItems": True},
                    },
                }
            ),
            openai.BadRequestError,
            "response_format",
        ),
        (
            dict(extra_body={"repetition_penalty": 0}),
            openai.BadRequestError,
            "repetition_penalty",
        ),  # the service's check
    ],
)
def test_errors_have_the_openai_shape_and_status(oai, model, kw, error, param):
    args = dict(model=model, messages=HI, max_tokens=4) | kw
    with pytest.raises(error) as e:
        r = oai.chat.completions.create(**args)
        list(r) if args.get("stream") else r
    assert e.value.body["type"] and e.value.body["message"]
    assert e.value.body.get("param") == param


def test_unparseable_body_and_unknown_route(gateway):
    req = urllib.request.Request(
        gateway + "/v1/chat/completions",
        data=b"{nope",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "body"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(gateway + "/v1/nothing", timeout=10)
    assert e.value.code == 404 and "error" in json.loads(e.value.read())


def test_grpc_status_mapping():
    def status(code: grpc.StatusCode) -> int:
        return APIError.from_grpc(ZerogapError(code, "x")).status

    assert [
        status(c)
        for c in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.ALREADY_EXISTS,
        )
    ] == [503, 504, 500, 409]
    err = APIError.from_grpc(
        ZerogapError(grpc.StatusCode.OUT_OF_RANGE, "input: prompt of 9 tokens does not fit")
    )
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "input")


class _FakeStream:
    """An AsyncStream stand-in: yields its deltas (an exception item is raised), records cancel()."""

    def __init__(self, *items: Delta | Exception):
        self.items, self.cancelled = list(items), False

    async def __anext__(self) -> Delta:
        await asyncio.sleep(0)
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def queued(self) -> None:
        await asyncio.sleep(0)
        if isinstance(self.items[0], Exception):
            raise self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _StaysConnected:
    """A starlette Request stand-in whose HTTP client never goes away."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


def _delta(text: str, finish: str | None = None) -> Delta:
    return Delta("r", text, [1], finish, None, 3, 1, [], [], None, None)


def test_n_sample_stream_refused_by_any_sample_answers_an_http_error():
    """A stream of n samples answers once every sample is queued and one has its first delta: sample 1 refused (RESOURCE_EXHAUSTED: the queue took sample 0 only) is the request's
    429, not a 200 stream that then carries an error event (it waited for sample 0 alone)."""
    gw = Gateway(GatewayConfig("unused"))
    call = protocol.parse_completion({"model": "m", "prompt": "a", "n": 2, "stream": True})
    full = ZerogapError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")
    streams = [_FakeStream(_delta("a"), _delta("b", "length")), _FakeStream(full)]
    with pytest.raises(ZerogapError) as e:
        asyncio.run(gw._stream(_StaysConnected(), call, "cmpl-x", streams))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and all(s.cancelled for s in streams)

    async def events() -> list[str]:
        streams = [_FakeStream(_delta("a"), _delta("b", "length")), _FakeStream(_delta("c", "stop"))]
        response = await gw._stream(_StaysConnected(), call, "cmpl-x", streams)
        return [chunk async for chunk in response.body_iterator]

    chunks = [json.loads(e[len("data: ") :]) for e in asyncio.run(events())[:-1]]
    texts = {i: [c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)}
    assert texts == {0: ["a", "b"], 1: ["c"]}


def test_n_sample_stream_starts_before_samples_wait_for_a_slot(oai, model):
    """10 samples on 8 running slots: the stream starts with the first sample's first token; the
    last two admitted start when slots free up, after a sample ended (waiting for every sample's
    first token held the whole stream back that long)."""
    chunks = list(
        oai.completions.create(
            model=model,
            prompt="Count:",
            n=10,
            max_tokens=24,
            temperature=1.0,
            stream=True,
            extra_body=ENDLESS,
        )
    )
    order = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices]
    firsts = {i: next(k for k, (j, _) in enumerate(order) if j == i) for i in range(10)}
    assert max(firsts.values()) > order.index(next(o for o in order if o[1] == "length"))


def _aborts(server) -> int:
    return server.running.router.finished_by_reason.get("abort", 0)


def _aborted_and_freed(server, zg: Client, aborts_before: int, n: int = 1) -> None:
    """The request's n calls ended as aborted (not finished) and GetServerInfo shows the KV cache free."""
    assert wait_until(lambda: _aborts(server) == aborts_before + n, 20), "the gRPC request was not aborted"

    def freed() -> bool:
        info = zg.server_info()
        return info.kv_pool_free_tokens == info.kv_pool_total_tokens and info.running_requests == 0

    assert wait_until(freed, 20), "the KV cache was not freed"


def test_sdk_stream_close_aborts_the_request(oai, server, zg, model):
    before = _aborts(server)
    stream = oai.chat.completions.create(
        model=model, messages=HI, max_tokens=2000, stream=True, extra_body=ENDLESS
    )
    next(iter(stream))
    next(iter(stream))
    assert server.engine.num_live() == 1
    stream.close()
    _aborted_and_freed(server, zg, before)


def test_sdk_stream_close_aborts_every_sample(oai, server, zg, model):
    before = _aborts(server)
    stream = oai.chat.completions.create(
        model=model, messages=HI, max_tokens=2000, stream=True, n=3, extra_body=ENDLESS
    )
    for _ in range(4):
        next(iter(stream))
    assert server.engine.num_live() == 3
    stream.close()
    _aborted_and_freed(server, zg, before, n=3)


def test_sdk_timeout_aborts_the_request(oai, server, zg, model):
    before = _aborts(server)
    with pytest.raises(openai.APITimeoutError):
        oai.with_options(timeout=1.0).completions.create(
            model=model, prompt="Count:", max_tokens=2000, extra_body=ENDLESS
        )
    _aborted_and_freed(server, zg, before)


def test_async_sdk_task_cancel_aborts_the_request(gateway, server, zg, model):
    before = _aborts(server)

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as c:
            task = asyncio.create_task(
                c.chat.completions.create(model=model, messages=HI, max_tokens=2000, extra_body=ENDLESS)
            )
            start = time.monotonic()
            while server.engine.num_live() == 0 and time.monotonic() - start < 20:
                await asyncio.sleep(0.05)
            assert server.engine.num_live() == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    _aborted_and_freed(server, zg, before)


def test_cancel_through_the_lb_aborts_the_request(server, zg, model, tmp_path):
    """As deployed: SDK -> gateway -> nginx (deploy/nginx.conf) -> server; closing the stream aborts it."""
    from tests.stack.test_stack import _Nginx, _nginx_binary, render_nginx_conf

    binary = _nginx_binary()
    if binary is None:
        need_tools(["nginx"], "apt-get install nginx")
    port = free_port()
    lb = _Nginx(binary, render_nginx_conf([server.port], port, tmp_path), tmp_path, port)
    try:
        assert lb.wait_ready(), lb.log()
        with (
            run_gateway(f"127.0.0.1:{port}") as base,
            openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c,
        ):
            before = _aborts(server)
            stream = c.completions.create(
                model=model, prompt="Count:", max_tokens=2000, stream=True, extra_body=ENDLESS
            )
            next(iter(stream))
            next(iter(stream))
            assert server.engine.num_live() == 1
            stream.close()
            _aborted_and_freed(server, zg, before)
    finally:
        lb.stop()


# ---- request parsing, without a server -------------------------------------------------------


def test_parse_chat_and_completion_variants():
    call = protocol.parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_completion_tokens": 9,
            "stop": "x",
            "seed": 3,
            "response_format": {"type": "json_object"},
        }
    )
    assert [(m[0], m[1]) for m in call.prompt.messages] == [("system", "Be brief."), ("user", "Hi there")]
    assert (call.sampling.max_new_tokens, call.sampling.stop, call.sampling.seed) == (9, ["x"], 3)
    assert call.constraint.kind == "json_schema" and json.loads(call.constraint.value) == {"type": "object"}
    assert (
        protocol.parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        ).sampling.max_new_tokens
        is None
    )
    comp = protocol.parse_completion({"model": "m", "prompt": [[1, 2, 3]], "logprobs": 0})
    assert comp.prompt == [1, 2, 3] and comp.logprobs.top == 0 and comp.sampling.max_new_tokens == 16
    assert protocol.parse_completion(
        {"model": "m", "prompt": ["one"], "stream": True, "stream_options": {"include_usage": True}}
    ).include_usage


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", 1]}, "prompt"),
        ({"model": "m", "prompt": ["a", ""]}, "prompt"),
        ({"model": "m", "prompt": [[1, 2], []]}, "prompt"),
        ({"model": "m", "prompt": [1, 2**31]}, "prompt"),  # past int32: was a 500
        ({"model": "m", "prompt": [-1]}, "prompt"),
        ({"model": "m", "prompt": "a", "echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
        ({"model": "m", "prompt": ["a"] * 65, "n": 2}, "prompt"),  # 130 choices
        ({"model": "m", "prompt": "a", "suffix": "b"}, "suffix"),
        ({"model": "m", "prompt": "a", "echo": 1}, "echo"),
        ({"model": "m", "prompt": "a", "echo": True, "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "prompt": "a", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "a", "seed": -1}, "seed"),
        ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a"}, "model"),
        ({"model": "m", "prompt": "a", "response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_parse_completion_refusals(body, param):
    with pytest.raises(APIError) as e:
        protocol.parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


def test_samples_seeds():
    """Sample 0 keeps the request's seed; the others get distinct seeds derived from it (or none)."""
    body = {"model": "m", "prompt": "a", "n": 3, "seed": 9}
    seeds = [s.seed for s in protocol.samplings(protocol.parse_completion(body))]
    assert seeds[0] == 9 and len(set(seeds)) == 3 and all(0 <= s < 2**64 for s in seeds)
    assert seeds == [s.seed for s in protocol.samplings(protocol.parse_completion(body))]
    unseeded = protocol.parse_completion({"model": "m", "prompt": "a", "n": 2})
    assert [s.seed for s in protocol.samplings(unseeded)] == [None, None]


def test_parse_logit_bias():
    body = {"model": "m", "prompt": "a", "logit_bias": {"0": 1, "12": -5.5, str(2**31 - 1): 100}}
    assert protocol.parse_completion(body).sampling.logit_bias == {0: 1, 12: -5.5, 2**31 - 1: 100}
    assert (
        protocol.parse_completion({"model": "m", "prompt": "a", "logit_bias": {}}).sampling.logit_bias is None
    )


def test_parse_chat_refusals():
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    for body, param in [
        (
            {"model": "m", "messages": [{"role": "user", "content": [image]}]},
            "messages[0].content[0].image_url",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"one": 5}},
            "logit_bias",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 101}},
            "logit_bias",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": [1]}, "logit_bias"),
        # null bias, ids past int32 and odd spellings of an id were a 500 or silently merged
        *(
            ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": bias}, "logit_bias")
            for bias in (
                {"5": None},
                {str(2**31): 1},
                {" 12 ": 1},
                {"1_000": 1},
                {"01": 1},
                {"-1": 1},
                {"": 1},
                {"9" * 5000: 1},  # int() refuses over 4300 digits: was a 500
            )
        ),
        ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "assistant", "content": "x"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            "continue_final_message",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "no"},
            "add_generation_prompt",
        ),
    ]:
        with pytest.raises(APIError) as e:
            protocol.parse_chat(body)
        assert e.value.status == 400 and e.value.param == param
    assert protocol.openai_param("sampling.min_new_tokens", "chat") == "min_tokens"
    assert protocol.openai_param("input.token_ids", "completion") == "prompt"
