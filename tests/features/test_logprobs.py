"""Logprobs against transformers' forward, edge cases and the gRPC surface."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from service.config import ServerArgs
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from tests.helpers import grpc_client
from zerogap.client import Logprobs, Sampling
from zerogap.v1 import generation_pb2 as pb2

TOL = 2e-4


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over a whole sequence [len, vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def output_entries(outs):
    return [e for o in outs if "logprobs" in o.extras for e in o.extras["logprobs"].output]


def check_against_reference(client, hf, prompt, n_new=12, start=0, top_n=3):
    outs = client.generate(
        [prompt],
        SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True),
        [
            {
                "logprobs": dict(
                    return_logprob=True,
                    top_logprobs_num=top_n,
                    token_ids_logprob=(7, 11),
                    logprob_start_len=start,
                )
            }
        ],
    )[0]
    ids = collect(outs)[0]
    ref = hf_logprobs(hf, prompt + ids)
    out_entries = output_entries(outs)
    assert [e[0] for e in out_entries] == ids
    for k, (tok, lp, top, tids) in enumerate(out_entries):
        row = ref[len(prompt) - 1 + k]
        assert abs(lp - float(row[tok])) < TOL
        assert [t for t, _ in top] == row.topk(top_n).indices.tolist()
        assert all(abs(v - float(row[t])) < TOL for t, v in top)
        assert top[0][0] == tok  # greedy picks the most likely
        assert [t for t, _ in tids] == [7, 11] and all(abs(v - float(row[t])) < TOL for t, v in tids)
    first = outs[0].extras["logprobs"]
    inputs = first.input
    assert first.input_start == max(start, 1)
    assert [e[0] for e in inputs] == prompt[max(start, 1) :]
    for k, (tok, lp, _, _) in enumerate(inputs):
        assert abs(lp - float(ref[max(start, 1) + k - 1, tok])) < TOL
    assert abs(first.normalized_prompt_logprob - sum(e[1] for e in inputs) / len(inputs)) < 1e-5


@pytest.mark.parametrize("mode", ["normal", "overlap"])
def test_smollm2_logprobs_match_transformers(mode, smol_dir, hf_smol, hf_tokenizer):
    client = SyncClient(
        ServerArgs(dtype="float32", loop=mode, kv_cache_tokens=2048, max_running_requests=4), smol_dir
    )
    try:
        for text, start in (("The capital of France is", 0), ("def add(a, b):\n    return", 3)):
            check_against_reference(client, hf_smol, hf_tokenizer.encode(text), start=start)
    finally:
        client.close()


def test_tiny_model_logprobs_match_transformers(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    client = SyncClient(
        ServerArgs(dtype="float32", kv_cache_tokens=1024, max_running_requests=4), tiny_qwen2_dir
    )
    try:
        check_against_reference(client, hf, [5, 9, 200, 3000, 17, 42], start=0, top_n=5)
    finally:
        client.close()


def test_logprobs_are_raw_whatever_the_sampling(smol_dir, hf_smol):
    """Temperature and penalties change the sampling, not the reported logprobs."""
    client = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=1024, max_running_requests=4), smol_dir)
    prompt = [1, 504, 3458, 282, 4649, 314]
    try:
        outs = client.generate(
            [prompt],
            SamplingParams(
                temperature=1.5, repetition_penalty=1.5, seed=3, max_new_tokens=8, ignore_eos=True
            ),
            [{"logprobs": dict(return_logprob=True)}],
        )[0]
    finally:
        client.close()
    ids = collect(outs)[0]
    ref = hf_logprobs(hf_smol, prompt + ids)
    for k, (tok, lp, _, _) in enumerate(output_entries(outs)):
        assert abs(lp - float(ref[len(prompt) - 1 + k, tok])) < TOL


def test_top_logprobs_ties_order_by_token_id():
    from features.logprobs import LogprobsFeature

    lp = torch.log_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]]), dim=-1)
    out = LogprobsFeature._values(lp, torch.tensor([1]), 4, None)
    assert out.top_ids is not None and out.top_vals is not None
    assert out.top_ids.tolist() == [[1, 2, 4, 5]]
    assert out.top_vals[0, 0] == out.top_vals[0, 2] > out.top_vals[0, 3]


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    with grpc_client(tiny_llama_dir, kv_cache_tokens=2048, max_running_requests=8) as (c, _):
        yield c


PROMPT = [5, 6, 7, 8, 9]
SIX = Sampling(max_new_tokens=6, temperature=0, ignore_eos=True)


def test_grpc_logprob_fields_and_stream(client):
    asked = Logprobs(top=2, token_ids=[3, 4], input_from=0)
    whole = client.generate(PROMPT, SIX, logprobs=asked)
    assert [e.token_id for e in whole.logprobs] == whole.token_ids
    assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in whole.logprobs)
    assert all([t.token_id for t in e.asked] == [3, 4] for e in whole.logprobs)
    assert [e.token_id for e in whole.input_logprobs] == [6, 7, 8, 9] and whole.input_logprobs_start == 1
    assert math.isclose(
        whole.normalized_prompt_logprob, sum(e.logprob for e in whole.input_logprobs) / 4, rel_tol=1e-5
    )
    with client.stream(PROMPT, SIX, logprobs=asked) as s:
        parts = list(s)
    assert [e.token_id for p in parts for e in p.logprobs] == whole.token_ids
    assert [e.logprob for p in parts for e in p.logprobs] == pytest.approx(
        [e.logprob for e in whole.logprobs], abs=1e-5
    )
    assert len(parts[0].input_logprobs) == 4 and all(len(p.input_logprobs) == 0 for p in parts[1:])
    plain = client.generate(PROMPT, SIX)
    assert plain.token_ids == whole.token_ids and not plain.logprobs


@pytest.mark.parametrize("start, n_inputs", [(0, 4), (1, 4), (4, 1)])
def test_logprob_start_len_edges(client, start, n_inputs):
    r = client.generate(
        PROMPT, max_new_tokens=2, temperature=0, logprobs=Logprobs(input_from=start, output=False)
    )
    assert len(r.input_logprobs) == n_inputs and r.input_logprobs_start == max(start, 1)
    assert not r.logprobs  # only input logprobs were asked for


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logprob_start_len=5), "logprob_start_len"),
        (dict(logprob_start_len=-2), "logprob_start_len"),
        (dict(top_logprobs_num=21), "top_logprobs_num"),
        (dict(top_logprobs_num=-1), "top_logprobs_num"),
        (dict(token_ids_logprob=[49152]), "token_ids_logprob"),
    ],
)
def test_bad_logprob_arguments(client, kw, field):
    # the raw stub, to send values the client's types would not build
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(
            pb2.GenerateRequest(
                token_ids=pb2.TokenIds(ids=PROMPT), sampling=pb2.SamplingParams(max_new_tokens=2), **kw
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
