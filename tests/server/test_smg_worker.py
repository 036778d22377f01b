"""The SMG worker contract (vLLM's `vllm.grpc.engine.VllmEngine`, service/smg_worker.py) over gRPC,
next to zerogap.v1 on the same server: what the gateway calls, field by field, without the gateway."""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import time
import zipfile

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from service.config import ServerArgs
from service.core.request import RequestError, SamplingParams
from service.server import BackgroundServer
from service.smg_worker import (
    RateMeter,
    SmgWorkerServicer,
    _defaults_json,
    _final,
    constraint_from_vllm,
    sampling_from_vllm,
)
from tests.helpers import wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

PROMPT = [1, 450, 4996, 338, 263, 1243, 310, 278, 3186, 29889, 739, 338]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = BackgroundServer(
        ServerArgs(
            model=str(tiny_llama_dir), port=0, dtype="float32", kv_cache_tokens=4096, max_running_requests=8
        )
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stubs(server):
    with grpc.insecure_channel(server.address) as ch:
        yield vllm_engine_pb2_grpc.VllmEngineStub(ch), pb2_grpc.GenerationStub(ch)


def sampling(**kw) -> vpb.SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 8)
    return vpb.SamplingParams(**kw)


def generate(stub, ids=PROMPT, stream=False, rid="", **kw) -> list[vpb.GenerateResponse]:
    req = vpb.GenerateRequest(
        request_id=rid,
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=sampling(**kw),
        stream=stream,
    )
    return list(stub.Generate(req, timeout=60))


def test_health_model_and_server_info(server, stubs, tiny_llama_dir):
    vllm, _ = stubs
    assert vllm.HealthCheck(vpb.HealthCheckRequest()).healthy
    info = vllm.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.model_path == info.tokenizer_path == str(tiny_llama_dir)
    assert info.served_model_name == tiny_llama_dir.name and info.is_generation
    assert info.max_context_length == 512 and info.vocab_size == 49152
    assert 2 in info.eos_token_ids and info.architectures == ["LlamaForCausalLM"]
    s = vllm.GetServerInfo(vpb.GetServerInfoRequest())
    assert s.block_size == 16 and s.max_num_seqs == 8 and s.data_parallel_size == 1
    assert s.server_type.startswith("zerogap")
    assert s.constrained_decoding_start == "first_token"  # SMG shapes forced tool-call grammars by it


def test_generate_equals_zerogap_v1_streamed_or_not(stubs):
    """Greedy token ids equal zerogap.v1's; the stream's deltas add up to the unary complete."""
    vllm, zg = stubs
    ref = zg.Generate(
        pb2.GenerateRequest(
            token_ids=pb2.TokenIds(ids=PROMPT), sampling=pb2.SamplingParams(temperature=0, max_new_tokens=8)
        )
    )
    (one,) = generate(vllm)
    assert one.WhichOneof("response") == "complete"
    c = one.complete
    assert list(c.output_ids) == list(ref.token_ids) and c.finish_reason == "length"
    assert (c.prompt_tokens, c.completion_tokens) == (len(PROMPT), 8)
    streamed = generate(vllm, stream=True)
    assert [r.WhichOneof("response") for r in streamed][-1] == "complete"
    chunks = [r.chunk for r in streamed[:-1]]
    assert [t for ch in chunks for t in ch.token_ids] == list(ref.token_ids)
    assert sum(ch.completion_tokens for ch in chunks) == 8  # deltas
    assert chunks[0].cached_tokens > 0  # the same prompt again: the prefix cache served it


def test_seed_stop_and_sampling_fields(stubs):
    vllm, _ = stubs
    a = generate(vllm, temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=12)[0].complete
    b = generate(vllm, temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=12)[0].complete
    c = generate(vllm, temperature=1.0, top_k=50, top_p=0.9, seed=-8, max_tokens=12)[0].complete
    assert list(a.output_ids) == list(b.output_ids) != list(c.output_ids)
    greedy = list(generate(vllm, max_tokens=8)[0].complete.output_ids)
    stopped = generate(vllm, max_tokens=8, stop_token_ids=[greedy[3]])[0].complete
    assert list(stopped.output_ids) == greedy[:4] and stopped.finish_reason == "stop"
    assert stopped.matched_token_id == greedy[3]
    assert len(generate(vllm, max_tokens=12, min_tokens=12, ignore_eos=True)[0].complete.output_ids) == 12
    biased = generate(vllm, max_tokens=4, ignore_eos=True, logit_bias={777: 100.0})[0].complete
    assert list(biased.output_ids) == [777] * 4


def test_the_gateway_is_told_the_models_sampling_defaults():
    """A model's generation_config.json sampling values go to the gateway (GetModelInfo's
    default_sampling_params_json, as vLLM's worker publishes them), which fills a request's unset fields
    with them; the worker reads the fields as vLLM's does, so a client can still turn top_k off (0)."""
    model = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05)
    assert json.loads(_defaults_json(model)) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    assert _defaults_json(SamplingParams()) == ""
    unset = sampling_from_vllm(vpb.SamplingParams())
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_new_tokens) == (1.0, 1.0, -1, None)
    given = sampling_from_vllm(vpb.SamplingParams(temperature=0.0, top_p=0.5, top_k=5, max_tokens=3))
    assert (given.temperature, given.top_p, given.top_k, given.max_new_tokens) == (0.0, 0.5, 5, 3)


def test_max_tokens_unset_runs_to_the_end_of_the_context(stubs):
    """As vLLM's worker and the OpenAI API: no max_tokens, no cut at a default length (SMG sends none
    when the client sets none)."""
    vllm, _ = stubs
    req = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=vpb.SamplingParams(temperature=0.0, ignore_eos=True),
    )
    (one,) = list(vllm.Generate(req, timeout=120))
    info = vllm.GetModelInfo(vpb.GetModelInfoRequest())
    assert one.complete.finish_reason == "length"
    assert one.complete.completion_tokens == info.max_context_length - len(PROMPT)


def test_the_models_eos_is_no_matched_stop_but_a_listed_stop_token_is(stubs):
    vllm, _ = stubs
    eos = generate(vllm, logit_bias={2: 100.0})[0].complete  # the model's EOS (id 2) at once
    assert eos.finish_reason == "stop" and list(eos.output_ids) == [2]
    assert eos.WhichOneof("matched_stop") is None  # vLLM's: the gateway shows matched_stop null
    listed = generate(vllm, logit_bias={2: 100.0}, stop_token_ids=[2])[0].complete
    assert listed.finish_reason == "stop" and listed.matched_token_id == 2


def test_refusals_the_gateway_would_retry_in_vain_are_final():
    """The gateway retries DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED five times: a grammar whose own
    compile reached a limit answers INVALID_ARGUMENT (the same schema fails the same way); one that
    waited too long for a worker, and a full queue, keep theirs (worth a retry)."""
    from features.grammar_backend import GrammarError

    for code in ("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"):
        assert (
            _final(GrammarError(code, "json_schema", "over the limit", heavy=True)).code == "INVALID_ARGUMENT"
        )
        waited = GrammarError(code, "json_schema", "no worker was free in time")  # the load's fault
        assert _final(waited) is waited
    assert (
        _final(RequestError("RESOURCE_EXHAUSTED", "the request queue is full")).code == "RESOURCE_EXHAUSTED"
    )
    # a timeout is heavy when the compile itself ran for at least half of it, not the wait for a worker
    from types import SimpleNamespace

    from features.grammar_backend import GrammarBackend

    backend = SimpleNamespace(limits=SimpleNamespace(compile_timeout_s=10.0))
    for ran, heavy in ((6.0, True), (1.0, False), (None, False)):
        job = SimpleNamespace(kind="regex", started=None if ran is None else time.monotonic() - ran)
        assert GrammarBackend._timeout_error(backend, job).heavy is heavy, ran


def test_a_choice_outside_the_basic_plane_stays_a_literal_the_grammar_can_match():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    spec = constraint_from_vllm(vpb.SamplingParams(choice=vpb.ChoiceConstraint(choices=["😀 yes", "no"])))
    assert "\\u" not in spec.text and "😀 yes" in spec.text
    grammar = xgr.Grammar.from_ebnf(spec.text)
    assert _is_grammar_accept_string(grammar, "😀 yes") and _is_grammar_accept_string(grammar, "no")


def test_refusals_name_the_fields_as_this_contract_does(stubs):
    """max_tokens, not zerogap.v1's max_new_tokens: what the client sent, through the gateway."""
    error = refused(stubs[0], {"sampling_params": sampling(max_tokens=600)})  # 12 + 600 > 512
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert error.details().startswith("sampling_params.max_tokens: prompt (12) + max_tokens (600)")
    error = refused(stubs[0], {"sampling_params": sampling(top_p=2.0, temperature=1.0)})
    assert error.details().startswith("sampling_params.top_p:"), error.details()


def test_truncate_prompt_tokens_minus_one_keeps_what_fits_the_context(stubs):
    vllm, _ = stubs
    long = PROMPT * 60  # 720 tokens, over the context (512)
    kept = generate(vllm, ids=long, truncate_prompt_tokens=-1, max_tokens=1)[0].complete
    assert kept.prompt_tokens == 511
    text = "The quick brown fox jumps over the lazy dog. " * 400  # ~4,000 tokens: far over the context
    for keep, expected in ((-1, 511), (20, 20)):
        req = vpb.GenerateRequest(
            text=text, sampling_params=sampling(truncate_prompt_tokens=keep, max_tokens=1)
        )
        assert list(vllm.Generate(req, timeout=60))[-1].complete.prompt_tokens == expected
    assert refused(vllm, {"sampling_params": sampling(truncate_prompt_tokens=-2)}).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_a_models_generation_config_reaches_the_gateway_and_a_faulted_engine_is_unhealthy(
    tiny_llama_dir, tmp_path
):
    """A model whose generation_config.json sets sampling values and max_new_tokens: GetModelInfo
    publishes the sampling values, and a request without max_tokens takes its max_new_tokens (as
    vLLM's worker). Then a failure the scheduler could not recover from: the worker contract's
    HealthCheck says so (the gateway stops routing to it) and grpc.health.v1 turns NOT_SERVING (a
    liveness probe restarts it)."""
    import shutil

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    model = tmp_path / "tiny"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.5, top_k=7, max_new_tokens=5)
    (model / "generation_config.json").write_text(json.dumps(config))
    srv = BackgroundServer(ServerArgs(model=str(model), port=0, dtype="float32", kv_cache_tokens=1024))
    try:
        with grpc.insecure_channel(srv.address) as ch:
            vllm, probe = vllm_engine_pb2_grpc.VllmEngineStub(ch), health_pb2_grpc.HealthStub(ch)
            info = vllm.GetModelInfo(vpb.GetModelInfoRequest())
            assert json.loads(info.default_sampling_params_json) == {"temperature": 0.5, "top_k": 7}
            req = vpb.GenerateRequest(
                tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                sampling_params=vpb.SamplingParams(temperature=0.0, ignore_eos=True),
            )
            assert list(vllm.Generate(req, timeout=60))[-1].complete.completion_tokens == 5

            assert vllm.HealthCheck(vpb.HealthCheckRequest()).healthy
            srv.running.engine.scheduler.broken = "recovery failed after: RuntimeError('boom')"
            answer = vllm.HealthCheck(vpb.HealthCheckRequest())
            assert not answer.healthy and "boom" in answer.message

            def not_serving() -> bool:
                status = probe.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                return status == health_pb2.HealthCheckResponse.NOT_SERVING

            assert wait_until(not_serving, 10, 0.1)
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "constraint, check",
    [
        (
            {
                "json_schema": json.dumps(
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
                )
            },
            lambda t: isinstance(json.loads(t)["a"], int),
        ),
        ({"regex": "[0-9]{3}-[a-c]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t)),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"choice": vpb.ChoiceConstraint(choices=["red", "green"])}, lambda t: t in ("red", "green")),
        ({"json_object": True}, lambda t: t.startswith("{")),  # random weights: an object without end
    ],
    ids=["json_schema", "regex", "grammar", "choice", "json_object"],
)
def test_constraints(stubs, server, constraint, check):
    vllm, _ = stubs
    c = generate(vllm, max_tokens=40, **constraint)[0].complete
    text = server.engine.tokenizer.decode(list(c.output_ids), True)
    assert (c.finish_reason == "stop" or "json_object" in constraint) and check(text), text


def test_logprobs_output_and_prompt(stubs):
    vllm, _ = stubs
    c = generate(vllm, max_tokens=5, logprobs=3, prompt_logprobs=1)[0].complete
    lp = c.output_logprobs
    assert list(lp.token_ids) == list(c.output_ids) and len(lp.token_logprobs) == 5
    assert all(
        len(t.token_ids) == 3 and t.token_ids[0] == tok for t, tok in zip(lp.top_logprobs, c.output_ids)
    )
    ilp = c.input_logprobs
    assert list(ilp.token_ids) == PROMPT and len(ilp.token_logprobs) == len(PROMPT)
    assert not ilp.token_logprobs[0].HasField("value") and all(
        v.HasField("value") for v in ilp.token_logprobs[1:]
    )
    assert all(len(t.values) == 1 for t in ilp.top_logprobs[1:])
    streamed = generate(vllm, stream=True, max_tokens=5, logprobs=0)
    rows = [v for r in streamed[:-1] for v in r.chunk.output_logprobs.token_logprobs]
    assert rows == pytest.approx(list(lp.token_logprobs), abs=1e-4)


@pytest.mark.parametrize(
    "fields, code",
    [
        ({"sampling_params": sampling(n=129)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"sampling_params": sampling(logit_bias={5: 200.0})}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"kv_transfer_params_json": "{}"}, grpc.StatusCode.FAILED_PRECONDITION),
        ({"data_parallel_rank": 1}, grpc.StatusCode.FAILED_PRECONDITION),
        ({"mm_inputs": vpb.MultimodalInputs(mm_hashes=["x"])}, grpc.StatusCode.FAILED_PRECONDITION),
        ({"sampling_params": sampling(logprobs=-1)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"sampling_params": sampling(max_tokens=600)}, grpc.StatusCode.OUT_OF_RANGE),
        ({"tokenized": vpb.TokenizedInput(input_ids=[10**6])}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"sampling_params": sampling(regex="(")}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=[
        "n_over_cap",
        "logit_bias_range",
        "pd",
        "dp_rank",
        "images",
        "all_logprobs",
        "too_long",
        "bad_token",
        "bad_regex",
    ],
)
def test_what_it_cannot_honour_gets_a_clear_status(stubs, fields, code):
    error = refused(stubs[0], fields)
    assert error.code() == code, error.details()


def refused(vllm, fields: dict) -> grpc.RpcError:
    """The error a Generate with `fields` (PROMPT and greedy sampling unless given) fails with."""
    fields.setdefault("tokenized", vpb.TokenizedInput(input_ids=PROMPT))
    fields.setdefault("sampling_params", sampling())
    with pytest.raises(grpc.RpcError) as e:
        list(vllm.Generate(vpb.GenerateRequest(**fields), timeout=30))
    return e.value


@pytest.mark.parametrize(
    "fields, named",
    [
        (
            {"sampling_params": sampling(stop=[f"s{i}" for i in range(17)])},
            "sampling_params.stop: 17 strings",
        ),
        ({"sampling_params": sampling(stop=["x" * 257])}, "sampling_params.stop: a string of 257 bytes"),
        (
            {"sampling_params": sampling(stop_token_ids=list(range(65)))},
            "sampling_params.stop_token_ids: 65 ids",
        ),
        ({"request_id": "r" * 257}, "request_id: 257 bytes"),
    ],
    ids=["stop_strings", "stop_string_bytes", "stop_token_ids", "request_id"],
)
def test_zerogap_v1_input_bounds_hold_here_too(stubs, fields, named):
    """A client could send thousands of long stop strings here, checked against every token."""
    error = refused(stubs[0], fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and named in error.details(), error.details()


ODD_SAMPLING = {  # values a careless or hostile client sends: each gets OK or a clean status
    "temperature_nan": {"temperature": float("nan")},
    "temperature_inf": {"temperature": float("inf")},
    "temperature_huge": {"temperature": 1e30},
    "top_p_nan": {"top_p": float("nan"), "temperature": 1.0},
    "top_p_over": {"top_p": 2.0, "temperature": 1.0},
    "top_k_max": {"top_k": 2**32 - 1, "temperature": 1.0},
    "min_p_over": {"min_p": 2.0, "temperature": 1.0},
    "repetition_negative": {"repetition_penalty": -1.0},
    "presence_nan": {"presence_penalty": float("nan")},
    "frequency_inf": {"frequency_penalty": float("inf")},
    "max_tokens_zero": {"max_tokens": 0},
    "max_tokens_max": {"max_tokens": 2**32 - 1},
    "min_over_max": {"min_tokens": 10, "max_tokens": 4},
    "stop_empty": {"stop": [""]},
    "stop_id_max": {"stop_token_ids": [2**32 - 1]},
    "prompt_logprobs_over": {"prompt_logprobs": 1000},
    "seed_negative": {"seed": -7, "temperature": 1.0},
    "logit_bias_nan": {"logit_bias": {5: float("nan")}},
    "truncate_negative": {"truncate_prompt_tokens": -1},
    "json_not_json": {"json_schema": "{not json"},
    "json_too_deep": {"json_schema": '{"type":"array","items":' * 200 + "{}" + "}" * 200},
    "json_remote_ref": {"json_schema": '{"$ref":"http://example.com/x.json"}'},
    "regex_nested": {"regex": "(a+)+" * 50},
    "grammar_no_root": {"grammar": 'a ::= "x"'},
    "tag_empty": {"structural_tag": "{}"},
    "choice_empty_string": {"choice": vpb.ChoiceConstraint(choices=[""])},
}
CLEAN = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def test_odd_values_get_an_answer_or_a_clean_status(stubs):
    """No field value makes the contract answer UNKNOWN / INTERNAL, hang or take the server down."""
    vllm, _ = stubs
    bodies = {f"sampling.{k}": {"sampling_params": sampling(**v)} for k, v in ODD_SAMPLING.items()}
    bodies |= {
        "text_only": {"text": "Hello there"},
        "empty_text": {"text": ""},
        "no_input": {},
        "id_out_of_vocab": {"tokenized": vpb.TokenizedInput(input_ids=[2**32 - 1])},
        "kv_params_not_json": {"kv_transfer_params_json": "not json"},
        "dp_rank_negative": {"data_parallel_rank": -1},
        "request_id_control_chars": {"request_id": "\x00\n\u2603"},
    }
    unclean = {}
    for name, fields in bodies.items():
        if name != "no_input" and "text" not in fields:
            fields.setdefault("tokenized", vpb.TokenizedInput(input_ids=PROMPT))
        fields.setdefault("sampling_params", sampling())
        try:
            list(vllm.Generate(vpb.GenerateRequest(**fields), timeout=60))
        except grpc.RpcError as e:
            if e.code() not in CLEAN:
                unclean[name] = f"{e.code().name}: {e.details()}"
    assert unclean == {}
    assert vllm.HealthCheck(vpb.HealthCheckRequest()).healthy
    assert generate(vllm)[-1].complete.output_ids  # and it still serves


def test_n_samples_each_with_its_index(server, stubs):
    """n > 1: n samples, each a complete with its index (and its chunks, streamed); a seed gives n
    different samples, the same again for the same seed, sample 0 the one n = 1 gives."""
    vllm, _ = stubs
    kw = {"temperature": 1.0, "seed": 11, "max_tokens": 10, "ignore_eos": True}
    unary = generate(vllm, n=3, **kw)
    assert [r.complete.index for r in unary] == [0, 1, 2]
    samples = [list(r.complete.output_ids) for r in unary]
    assert all(len(s) == 10 for s in samples) and len({tuple(s) for s in samples}) == 3
    assert samples[0] == list(generate(vllm, **kw)[0].complete.output_ids)
    assert all(r.complete.prompt_tokens == len(PROMPT) for r in unary)
    streamed = generate(vllm, stream=True, n=3, logprobs=1, **kw)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for r in streamed:
        if r.WhichOneof("response") == "chunk":
            tokens[r.chunk.index] += r.chunk.token_ids
            assert list(r.chunk.output_logprobs.token_ids) == list(r.chunk.token_ids)
    completes = [r.complete for r in streamed if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1, 2] and all(
        c.finish_reason == "length" for c in completes
    )
    assert [tokens[i] for i in range(3)] == samples
    long = [(7 * i) % 40000 + 100 for i in range(300)]  # the samples share one prefill of the prompt
    shared = [r.complete for r in generate(vllm, ids=long, n=4, max_tokens=2, **{"temperature": 1.0})]
    assert sorted(c.cached_tokens for c in shared)[1:] == [len(long) - 1] * 3
    greedy = generate(vllm, n=2, max_tokens=6)
    assert list(greedy[0].complete.output_ids) == list(greedy[1].complete.output_ids)
    assert wait_until(server.engine.kv_all_free, 10)


def test_abort_of_n_samples_ends_them_all(server, stubs):
    vllm, _ = stubs
    got: list = []
    req = vpb.GenerateRequest(
        request_id="fan-out",
        tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=sampling(max_tokens=400, ignore_eos=True, n=3),
        stream=True,
    )
    t = threading.Thread(target=lambda: got.extend(vllm.Generate(req, timeout=60)))
    t.start()
    assert wait_until(lambda: server.engine.num_live() == 3, 10)
    vllm.Abort(vpb.AbortRequest(request_ids=["fan-out"]))
    t.join(30)
    ends = [r.complete for r in got if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in ends) == [0, 1, 2] and {c.finish_reason for c in ends} == {"abort"}
    assert wait_until(server.engine.kv_all_free, 10)


def test_embed_and_profiler_are_unimplemented_with_a_reason(stubs):
    vllm, _ = stubs
    for name, req in (
        ("Embed", vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=PROMPT))),
        ("StartProfile", common_pb2.StartProfileRequest()),
        ("StopProfile", common_pb2.StopProfileRequest()),
    ):
        with pytest.raises(grpc.RpcError) as e:
            getattr(vllm, name)(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and e.value.details().startswith(f"{name}: ")


def test_abort_ends_the_stream_and_frees_its_kv(server, stubs):
    vllm, _ = stubs
    got: list = []
    req = vpb.GenerateRequest(
        request_id="to-abort",
        tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=sampling(max_tokens=400, ignore_eos=True),
        stream=True,
    )
    t = threading.Thread(target=lambda: got.extend(vllm.Generate(req, timeout=60)))
    t.start()
    while server.engine.num_live() == 0:
        time.sleep(0.01)
    vllm.Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown"]))
    t.join(30)
    assert got[-1].complete.finish_reason == "abort"
    assert sum(len(r.chunk.token_ids) for r in got[:-1]) < 400
    assert wait_until(server.engine.kv_all_free, 10)


def test_abort_while_its_generate_is_validated_cancels_it(server, stubs, monkeypatch):
    """An Abort that came while its Generate was still being validated (tokenizing, compiling a
    grammar) was lost: the request then ran for nobody. Now that Generate is refused as CANCELLED.
    An Abort of a request that already finished leaves a later request with the same id alone."""
    vllm, _ = stubs
    entered, go = threading.Event(), threading.Event()
    build = SmgWorkerServicer._build

    def held(self, request):
        entered.set()
        go.wait(10)
        return build(self, request)

    monkeypatch.setattr(SmgWorkerServicer, "_build", held)
    errors: list[grpc.RpcError] = []

    def run() -> None:
        try:
            generate(vllm, rid="racing", n=2, max_tokens=50, ignore_eos=True)
        except grpc.RpcError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert entered.wait(10)
    vllm.Abort(vpb.AbortRequest(request_ids=["racing"]))
    go.set()
    t.join(30)
    assert [(e.code(), "aborted" in e.details()) for e in errors] == [(grpc.StatusCode.CANCELLED, True)]
    assert server.engine.num_live() == 0
    monkeypatch.undo()
    assert len(generate(vllm, rid="racing", max_tokens=2, ignore_eos=True)[-1].complete.output_ids) == 2
    vllm.Abort(vpb.AbortRequest(request_ids=["racing", "never-sent"]))  # finished; unknown
    assert len(generate(vllm, rid="racing", max_tokens=2, ignore_eos=True)[-1].complete.output_ids) == 2
    assert len(generate(vllm, rid="never-sent", max_tokens=2, ignore_eos=True)[-1].complete.output_ids) == 2


def test_loads_flush_and_tokenizer(server, stubs, tiny_llama_dir):
    vllm, zg = stubs
    generate(vllm, max_tokens=4)

    def load():  # a finished request leaves the running set a step after its last output
        (one,) = vllm.GetLoads(vpb.GetLoadsRequest(include=["core"])).loads
        return one

    assert wait_until(lambda: load().num_running_reqs == 0, 10)
    one = load()
    assert one.max_total_num_tokens == 4096 and one.max_running_requests == 8
    assert one.num_waiting_reqs == 0 and 0 <= one.token_usage < 1
    assert not vllm.GetLoads(vpb.GetLoadsRequest(dp_rank=1)).loads
    assert zg.GetServerInfo(pb2.GetServerInfoRequest()).prefix_cache_tokens > 0
    flushed = vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=1.0))
    assert flushed.success and zg.GetServerInfo(pb2.GetServerInfoRequest()).prefix_cache_tokens == 0
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
    assert (tiny_llama_dir / "tokenizer.json").read_bytes() == zipfile.ZipFile(io.BytesIO(data)).read(
        "tokenizer.json"
    )


@pytest.fixture
def uncached_stubs(tiny_llama_dir):
    """A second server with the prefix cache off by `--disable-feature` (not `--disable-prefix-cache`)."""
    srv = BackgroundServer(
        ServerArgs(
            model=str(tiny_llama_dir),
            port=0,
            dtype="float32",
            kv_cache_tokens=4096,
            max_running_requests=8,
            disabled_features=["prefix_cache"],
        )
    )
    try:
        with grpc.insecure_channel(srv.address) as ch:
            yield vllm_engine_pb2_grpc.VllmEngineStub(ch), pb2_grpc.GenerationStub(ch)
    finally:
        srv.stop()


@pytest.mark.parametrize("cache", ["prefix-cache", "no-prefix-cache", "prompt-logprobs"])
def test_loads_report_queued_prompt_tokens_and_throughput(request, cache):
    """What SMG's least_load / power_of_two score by: the prompt tokens of the requests sent that
    have not started (8 long requests fill the 8 running slots; a second call's 3 samples wait and
    count their shared prompt once, as the prefix cache prefills it once; without the cache, or
    with prompt logprobs, which take nothing from it, each sample's) and the tokens generated per
    second between polls; both back to 0 / the rate's decay once the requests end."""
    vllm, zg = request.getfixturevalue("uncached_stubs" if cache == "no-prefix-cache" else "stubs")
    other = [1, 3681, 338, 263, 1243, 1058]
    each = 1 if cache == "prefix-cache" else 3  # the samples whose prompt counts

    def call(rid: str, ids: list[int], n: int, **kw) -> threading.Thread:
        req = vpb.GenerateRequest(
            request_id=rid,
            tokenized=vpb.TokenizedInput(input_ids=ids),
            sampling_params=sampling(max_tokens=200, ignore_eos=True, n=n, **kw),
            stream=True,
        )
        t = threading.Thread(target=lambda: list(vllm.Generate(req, timeout=60)))
        t.start()
        return t

    def load():
        (one,) = vllm.GetLoads(vpb.GetLoadsRequest()).loads
        return one

    def zerogap_call() -> threading.Thread:  # the other service's requests are queued work too
        req = pb2.GenerateRequest(
            request_id="zg-queued",
            token_ids=pb2.TokenIds(ids=[5, 6, 7, 8]),
            sampling=pb2.SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True),
        )
        t = threading.Thread(target=lambda: list(zg.GenerateStream(req, timeout=60)))
        t.start()
        return t

    threads = [call("busy", PROMPT, 8)]
    try:
        assert wait_until(lambda: load().num_running_reqs == 8, 10)
        threads.append(
            call("queued", other, 3, **({"prompt_logprobs": 1} if cache == "prompt-logprobs" else {}))
        )
        assert wait_until(lambda: load().num_waiting_reqs == 3, 10)
        assert load().num_waiting_uncached_tokens == len(other) * each
        threads.append(zerogap_call())
        assert wait_until(lambda: load().num_waiting_reqs == 4, 10)
        assert load().num_waiting_uncached_tokens == len(other) * each + 4
        time.sleep(0.6)
        assert load().gen_throughput > 0
    finally:
        vllm.Abort(vpb.AbortRequest(request_ids=["busy", "queued"]))
        zg.Abort(pb2.AbortRequest(request_id="zg-queued"))
        for t in threads:
            t.join(30)
    assert load().num_waiting_uncached_tokens == 0


def test_queued_prompt_tokens_leave_out_what_an_admitted_request_has_in_kv():
    """A request counts its whole prompt until admitted, then only what is past its KV rows (a cached
    prefix, launched chunks), until its first output: SGLang's waiting tokens minus their matched
    prefix, plus the rest of a chunked prompt; a sample sharing another's prompt counts nothing."""
    import asyncio

    from service.core.request import FinishReason, Req, RequestOutput, SamplingParams
    from service.server import OutputRouter

    def req(rid: str, n: int) -> Req:
        return Req(rid, list(range(n)), SamplingParams(max_new_tokens=4), 0, None, frozenset())  # type: ignore[arg-type]

    class Engine:
        def on_finished(self, rid: str) -> None:
            pass

    router = OutputRouter(asyncio.new_event_loop())
    router.engine = Engine()  # type: ignore[assignment]
    a, b = req("a", 100), req("b", 30)
    router.open("a", prefill=a)
    router.open("b", prefill=b)
    router.open("b/1", prefill=None)  # n = 2: its prompt is b's
    assert router.queued_prompt_tokens() == 130  # waiting: a match is known only at admission
    a.kv_len = 64  # admitted on a 48-token cached prefix, its first 16-token chunk launched
    assert router.queued_prompt_tokens() == 66
    router._dispatch([RequestOutput("b", [7], "x", 30, 1)])  # b's first token
    assert router.queued_prompt_tokens() == 36
    router.open("c", prefill=req("c", 50))
    router.forget("c")  # its RPC ended before any output (an abort's output may never come)
    assert router.queued_prompt_tokens() == 36
    a.finished = FinishReason.ABORT  # aborted before its output reached the router
    assert router.queued_prompt_tokens() == 0
    router.loop.close()


def test_loads_count_no_finished_request_as_running(stubs):
    """A request that has ended is not running, though the scheduler drops it from its list only
    when it forms the next batch (an idle wait later)."""
    vllm, _ = stubs
    for _ in range(3):
        generate(vllm, max_tokens=4)
        (load,) = vllm.GetLoads(vpb.GetLoadsRequest()).loads
        assert load.num_running_reqs == 0


def test_rate_meter_reads_a_running_total():
    meter = RateMeter(window_s=10.0, min_span_s=0.5)
    assert meter.rate(0, 100.0) == 0.0 and meter.rate(10, 100.2) == 0.0  # too short a span yet
    assert meter.rate(50, 101.0) == pytest.approx(50.0)
    assert meter.rate(150, 111.0) == pytest.approx((150 - 50) / 10.0)  # from the poll 10 s before
    assert meter.rate(150, 130.0) == pytest.approx(0.0)  # idle: the window's rate decays to 0


def test_flush_refused_while_requests_run(server, stubs):
    vllm, _ = stubs
    req = vpb.GenerateRequest(
        request_id="long",
        tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=sampling(max_tokens=300, ignore_eos=True),
        stream=True,
    )
    t = threading.Thread(target=lambda: list(vllm.Generate(req, timeout=60)))
    t.start()
    while server.engine.num_live() == 0:
        time.sleep(0.01)
    refused = vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
    vllm.Abort(vpb.AbortRequest(request_ids=["long"]))
    t.join(30)
    assert not refused.success and "in flight" in refused.message
