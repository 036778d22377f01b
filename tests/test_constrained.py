"""Constrained decoding: JSON schemas, regex, EBNF, mixing, errors, state rebuild."""

from __future__ import annotations

import json
import re
import time

import grpc
import jsonschema
import pytest

from service import protos
from service.config import ServerArgs
from service.engine.engine import SyncClient, collect
from service.engine.request import FinishReason, SamplingParams
from tests.helpers import grpc_client
from tests.data.json_schemas import SCHEMAS
from zerogap.client import Constraint, ZerogapError

pb2, _ = protos.load()


@pytest.fixture(scope="module")
def client(smol_dir):
    c = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=20000, max_running_requests=32), smol_dir)
    yield c
    c.close()


def chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_suite_outputs_validate(client, hf_tokenizer, temperature):
    assert len(SCHEMAS) >= 20
    prompts = [chat(hf_tokenizer, p + " Answer in JSON.") for p, _ in SCHEMAS]
    params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=320) for i in range(len(SCHEMAS))]
    feats = [{"constrained": dict(kind="json_schema", text=json.dumps(s))} for _, s in SCHEMAS]
    outs = client.generate(prompts, params, feats)
    for (prompt, schema), o in zip(SCHEMAS, outs):
        ids, text, last = collect(o)
        assert last.finish_reason is FinishReason.STOP, (prompt, last.finish_reason, last.error, text)
        value = json.loads(text)
        jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(value)


@pytest.mark.parametrize("kind, text, check", [
    ("regex", r"(cat|dog)s? [0-9]{1,3}", lambda s: re.fullmatch(r"(cat|dog)s? [0-9]{1,3}", s)),
    ("regex", r"[A-Z][a-z]{1,10}, [A-Z][a-z]{1,10}!", lambda s: re.fullmatch(r"[A-Z][a-z]{1,10}, [A-Z][a-z]{1,10}!", s)),
    ("ebnf", 'root ::= "The answer is " ("yes" | "no") "."', lambda s: s in ("The answer is yes.", "The answer is no.")),
    ("ebnf", 'root ::= item | item ", " item | item ", " item ", " item\nitem ::= [a-z] [a-z]? [a-z]? [a-z]? [a-z]?',
     lambda s: re.fullmatch(r"[a-z]{1,5}(, [a-z]{1,5}){0,2}", s)),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_ebnf_and_json_object_fully_match(client, hf_tokenizer, kind, text, check, temperature):
    prompts = [chat(hf_tokenizer, q) for q in ("Name an animal and a number.", "Greet someone.", "Is the sky blue?")]
    outs = client.generate(prompts, [SamplingParams(temperature=temperature, seed=i, max_new_tokens=96) for i in range(3)],
                           [{"constrained": dict(kind=kind, text=text)}] * 3)
    for o in outs:
        _, out_text, last = collect(o)
        assert last.finish_reason is FinishReason.STOP and check(out_text), (out_text, last.error)


def test_json_object_outputs_parse(client, hf_tokenizer):
    prompt = chat(hf_tokenizer, "Give a JSON object with the keys name and age for a person.")
    outs = client.generate([prompt] * 3, [SamplingParams(temperature=0.7, seed=s, max_new_tokens=200) for s in range(3)],
                           [{"constrained": dict(kind="json_object")}] * 3)
    for o in outs:
        _, text, last = collect(o)
        assert last.finish_reason is FinishReason.STOP, text
        assert isinstance(json.loads(text), (dict, list))


def test_mixed_constrained_and_plain_requests(client, hf_tokenizer):
    plain = [chat(hf_tokenizer, q) for q in ("Tell me a joke.", "What is 2+2?")]
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    solo = [collect(client.generate([p], greedy)[0])[0] for p in plain]
    schema = SCHEMAS[0][1]
    prompts = plain + [chat(hf_tokenizer, "Describe a person in JSON.")] * 3
    feats = [None, None] + [{"constrained": dict(kind="json_schema", text=json.dumps(schema))}] * 3
    params = [greedy, greedy] + [SamplingParams(temperature=1.0, seed=s, max_new_tokens=200) for s in range(3)]
    outs = client.generate(prompts, params, feats)
    assert [collect(o)[0] for o in outs[:2]] == solo
    for o in outs[2:]:
        jsonschema.validate(json.loads(collect(o)[1]), schema)


def test_constrained_with_logprobs_penalties_and_stop(client, hf_tokenizer):
    """Logprobs stay raw (the mask does not renormalise them); penalties and seeds still apply."""
    prompt = chat(hf_tokenizer, "Name an animal.")
    feats = {"constrained": dict(kind="regex", text=r"(cat|dog|cow)s?"), "logprobs": dict(return_logprob=True, top_logprobs_num=3)}
    sp = SamplingParams(temperature=0.8, seed=4, repetition_penalty=1.3, max_new_tokens=16)
    a = client.generate([prompt], sp, [feats])[0]
    b = client.generate([prompt], sp, [feats])[0]
    ids, text, last = collect(a)
    assert re.fullmatch(r"(cat|dog|cow)s?", text) and collect(b)[0] == ids
    entries = [e for o in a for e in o.extras["logprobs"]["output"]]
    assert [e[0] for e in entries] == ids
    # Raw distribution: the first token's top alternatives are not limited to the grammar's.
    assert all(lp <= 0 for _, lp, _, _ in entries)
    assert sum(1 for t, _, _ in entries[0][2] if t not in ids) >= 1


def test_grammar_governs_termination_despite_min_new_tokens(client, hf_tokenizer):
    """Regression: EOS was banned below min_new_tokens even where the grammar allowed nothing else."""
    outs = client.generate([chat(hf_tokenizer, "Yes or no?")], SamplingParams(temperature=0, max_new_tokens=20, min_new_tokens=8),
                           [{"constrained": dict(kind="regex", text="(yes|no)")}])
    _, text, last = collect(outs[0])
    assert last.finish_reason is FinishReason.STOP and text in ("yes", "no"), (text, last.error)


def test_matcher_state_rebuilds_from_kept_tokens(client):
    feature = client.engine.features.features["constrained"]
    compiled = feature.backend.compile("regex", r"abc(d|e)f").result()

    class FakeReq:
        feature_state = {"constrained": feature.backend.matcher(compiled)}
        output_ids = client.engine.tokenizer.encode("abcd", add_special_tokens=False)

    req = FakeReq()
    for t in req.output_ids:
        assert req.feature_state["constrained"].accept_token(t)
    mask_a = feature.backend.allocate_bitmask(1)
    req.feature_state["constrained"].fill_next_token_bitmask(mask_a, 0)
    req.feature_state["constrained"].accept_token(client.engine.tokenizer.encode("f", add_special_tokens=False)[0])
    feature.rebuild_state(req)  # back to the state after the kept tokens
    mask_b = feature.backend.allocate_bitmask(1)
    req.feature_state["constrained"].fill_next_token_bitmask(mask_b, 0)
    assert bool((mask_a == mask_b).all())


def test_grammar_compiles_once_and_slow_compile_times_out(smol_dir):
    c = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=2000, max_running_requests=4, grammar_compile_timeout_s=0.3), smol_dir)
    try:
        backend = c.engine.features.features["constrained"].backend
        f1 = backend.compile("regex", "x+")
        assert backend.compile("regex", "x+") is f1 and backend.stats.cache_hits >= 1
        real = backend._compile
        backend._compile = lambda kind, text: (time.sleep(2), real(kind, text))[1]
        try:
            c.submit("slow", [5, 6, 7], SamplingParams(max_new_tokens=4), {"constrained": dict(kind="regex", text="y+z")})
            c.submit("fast", [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4))
            fast = c.wait("fast")  # not held up by the compiling one
            assert fast[-1].finish_reason is FinishReason.LENGTH
            slow = c.wait("slow")[-1]
            assert slow.finish_reason is FinishReason.ERROR and slow.error_code == "DEADLINE_EXCEEDED"
        finally:
            backend._compile = real
        assert c.engine.kv_pool.free_count == c.engine.kv_pool.size
    finally:
        c.close()


@pytest.fixture(scope="module")
def grpc_api(smol_dir):
    with grpc_client(smol_dir, kv_cache_tokens=4096, max_running_requests=8) as (c, _):
        yield c


def test_grpc_constraint_and_errors(grpc_api):
    r = grpc_api.generate("Pick:", max_new_tokens=20, temperature=0, constraint=Constraint.regex("(left|right)"))
    assert r.text in ("left", "right") and r.finish_reason == "stop"
    bad = [
        (Constraint.json_schema("{not json"), "constraint.json_schema"),
        (Constraint.json_schema({"type": "nonsense"}), "constraint.json_schema"),
        (Constraint.regex("(unclosed"), "constraint.regex"),
        (Constraint.ebnf("root ::= ("), "constraint.ebnf"),
    ]
    for constraint, field in bad:
        with pytest.raises(ZerogapError) as e:
            grpc_api.generate("x", max_new_tokens=4, constraint=constraint)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # an empty Constraint message, which the client cannot build
        grpc_api.stub.Generate(pb2.GenerateRequest(text="x", sampling=pb2.SamplingParams(max_new_tokens=4), constraint=pb2.Constraint()))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.value.details()


def test_model_vocab_larger_than_tokenizer(smol_dir, tmp_path):
    """Padding rows of the model's vocabulary are masked: outputs stay valid."""
    from tests.conftest import make_tiny_model

    model_dir = make_tiny_model(smol_dir, tmp_path / "padded", "llama", vocab_size=49152 + 64)
    c = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=2000, max_running_requests=4), model_dir)
    try:
        outs = c.generate([[5, 6, 7]] * 3, [SamplingParams(temperature=1.0, seed=s, max_new_tokens=60) for s in range(3)],
                          [{"constrained": dict(kind="regex", text=r"[0-9]{2,4}-[a-z]{2}")}] * 3)
        for o in outs:
            ids, text, last = collect(o)
            assert re.fullmatch(r"[0-9]{2,4}-[a-z]{2}", text) and all(t < 49152 for t in ids)
    finally:
        c.close()
