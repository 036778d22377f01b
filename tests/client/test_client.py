"""zerogap.client (sync and asyncio) against a real server, and its channel options on fakes."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent import futures

import grpc
import jsonschema
import pytest

from tests.helpers import PERSON_SCHEMA, grpc_client, kv_idle, wait_until
from zerogap.client import (
    GREEDY,
    AsyncClient,
    ChannelOptions,
    Chat,
    Client,
    Completion,
    Constraint,
    Logprobs,
    RetryPolicy,
    Sampling,
    ZerogapError,
)
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

LONG = dict(max_new_tokens=2000, ignore_eos=True)


@pytest.fixture(scope="module")
def served(smol_dir):
    with grpc_client(smol_dir, kv_cache_tokens=4096, max_running_requests=8) as (client, server):
        yield client, server


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture
def server(served):
    yield served[1]
    assert wait_until(lambda: kv_idle(served[1]), 20), "a request kept its KV cache"


def test_generate_chat_and_stream_agree_with_raw_stub(client, server):
    msgs = [{"role": "user", "content": "Name three colors."}]
    raw_request = pb2.GenerateRequest(
        chat=pb2.ChatInput(messages=[pb2.ChatMessage(**m) for m in msgs]),
        sampling=pb2.SamplingParams(max_new_tokens=24, temperature=0),
    )
    # Every call compared finds the prompt cached: a cold prompt's last row is computed among its
    # rows, a cached one's alone, and the matmuls round apart by row count (README, "Reproducibility").
    client.stub.Generate(raw_request)
    raw = client.stub.Generate(raw_request)
    r = client.chat(msgs, GREEDY, max_new_tokens=24)
    assert r.token_ids == list(raw.token_ids) and r.text == raw.text
    assert (
        r.finish_reason in ("stop", "length")
        and r.completion_tokens == len(r.token_ids)
        and r.prompt_tokens > 0
    )
    assert (
        client.generate(Chat([("user", "Name three colors.")]), max_new_tokens=24, temperature=0).text
        == raw.text
    )
    with client.stream(msgs, max_new_tokens=24, temperature=0) as s:
        deltas = list(s)
    assert len(deltas) > 1, "tokens must arrive as a stream"
    assert Completion.from_deltas(deltas).text == raw.text and deltas[-1].finish_reason == r.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_token_ids_input_and_sampling_overrides(client, server):
    ids = client.tokenize("1, 2, 3, 4,")
    r = client.generate(ids, Sampling(max_new_tokens=12, temperature=0), stop=[" 7,"])
    assert r.finish_reason == "stop" and r.matched_stop == " 7,"
    assert client.detokenize(ids) == "1, 2, 3, 4,"
    with pytest.raises(TypeError, match="max_tokens"):
        client.generate("x", max_tokens=3)


def test_json_helper_validates_against_schema(client, server):
    person = client.json("A person as JSON:", PERSON_SCHEMA, max_new_tokens=48, temperature=0)
    jsonschema.validate(person, PERSON_SCHEMA)
    r = client.generate("Pick:", constraint=Constraint.regex("(left|right)"), max_new_tokens=8, temperature=0)
    assert r.text in ("left", "right") and r.constraint_result.satisfied
    digits = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxItems": 3,
        "contains": {"const": 7},
    }
    with pytest.raises(ZerogapError) as e:
        client.generate(
            "Digits:", constraint=Constraint.json_schema(digits, mode="strict"), max_new_tokens=16
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "contains" in e.value.details()
    with client.stream(
        "Digits:", constraint=Constraint.json_schema(digits, mode="lenient"), max_new_tokens=16, temperature=0
    ) as s:
        lenient = s.collect()
    assert [x.keyword for x in lenient.constraint_result.relaxed] == ["contains"]
    with pytest.raises(ValueError):
        Constraint.json_schema(digits, mode="sloppy")


def test_logprobs_fields(client, server):
    r = client.generate(
        "The capital of France is", GREEDY, max_new_tokens=4, logprobs=Logprobs(top=3, input_from=1)
    )
    assert len(r.logprobs) == len(r.token_ids) == 4
    for tok, lp in zip(r.token_ids, r.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3 and lp.top[0].token_id == tok and lp.top[0].text
    assert r.input_logprobs_start == 1 and len(r.input_logprobs) == r.prompt_tokens - 1
    with client.stream("The capital of France is", GREEDY, max_new_tokens=4, logprobs=True) as s:
        joined = s.collect()
    assert [x.logprob for x in joined.logprobs] == pytest.approx([x.logprob for x in r.logprobs], abs=1e-4)


def test_errors_are_zerogap_errors_with_status(client, server):
    with pytest.raises(ZerogapError) as e:
        client.generate("", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input.text" in e.value.details()
    assert isinstance(e.value, grpc.RpcError)
    with pytest.raises(ZerogapError) as e:
        list(client.stream("x", max_new_tokens=2, constraint=Constraint.regex("(unclosed")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.health() == "SERVING" and client.abort("no-such-request") is False


def test_deadline_aborts_the_request(client, server):
    with pytest.raises(ZerogapError) as e:
        client.generate("Count to a thousand:", timeout=0.3, **LONG)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: kv_idle(server), 20)


def test_break_and_with_exit_cancel_the_stream(client, server):
    for d in client.stream("Count to a thousand:", **LONG):
        assert d.token_ids
        break
    assert wait_until(lambda: kv_idle(server), 20), "break did not cancel"
    with client.stream("Count to a thousand:", **LONG) as s:
        next(iter(s))
        assert server.engine.num_live() == 1
    assert wait_until(lambda: kv_idle(server), 20), "leaving the with block did not cancel"


def test_async_client_generate_stream_and_cancellation(server):
    async def main() -> None:
        async with AsyncClient(server.address) as c:
            r, info = await asyncio.gather(
                c.generate("The capital of France is", GREEDY, max_new_tokens=6), c.model_info()
            )
            assert "Paris" in r.text and info.vocab_size > 0
            async with c.stream("The capital of France is", GREEDY, max_new_tokens=6) as s:
                joined = await s.collect()
            assert joined.text == r.text and len(s.deltas) > 1
            assert (await c.json("A person as JSON:", PERSON_SCHEMA, max_new_tokens=48, temperature=0))[
                "age"
            ] >= 0
            async with c.stream("Count to a thousand:", **LONG) as s:
                async for _ in s:
                    break
            await _until_idle(c)
            task = asyncio.create_task(c.generate("Count to a thousand:", **LONG))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _until_idle(c)
            with pytest.raises(ZerogapError) as e:
                await c.generate("Count to a thousand:", timeout=0.2, **LONG)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await _until_idle(c)

    asyncio.run(main())


def test_async_stream_queued_comes_before_a_slot(server):
    """AsyncStream.queued() returns once the server queued the request (the initial metadata's
    mark), not at its first token, which waits for one of the 8 running slots; a refusal raises."""

    async def main() -> None:
        async with AsyncClient(server.address) as c:
            running = [c.stream("Count to a thousand:", **LONG) for _ in range(8)]
            for s in running:
                await anext(s)
            waiting = c.stream("Count to a thousand:", **LONG)
            await asyncio.wait_for(waiting.queued(), 10)
            info = await c.server_info()
            assert info.running_requests == 8 and info.queued_requests == 1 and not waiting.deltas
            refused = c.stream("Count to a thousand:", temperature=-1.0)
            with pytest.raises(ZerogapError) as e:
                await refused.queued()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for s in running:
                s.cancel()
            assert (await asyncio.wait_for(anext(waiting), 30)).token_ids  # its slot came
            waiting.cancel()
            await _until_idle(c)

    asyncio.run(main())


async def _until_idle(c: AsyncClient) -> None:
    for _ in range(400):
        info = await c.server_info()
        if (
            info.kv_pool_free_tokens == info.kv_pool_total_tokens
            and info.running_requests == info.queued_requests == 0
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the request kept its KV cache")


# ---- channel options, on a fake server -------------------------------------------------------


class FlakyServicer(pb2_grpc.GenerationServicer):
    """Fails the first `failures` Generate calls with UNAVAILABLE, then echoes the text."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.calls += 1
            fail = self.calls <= self.failures
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return pb2.GenerateResponse(text=request.text, finish_reason=pb2.FINISH_REASON_STOP)


@pytest.fixture
def fake():
    servicer = FlakyServicer(failures=2)
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb2_grpc.add_GenerationServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(None)


def test_unavailable_is_retried_with_backoff(fake):
    servicer, addr = fake
    fast = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)
    with Client(addr, ChannelOptions(retry=fast)) as c:
        assert c.generate("echo").text == "echo"
    assert servicer.calls == 3


def test_no_retry_policy_fails_fast(fake):
    servicer, addr = fake
    with Client(addr, ChannelOptions(retry=None)) as c:
        with pytest.raises(ZerogapError) as e:
            c.generate("echo")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 1


def test_max_message_size_and_channel_arguments(fake):
    _, addr = fake
    opts = ChannelOptions(max_message_bytes=1024, keepalive_time_s=20, retry=None)
    args = dict(opts.grpc_options())
    assert args["grpc.keepalive_time_ms"] == 20000 and args["grpc.max_send_message_length"] == 1024
    assert args["grpc.enable_retries"] == 0 and "grpc.service_config" not in args
    config = json.loads(dict(ChannelOptions().grpc_options())["grpc.service_config"])
    assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    with Client(addr, opts) as c:
        with pytest.raises(ZerogapError) as e:
            c.generate("x" * 4096)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=9)
