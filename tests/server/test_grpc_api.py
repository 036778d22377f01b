"""The gRPC contract on a real server (loopback, ephemeral port)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.config import ServerArgs
from service.server import BackgroundServer, GenerationServicer
from tests.helpers import before_each_forward, grpc_stub, kv_idle, model_variant, on_each_result, wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc


@pytest.fixture(scope="module")
def server(smol_dir):
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            loop="overlap",
            model=str(smol_dir),
            port=0,
            kv_cache_tokens=4096,
            max_running_requests=16,
        )
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield pb2_grpc.GenerationStub(channel)
    channel.close()


def greedy(n: int = 16, **kw) -> pb2.SamplingParams:
    return pb2.SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def test_stream_concatenates_to_unary(stub):
    req = pb2.GenerateRequest(
        chat=pb2.ChatInput(messages=[pb2.ChatMessage(role="user", content="Tell me a story.")]),
        sampling=greedy(40),
    )
    whole = stub.Generate(req)
    parts = list(stub.GenerateStream(req))
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
    assert "".join(p.text for p in parts) == whole.text
    assert parts[-1].finish_reason == whole.finish_reason != pb2.FINISH_REASON_UNSPECIFIED
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens == len(whole.token_ids)
    assert whole.usage.prompt_tokens > 0 and whole.request_id


def test_text_input_and_request_id(stub):
    r = stub.Generate(
        pb2.GenerateRequest(request_id="mine-1", text="The capital of France is", sampling=greedy(8))
    )
    assert r.request_id == "mine-1"
    assert "Paris" in r.text
    assert r.finish_reason == pb2.FINISH_REASON_LENGTH


def test_stop_string_is_trimmed_and_reported(stub):
    base = stub.Generate(pb2.GenerateRequest(text="1, 2, 3, 4,", sampling=greedy(12)))
    assert " 7," in base.text
    r = stub.Generate(pb2.GenerateRequest(text="1, 2, 3, 4,", sampling=greedy(12, stop=[" 7,"])))
    assert r.finish_reason == pb2.FINISH_REASON_STOP
    assert r.matched_stop_str == " 7,"
    assert r.text == base.text[: base.text.index(" 7,")]
    parts = list(
        stub.GenerateStream(pb2.GenerateRequest(text="1, 2, 3, 4,", sampling=greedy(12, stop=[" 7,"])))
    )
    assert "".join(p.text for p in parts) == r.text


def test_stop_token_id(stub):
    base = stub.Generate(pb2.GenerateRequest(text="1, 2, 3, 4,", sampling=greedy(12)))
    stop_tok = base.token_ids[3]
    r = stub.Generate(pb2.GenerateRequest(text="1, 2, 3, 4,", sampling=greedy(12, stop_token_ids=[stop_tok])))
    assert r.finish_reason == pb2.FINISH_REASON_STOP and r.matched_stop_token_id == stop_tok
    assert list(r.token_ids) == list(base.token_ids[: list(base.token_ids).index(stop_tok) + 1])


def test_chat_continues_the_final_assistant_message(stub, hf_tokenizer):
    """continue_final_message leaves the last (assistant) message open, as transformers renders it;
    add_generation_prompt then defaults to false; the answer continues that text."""
    turns = [("user", "Write a JSON object with a name."), ("assistant", '{"name": "')]
    messages = [pb2.ChatMessage(role=r, content=c) for r, c in turns]
    t = stub.Tokenize(pb2.TokenizeRequest(chat=pb2.ChatInput(messages=messages, continue_final_message=True)))
    want = hf_tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in turns], continue_final_message=True, tokenize=False
    )
    assert t.text == want and t.text.endswith('{"name": "')
    r = stub.Generate(
        pb2.GenerateRequest(
            chat=pb2.ChatInput(messages=messages, continue_final_message=True), sampling=greedy(8)
        )
    )
    assert r.usage.prompt_tokens == len(t.token_ids)
    for chat in (
        pb2.ChatInput(messages=messages[:1], continue_final_message=True),  # the last is the user's
        pb2.ChatInput(messages=messages, continue_final_message=True, add_generation_prompt=True),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb2.GenerateRequest(chat=chat, sampling=greedy(2)))
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "continue_final_message" in e.value.details()
        )


STRICT_TEMPLATE = (  # as Gemma's and Mistral's templates refuse what they cannot render
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_that_refuses_the_messages_is_an_invalid_argument(smol_dir, tmp_path):
    """The defect: a chat template's own refusal (jinja's raise_exception) ended the RPC as UNKNOWN;
    it is the request's fault, said with the template's words, and the server goes on serving."""
    model = model_variant(smol_dir, tmp_path / "strict-template", **{"chat_template.jinja": STRICT_TEMPLATE})
    srv = BackgroundServer(ServerArgs(dtype="float32", model=str(model), port=0, kv_cache_tokens=1024))
    channel = grpc.insecure_channel(srv.address)
    try:
        stub = pb2_grpc.GenerationStub(channel)
        refused = pb2.ChatInput(
            messages=[
                pb2.ChatMessage(role="system", content="Be brief."),
                pb2.ChatMessage(role="user", content="Hi"),
            ]
        )
        calls = (
            lambda: stub.Generate(pb2.GenerateRequest(chat=refused, sampling=greedy(2))),
            lambda: list(stub.GenerateStream(pb2.GenerateRequest(chat=refused, sampling=greedy(2)))),
            lambda: stub.Tokenize(pb2.TokenizeRequest(chat=refused)),
        )
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "System role not supported" in e.value.details()
        ok = pb2.ChatInput(messages=refused.messages[1:])
        assert stub.Tokenize(pb2.TokenizeRequest(chat=ok)).text == "<user>Hi<assistant>"
        assert stub.Generate(pb2.GenerateRequest(chat=ok, sampling=greedy(2))).usage.completion_tokens == 2
    finally:
        channel.close()
        srv.stop()


def test_generation_config_sets_end_of_turn_ids_and_sampling_defaults(smol_dir, tmp_path, stub):
    """The defects: generation_config.json was not read, so an instruct model whose end-of-turn token
    is listed only there (Llama 3's <|eot_id|>, Gemma's <end_of_turn>) ran past it to max tokens,
    and its sampling values (Qwen's temperature 0.7, top_k 20, ...) were not the defaults, as they
    are in vLLM and SGLang. A field the request sets still wins; --sampling-defaults none ignores them."""
    import json

    prompt = "1, 2, 3, 4,"
    base = stub.Generate(pb2.GenerateRequest(text=prompt, sampling=greedy(12)))
    end_of_turn = base.token_ids[4]  # as if the model's end-of-turn token came fifth
    generation = {"eos_token_id": [2, end_of_turn], "top_k": 1, "max_new_tokens": 9}
    model = model_variant(smol_dir, tmp_path / "m", **{"generation_config.json": json.dumps(generation)})
    with grpc_stub(model, kv_cache_tokens=1024, context_length=32) as s:
        assert end_of_turn in s.GetModelInfo(pb2.GetModelInfoRequest()).eos_token_ids
        long = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # 30 tokens: the model's 9 new ones are capped to 2
        r = s.Generate(pb2.GenerateRequest(text=long, sampling=pb2.SamplingParams(ignore_eos=True)))
        assert len(r.token_ids) == 2 and r.finish_reason == pb2.FINISH_REASON_LENGTH
        r = s.Generate(pb2.GenerateRequest(text=prompt, sampling=greedy(12)))
        assert list(r.token_ids) == list(base.token_ids[:5]) and r.finish_reason == pb2.FINISH_REASON_STOP
        r = s.Generate(pb2.GenerateRequest(text=prompt, sampling=pb2.SamplingParams(seed=7, ignore_eos=True)))
        assert list(r.token_ids) == list(base.token_ids[:9])  # top_k 1: greedy; 9 tokens
        open_ended = [
            pb2.GenerateRequest(
                text="My favourite", sampling=pb2.SamplingParams(seed=k, top_k=top_k, ignore_eos=True)
            )
            for k in range(4)
            for top_k in (0, -1)  # unset: the model's 1; -1: all (the request's wins)
        ]
        got = [tuple(s.Generate(r).token_ids) for r in open_ended]
        assert len(set(got[0::2])) == 1 and len(set(got[1::2])) > 1
    with grpc_stub(model, kv_cache_tokens=1024, sampling_defaults="none") as s:
        unset = [
            pb2.GenerateRequest(text="My favourite", sampling=pb2.SamplingParams(seed=k, max_new_tokens=6))
            for k in range(4)
        ]
        assert len({tuple(s.Generate(r).token_ids) for r in unset}) > 1  # no top_k 1: sampled


def test_tokenize_detokenize_and_infos(stub, hf_tokenizer):
    t = stub.Tokenize(pb2.TokenizeRequest(text="Hello world"))
    assert list(t.token_ids) == hf_tokenizer.encode("Hello world")
    d = stub.Detokenize(pb2.DetokenizeRequest(token_ids=t.token_ids))
    assert d.text == "Hello world"
    chat = stub.Tokenize(
        pb2.TokenizeRequest(chat=pb2.ChatInput(messages=[pb2.ChatMessage(role="user", content="hi")]))
    )
    assert chat.text.endswith("<|im_start|>assistant\n")
    info = stub.GetModelInfo(pb2.GetModelInfoRequest())
    assert info.vocab_size == 49152 and info.context_length == 8192 and info.has_chat_template
    assert info.architecture == "LlamaForCausalLM" and 2 in info.eos_token_ids and info.dtype == "float32"
    s = stub.GetServerInfo(pb2.GetServerInfoRequest())
    assert s.scheduler_mode == "overlap" and s.kv_pool_total_tokens == 4096 and s.max_running_requests == 16


@pytest.mark.parametrize(
    "request_kw, field",
    [
        (dict(), "input"),
        (dict(text=""), "input.text"),
        (dict(token_ids=pb2.TokenIds(ids=[])), "input.token_ids"),
        (dict(token_ids=pb2.TokenIds(ids=[1, 49152])), "input.token_ids"),
        (dict(token_ids=pb2.TokenIds(ids=[1, -3])), "input.token_ids"),
        (dict(chat=pb2.ChatInput(messages=[pb2.ChatMessage(role="wizard", content="x")])), "role"),
        (dict(text="hi", sampling=pb2.SamplingParams(temperature=float("nan"))), "sampling.temperature"),
        (dict(text="hi", sampling=pb2.SamplingParams(temperature=-1)), "sampling.temperature"),
        (dict(text="hi", sampling=pb2.SamplingParams(top_p=0)), "sampling.top_p"),
        (dict(text="hi", sampling=pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
        (dict(text="hi", sampling=pb2.SamplingParams(top_k=-2)), "sampling.top_k"),
        (dict(text="hi", sampling=pb2.SamplingParams(min_p=2)), "sampling.min_p"),
        (dict(text="hi", sampling=pb2.SamplingParams(repetition_penalty=0)), "sampling.repetition_penalty"),
        (dict(text="hi", sampling=pb2.SamplingParams(frequency_penalty=3)), "sampling.frequency_penalty"),
        (
            dict(text="hi", sampling=pb2.SamplingParams(presence_penalty=float("inf"))),
            "sampling.presence_penalty",
        ),
        (dict(text="hi", sampling=pb2.SamplingParams(max_new_tokens=0)), "sampling.max_new_tokens"),
        (
            dict(text="hi", sampling=pb2.SamplingParams(max_new_tokens=4, min_new_tokens=8)),
            "sampling.min_new_tokens",
        ),
        (dict(text="hi", sampling=pb2.SamplingParams(stop_token_ids=[99999])), "sampling.stop_token_ids"),
        (dict(text="hi", sampling=pb2.SamplingParams(stop=[""])), "sampling.stop"),
        (dict(text="hi", sampling=pb2.SamplingParams(logit_bias={49152: 1.0})), "sampling.logit_bias"),
        (dict(text="hi", sampling=pb2.SamplingParams(logit_bias={5: 101.0})), "sampling.logit_bias"),
        (dict(text="hi", sampling=pb2.SamplingParams(logit_bias={5: float("nan")})), "sampling.logit_bias"),
        (
            dict(text="hi", sampling=pb2.SamplingParams(logit_bias={t: 1.0 for t in range(1025)})),
            "sampling.logit_bias",
        ),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(stub, request_kw, field):
    for call in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as e:
            call(pb2.GenerateRequest(**request_kw))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in e.value.details()


def test_context_and_pool_limits(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb2.GenerateRequest(text="hi", sampling=pb2.SamplingParams(max_new_tokens=9000)))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and "context length" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # fits the context (8192) but never the pool (4096): final
        stub.Generate(pb2.GenerateRequest(text="hi", sampling=pb2.SamplingParams(max_new_tokens=5000)))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and "pool holds 4096" in e.value.details()


def test_cancelled_stream_frees_kv(stub, server):
    call = stub.GenerateStream(
        pb2.GenerateRequest(text="Write a long essay.", sampling=greedy(2000, ignore_eos=True))
    )
    it = iter(call)
    next(it), next(it)
    assert server.engine.kv_pool.free_count < server.engine.kv_pool.size
    call.cancel()
    assert wait_until(lambda: kv_idle(server), 20)


def test_stream_ended_between_submit_and_first_message_aborts_it(stub, server, monkeypatch):
    """A stream cancelled (here: its deadline) after the request was submitted but before the
    handler's first await returned left the request running for nobody: that await (sending the
    initial metadata) was outside the handler's abort-on-exit. The event loop is held right after
    the submit, so the deadline fires there."""
    submit = GenerationServicer._start

    async def held(self, request, context):
        started = await submit(self, request, context)
        time.sleep(0.6)  # blocks the event loop: the RPC's deadline passes meanwhile
        return started

    monkeypatch.setattr(GenerationServicer, "_start", held)
    call = stub.GenerateStream(
        pb2.GenerateRequest(text="Count to a million.", sampling=greedy(3000, ignore_eos=True)), timeout=0.3
    )
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: kv_idle(server), 10), "the request outlived its RPC"


def test_deadline_aborts_request(stub, server):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(
            pb2.GenerateRequest(text="Count to a million.", sampling=greedy(3000, ignore_eos=True)),
            timeout=0.5,
        )
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: kv_idle(server), 20)


def test_abort_rpc(stub, server):
    call = stub.GenerateStream(
        pb2.GenerateRequest(
            request_id="to-abort", text="Go on forever.", sampling=greedy(3000, ignore_eos=True)
        )
    )
    it = iter(call)
    next(it)
    assert stub.Abort(pb2.AbortRequest(request_id="to-abort")).found
    last = list(it)[-1]
    assert last.finish_reason == pb2.FINISH_REASON_ABORT
    assert not stub.Abort(pb2.AbortRequest(request_id="to-abort")).found
    assert wait_until(lambda: kv_idle(server), 20)


def test_fault_in_one_request_fails_only_that_one(stub, server):
    def hook(req):
        if req.rid == "boom" and len(req.output_ids) == 2:
            raise RuntimeError("injected fault")

    with on_each_result(server.engine.scheduler, hook):
        good = stub.Generate.future(pb2.GenerateRequest(text="The capital of France is", sampling=greedy(12)))
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(
                pb2.GenerateRequest(request_id="boom", text="The capital of France is", sampling=greedy(12))
            )
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in e.value.details()
        assert "Paris" in good.result().text
    assert (
        "Paris"
        in stub.Generate(pb2.GenerateRequest(text="The capital of France is", sampling=greedy(8))).text
    )
    assert wait_until(lambda: kv_idle(server), 20)


def test_forward_fault_fails_batch_and_server_recovers(stub, server):
    def boom(fb):
        raise RuntimeError("injected forward fault")

    with before_each_forward(server.engine.worker, boom):
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb2.GenerateRequest(text="hello", sampling=greedy(8)))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected forward fault" in e.value.details()
    assert stub.Generate(pb2.GenerateRequest(text="The capital of France is", sampling=greedy(8))).text
    assert wait_until(lambda: kv_idle(server), 20)


def test_duplicate_live_request_id(stub):
    call = stub.GenerateStream(
        pb2.GenerateRequest(request_id="dup", text="Talk.", sampling=greedy(500, ignore_eos=True))
    )
    it = iter(call)
    next(it)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb2.GenerateRequest(request_id="dup", text="x", sampling=greedy(2)))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # Regression: the refused duplicate must not steal the original's output queue.
    assert stub.Abort(pb2.AbortRequest(request_id="dup")).found
    assert list(it)[-1].finish_reason == pb2.FINISH_REASON_ABORT


def test_full_uint64_seed_range_and_tiny_temperature(stub):
    """Regression: a seed >= 2^63 used to break batch formation for every live request."""
    big = pb2.GenerateRequest(
        text="Once upon a time",
        sampling=pb2.SamplingParams(max_new_tokens=8, temperature=0.9, seed=2**64 - 1),
    )
    assert stub.Generate(big).token_ids == stub.Generate(big).token_ids
    tiny = stub.Generate(
        pb2.GenerateRequest(
            text="Once upon a time", sampling=pb2.SamplingParams(max_new_tokens=8, temperature=1e-30)
        )
    )
    zero = stub.Generate(pb2.GenerateRequest(text="Once upon a time", sampling=greedy(8)))
    assert tiny.token_ids == zero.token_ids


def test_health_and_reflection(server):
    channel = grpc.insecure_channel(server.address)
    h = health_pb2_grpc.HealthStub(channel)
    for name in ("", "zerogap.v1.Generation"):
        assert (
            h.Check(health_pb2.HealthCheckRequest(service=name)).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    r = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"zerogap.v1.Generation", "grpc.health.v1.Health"} <= names
    channel.close()
