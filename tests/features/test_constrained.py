"""Constrained decoding: JSON schemas, regex, EBNF, mixing, errors, state rebuild."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from service.config import ServerArgs
from service.core.request import FinishReason, RequestError, SamplingParams
from service.engine.engine import SyncClient, collect
from tests.data.json_schemas import SCHEMAS
from tests.data.make_schema_corpus import corpus
from tests.helpers import grpc_stub, wait_until
from zerogap.v1 import generation_pb2 as pb2


@pytest.fixture(scope="module")
def client(smol_dir):
    # A long compile deadline: the corpus test sends its ~40 schemas at once and the deadline counts
    # their queueing for the compile workers (on a loaded 2-core machine, past the default 30 s).
    args = ServerArgs(
        dtype="float32", kv_cache_tokens=20000, max_running_requests=32, grammar_compile_timeout_s=300
    )
    c = SyncClient(args, smol_dir)
    yield c
    c.close()


def chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


# Temperature 1 covers a sampled impossible day: with xgrammar's own `format: date` grammar, seed 20
# sampled "0022-02-31" (now a calendar-exact pattern, features/json_schema.py FORMAT_PATTERNS).
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_suite_outputs_validate(client, hf_tokenizer, temperature):
    assert len(SCHEMAS) >= 20
    prompts = [chat(hf_tokenizer, p + " Answer in JSON.") for p, _ in SCHEMAS]
    params = [
        SamplingParams(temperature=temperature, seed=i, max_new_tokens=320) for i in range(len(SCHEMAS))
    ]
    feats = [{"constrained": dict(kind="json_schema", text=json.dumps(s))} for _, s in SCHEMAS]
    outs = client.generate(prompts, params, feats)
    for (prompt, schema), o in zip(SCHEMAS, outs):
        ids, text, last = collect(o)
        assert last.finish_reason is FinishReason.STOP, (prompt, last.finish_reason, last.error, text)
        value = json.loads(text)
        jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(value)
        assert last.extras["constrained"].satisfied, last.extras["constrained"]


def test_sampled_dates_are_real_days(client, hf_tokenizer):
    """`format: date` cannot produce an impossible day, however it samples (xgrammar's own date
    grammar gives e.g. 2023-02-30 here at these seeds)."""
    schema = json.dumps(
        {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}
    )
    prompt = chat(hf_tokenizer, "Pick a day at the end of February or of April. Answer in JSON.")
    n = 24
    outs = client.generate(
        [prompt] * n,
        [SamplingParams(temperature=1.5, seed=s, max_new_tokens=24) for s in range(n)],
        [{"constrained": dict(kind="json_schema", text=schema)}] * n,
    )
    checker = jsonschema.FormatChecker()
    for o in outs:
        _, text, last = collect(o)
        assert last.finish_reason is FinishReason.STOP, (last.finish_reason, text)
        assert checker.conforms(json.loads(text)["d"], "date"), text
        assert last.extras["constrained"].satisfied, last.extras["constrained"]


@pytest.mark.parametrize(
    "kind, text, check",
    [
        ("regex", r"(cat|dog)s? [0-9]{1,3}", lambda s: re.fullmatch(r"(cat|dog)s? [0-9]{1,3}", s)),
        (
            "regex",
            r"[A-Z][a-z]{1,10}, [A-Z][a-z]{1,10}!",
            lambda s: re.fullmatch(r"[A-Z][a-z]{1,10}, [A-Z][a-z]{1,10}!", s),
        ),
        (
            "ebnf",
            'root ::= "The answer is " ("yes" | "no") "."',
            lambda s: s in ("The answer is yes.", "The answer is no."),
        ),
        (
            "ebnf",
            'root ::= item | item ", " item | item ", " item ", " item\nitem ::= [a-z] [a-z]? [a-z]? [a-z]? [a-z]?',
            lambda s: re.fullmatch(r"[a-z]{1,5}(, [a-z]{1,5}){0,2}", s),
        ),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_ebnf_and_json_object_fully_match(client, hf_tokenizer, kind, text, check, temperature):
    prompts = [
        chat(hf_tokenizer, q) for q in ("Name an animal and a number.", "Greet someone.", "Is the sky blue?")
    ]
    outs = client.generate(
        prompts,
        [SamplingParams(temperature=temperature, seed=i, max_new_tokens=96) for i in range(3)],
        [{"constrained": dict(kind=kind, text=text)}] * 3,
    )
    for o in outs:
        _, out_text, last = collect(o)
        assert last.finish_reason is FinishReason.STOP and check(out_text), (out_text, last.error)


def test_json_object_outputs_parse(client, hf_tokenizer):
    prompt = chat(hf_tokenizer, "Give a JSON object with the keys name and age for a person.")
    outs = client.generate(
        [prompt] * 3,
        [SamplingParams(temperature=0.7, seed=s, max_new_tokens=200) for s in range(3)],
        [{"constrained": dict(kind="json_object")}] * 3,
    )
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
    params = [greedy, greedy] + [
        SamplingParams(temperature=1.0, seed=s, max_new_tokens=200) for s in range(3)
    ]
    outs = client.generate(prompts, params, feats)
    assert [collect(o)[0] for o in outs[:2]] == solo
    for o in outs[2:]:
        jsonschema.validate(json.loads(collect(o)[1]), schema)


def test_constrained_with_logprobs_penalties_and_stop(client, hf_tokenizer):
    """Logprobs stay raw (the mask does not renormalise them); penalties and seeds still apply."""
    prompt = chat(hf_tokenizer, "Name an animal.")
    feats = {
        "constrained": dict(kind="regex", text=r"(cat|dog|cow)s?"),
        "logprobs": dict(return_logprob=True, top_logprobs_num=3),
    }
    sp = SamplingParams(temperature=0.8, seed=4, repetition_penalty=1.3, max_new_tokens=16)
    a = client.generate([prompt], sp, [feats])[0]
    b = client.generate([prompt], sp, [feats])[0]
    ids, text, last = collect(a)
    assert re.fullmatch(r"(cat|dog|cow)s?", text) and collect(b)[0] == ids
    entries = [e for o in a for e in o.extras["logprobs"].output]
    assert [e[0] for e in entries] == ids
    # Raw distribution: the first token's top alternatives are not limited to the grammar's.
    assert all(lp <= 0 for _, lp, _, _ in entries)
    assert sum(1 for t, _ in entries[0][2] if t not in ids) >= 1


def test_grammar_governs_termination_despite_min_new_tokens(client, hf_tokenizer):
    """Regression: EOS was banned below min_new_tokens even where the grammar allowed nothing else."""
    outs = client.generate(
        [chat(hf_tokenizer, "Yes or no?")],
        SamplingParams(temperature=0, max_new_tokens=20, min_new_tokens=8),
        [{"constrained": dict(kind="regex", text="(yes|no)")}],
    )
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
    req.feature_state["constrained"].accept_token(
        client.engine.tokenizer.encode("f", add_special_tokens=False)[0]
    )
    feature.rebuild_state(req)  # back to the state after the kept tokens
    mask_b = feature.backend.allocate_bitmask(1)
    req.feature_state["constrained"].fill_next_token_bitmask(mask_b, 0)
    assert bool((mask_a == mask_b).all())


def test_grammar_compiles_once_and_slow_compile_times_out(smol_dir):
    c = SyncClient(
        ServerArgs(
            dtype="float32",
            kv_cache_tokens=2000,
            max_running_requests=4,
            grammar_compile_timeout_s=1.0,
            max_constraint_bytes=1 << 20,
            max_constraint_properties=10_000,
            grammar_worker_max_rss_mb=1 << 20,
        ),
        smol_dir,
    )
    try:
        backend = c.engine.features.features["constrained"].backend
        assert backend.wait_ready(120)
        f1 = backend.compile("regex", "x+")
        assert backend.compile("regex", "x+").result() is f1.result() and backend.stats.cache_hits >= 1
        # 2,000 properties: compiles for ~20 s in xgrammar, so it is stopped.
        slow = json.dumps(
            {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
        )
        compiles = backend.stats.compiles
        c.submit(
            "slow",
            [5, 6, 7],
            SamplingParams(max_new_tokens=4),
            {"constrained": dict(kind="json_schema", text=slow)},
        )
        c.submit("fast", [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4))
        fast = c.wait("fast")  # not held up by the compiling one
        assert fast[-1].finish_reason is FinishReason.LENGTH
        slow_out = c.wait("slow")[-1]
        assert slow_out.finish_reason is FinishReason.ERROR and slow_out.error_code == "DEADLINE_EXCEEDED"
        # Stopped (by its deadline, or once the failed request no longer waits), not left to run for ~30 s.
        assert wait_until(lambda: all(s.job is None for s in backend._slots) and not backend._queue, 10)
        assert backend.stats.compiles == compiles
        assert c.engine.kv_all_free()
    finally:
        c.close()


@pytest.fixture(scope="module")
def stub(smol_dir):
    with grpc_stub(smol_dir, kv_cache_tokens=4096, max_running_requests=8) as s:
        yield s


def test_grpc_constraint_and_errors(stub):
    r = stub.Generate(
        pb2.GenerateRequest(
            text="Pick:",
            sampling=pb2.SamplingParams(max_new_tokens=20, temperature=0),
            constraint=pb2.Constraint(regex="(left|right)"),
        )
    )
    assert r.text in ("left", "right") and r.finish_reason == pb2.FINISH_REASON_STOP
    bad = [
        (pb2.Constraint(json_schema="{not json"), "constraint.json_schema"),
        (pb2.Constraint(json_schema='{"type": "nonsense"}'), "constraint.json_schema"),
        (pb2.Constraint(regex="(unclosed"), "constraint.regex"),
        (pb2.Constraint(ebnf="root ::= ("), "constraint.ebnf"),
        (pb2.Constraint(regex="(?=a)a"), "constraint.regex"),
        (pb2.Constraint(structural_tag='{"type": "structural_tag"}'), "constraint.structural_tag"),
        (pb2.Constraint(), "constraint"),
    ]
    for constraint, field in bad:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(
                pb2.GenerateRequest(
                    text="x", sampling=pb2.SamplingParams(max_new_tokens=4), constraint=constraint
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), (
            e.value.details()
        )
        assert ".cc:" not in e.value.details() and "/project/" not in e.value.details(), e.value.details()


def test_model_vocab_larger_than_tokenizer(smol_dir, tmp_path):
    """Padding rows of the model's vocabulary are masked: outputs stay valid."""
    from tests.conftest import make_tiny_model

    model_dir = make_tiny_model(smol_dir, tmp_path / "padded", "llama", vocab_size=49152 + 64)
    c = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=2000, max_running_requests=4), model_dir)
    try:
        outs = c.generate(
            [[5, 6, 7]] * 3,
            [SamplingParams(temperature=1.0, seed=s, max_new_tokens=60) for s in range(3)],
            [{"constrained": dict(kind="regex", text=r"[0-9]{2,4}-[a-z]{2}")}] * 3,
        )
        for o in outs:
            ids, text, last = collect(o)
            assert re.fullmatch(r"[0-9]{2,4}-[a-z]{2}", text) and all(t < 49152 for t in ids)
    finally:
        c.close()


# Real-world schemas (tests/data/make_schema_corpus.py): the travis case (all constraints
# under a top-level allOf), OpenAPI allOf / discriminated oneOf, small SchemaStore ones.
CORPUS_SAMPLE = [
    "schemastore/travis",
    "schemastore/github-issue-config",
    "schemastore/codecov",
    "openapi/petstore-expanded#Pet",
    "openapi/openapi-3.1#Pet-oneOf-discriminator",
]


# The vendored SchemaStore schemas served by default, once each (sampled), beside the sample above;
# not drone-ci (external $refs: refused) nor azure-pipelines (a 1.6 MB grammar past the deadline).
VENDORED = [
    n
    for n in corpus()
    if n.startswith("schemastore/")
    and n not in CORPUS_SAMPLE
    and n not in ("schemastore/drone-ci", "schemastore/azure-pipelines")
]


def test_corpus_sample_stop_and_satisfied_means_valid(client, hf_tokenizer):
    """With the default (lenient) mode, whatever finishes with STOP and satisfied validates, and
    `satisfied` equals jsonschema's verdict, for the vendored schemas and the project's sample."""
    texts = corpus()
    prompt = chat(hf_tokenizer, "Write a short example configuration as JSON.")
    cases = [(name, temp) for name in CORPUS_SAMPLE for temp in (0.0, 0.9)] + [
        (name, 0.9) for name in VENDORED
    ]
    feats = [{"constrained": dict(kind="json_schema", text=texts[name])} for name, _ in cases]
    params = [SamplingParams(temperature=t, seed=i, max_new_tokens=64) for i, (_, t) in enumerate(cases)]
    outs = client.generate([prompt] * len(cases), params, feats)
    finished = 0
    for (name, _), o in zip(cases, outs):
        _, text, last = collect(o)
        assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (
            name,
            last.error_code,
            last.error,
        )
        result = last.extras["constrained"]
        schema = json.loads(texts[name])
        cls = jsonschema.validators.validator_for(schema)
        try:
            valid = cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(json.loads(text))
        except ValueError:
            valid = False
        assert result.satisfied == valid, (name, text, result)
        if last.finish_reason is FinishReason.STOP:
            finished += 1
            assert result.satisfied or result.relaxed, (name, text, result)  # exact grammars never miss
    assert finished >= 4
    travis = [o for (name, _), o in zip(cases, outs) if name == "schemastore/travis"]
    assert all(collect(o)[2].extras["constrained"].normalized for o in travis)


def test_strict_mode_refuses_and_the_lenient_default_reports(client, hf_tokenizer):
    schema = json.dumps(
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
            "contains": {"const": 7},
        }
    )
    try:  # refused at once when the preparation is already done, else when the request is admitted
        last = collect(
            client.generate(
                [[5, 6]],
                SamplingParams(max_new_tokens=4),
                [{"constrained": dict(kind="json_schema", text=schema, mode="strict")}],
            )[0]
        )[2]
        code, message = last.error_code, last.error
        assert last.finish_reason is FinishReason.ERROR
    except RequestError as e:
        code, message = e.code, e.message
    assert code == "INVALID_ARGUMENT" and "/contains: contains" in message, message
    outs = client.generate(
        [chat(hf_tokenizer, "Three digits.")],
        SamplingParams(temperature=0, max_new_tokens=24),
        [{"constrained": dict(kind="json_schema", text=schema)}],
    )  # the default: lenient
    _, text, last = collect(outs[0])
    result = last.extras["constrained"]
    assert [i.keyword for i in result.relaxed] == ["contains"]
    value = json.loads(text)
    assert result.satisfied == (7 in value), (text, result)


def test_unique_items_enforced_while_decoding(client, hf_tokenizer):
    """uniqueItems of scalars is enforced at decode time: strict mode accepts it, and sampled
    outputs never repeat an item (tests/test_json_tracker.py shows the grammar alone repeating)."""
    schema = {
        "type": "object",
        "properties": {
            "digits": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 4},
                "minItems": 3,
                "maxItems": 5,
                "uniqueItems": True,
            },
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "uniqueItems": True,
            },
        },
        "required": ["digits", "tags"],
        "additionalProperties": False,
    }
    prompt = chat(hf_tokenizer, "Five digits and some colours, with repeats, as JSON.")
    n = 12
    outs = client.generate(
        [prompt] * n,
        [SamplingParams(temperature=1.2, seed=s, max_new_tokens=48) for s in range(n)],
        [{"constrained": dict(kind="json_schema", text=json.dumps(schema), mode="strict")}] * n,
    )
    stopped = 0
    for o in outs:
        _, text, last = collect(o)
        result = last.extras["constrained"]
        assert not result.relaxed, result
        if last.finish_reason is FinishReason.STOP:
            stopped += 1
            value = json.loads(text)
            assert all(len(set(value[k])) == len(value[k]) for k in ("digits", "tags")), text
            assert result.satisfied, (text, result)
    assert stopped >= n // 2


TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "at_least_one": True,
        "stop_after_first": True,
        "tags": [
            {
                "type": "tag",
                "begin": "<tool_call>",
                "content": {"type": "json_schema", "json_schema": TOOL_CALL},
                "end": "</tool_call>",
            }
        ],
    },
}


def test_structural_tag_tool_call_parts_validate(client, hf_tokenizer):
    ids = hf_tokenizer.apply_chat_template(
        [
            {
                "role": "system",
                "content": 'You can call get_weather(city, unit): answer <tool_call>{"name": "get_weather", "arguments": {...}}</tool_call>.',
            },
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    params = [
        SamplingParams(temperature=0, max_new_tokens=80),
        SamplingParams(temperature=0.8, seed=1, max_new_tokens=80),
    ]
    outs = client.generate(
        [prompt] * 2, params, [{"constrained": dict(kind="structural_tag", text=json.dumps(TOOL_TAG))}] * 2
    )
    for o in outs:
        _, text, last = collect(o)
        assert last.finish_reason is FinishReason.STOP and last.extras["constrained"].satisfied, (
            text,
            last.extras,
        )
        calls = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0]), TOOL_CALL)


def test_json_in_a_structural_tag_has_bounded_whitespace():
    """xgrammar lets JSON (or qwen_xml) in a tag have any run of blanks (a model may fill max_tokens
    with them, as a random one did behind SMG's mistral tool tag): one character per place, unless
    the tag sets its own bound."""
    import xgrammar as xgr

    from features.constrained import ConstraintSpec, prepare

    def accepts(tag: dict, text: str) -> bool:
        backend = prepare(ConstraintSpec("structural_tag", json.dumps(tag)), "strict").backend_text
        return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_structural_tag(backend), text)

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    assert accepts(TOOL_TAG, call)
    assert accepts(TOOL_TAG, call.replace(" ", ""))
    assert not accepts(TOOL_TAG, call.replace('": ', '":   '))
    own = json.loads(json.dumps(TOOL_TAG))
    own["format"]["tags"][0]["content"]["max_whitespace_cnt"] = 4
    assert accepts(own, call.replace('": ', '":   '))
    xml = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "content": {
                "type": "json_schema",
                "style": "qwen_xml",
                "json_schema": TOOL_CALL["properties"]["arguments"],
            },
            "end": "</call>",
        },
    }
    params = "<parameter=city>\nParis\n</parameter><parameter=unit>\ncelsius\n</parameter>"
    assert accepts(xml, f"<call>{params}</call>")
    assert not accepts(xml, f"<call>   {params}</call>")


def test_grpc_constraint_result_and_modes(stub):
    schema = json.dumps(
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["a", "b"]},
                    "maxItems": 2,
                    "contains": {"const": "b"},
                }
            },
            "required": ["tags"],
        }
    )
    req = dict(text="Tags:", sampling=pb2.SamplingParams(max_new_tokens=24, temperature=0))
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(
            pb2.GenerateRequest(
                **req, constraint=pb2.Constraint(json_schema=schema, mode=pb2.CONSTRAINT_MODE_STRICT)
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "/properties/tags/contains: contains" in e.value.details() and ".cc" not in e.value.details()
    lenient = pb2.Constraint(json_schema=schema, mode=pb2.CONSTRAINT_MODE_LENIENT)
    r = stub.Generate(pb2.GenerateRequest(**req, constraint=lenient))
    assert [i.keyword for i in r.constraint_result.relaxed] == ["contains"]
    assert r.constraint_result.satisfied == (
        r.finish_reason == pb2.FINISH_REASON_STOP and "b" in json.loads(r.text)["tags"]
    )
    stream = list(stub.GenerateStream(pb2.GenerateRequest(**req, constraint=lenient)))
    assert all(not m.HasField("constraint_result") for m in stream[:-1])
    assert stream[-1].constraint_result == r.constraint_result
    regex = stub.Generate(pb2.GenerateRequest(**req, constraint=pb2.Constraint(regex="(left|right)")))
    assert regex.constraint_result.satisfied and not regex.constraint_result.violations
