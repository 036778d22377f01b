"""The feature-module framework: per-batch fallback, policies, switches, matrix."""

from __future__ import annotations

import dataclasses
import json
import random

import grpc
import pytest

from features.registry import render_matrix_markdown
from features.testing import BanTokensFeature, fake_features
from service.config import ServerArgs
from service.core.feature import OverlapSupport
from service.core.request import RequestError, SamplingParams
from service.engine.engine import SyncClient, collect
from service.engine.modules import builtin_features
from service.matrix import README, readme_with_matrix
from service.server import BackgroundServer
from tests.feature_workloads import CELL_ARGS, MODELS, PROMPTS, SERVER_ARGS, WORKLOADS
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

# Engine-level modules (per_request = False, e.g. the prefix cache) have their own equivalence tests.
ALL_FEATURES = [f for f in builtin_features() if f.per_request] + [
    f for f in fake_features() if f.name in WORKLOADS
]


def feature_workload(name: str, n: int = 16, seed: int = 0):
    rng = random.Random(seed)
    prompts, params, feats = [], [], []
    for i in range(n):
        prompts.append([rng.randrange(3, 49000) for _ in range(rng.randrange(2, 24))])
        params.append(
            SamplingParams(
                temperature=0 if i % 2 else 0.8, seed=i, max_new_tokens=rng.randrange(4, 24), ignore_eos=True
            )
        )
        payload = WORKLOADS[name](i)
        feats.append({name: payload} if payload is not None else None)
        if payload is not None and name in PROMPTS:
            prompts[-1] = PROMPTS[name](payload, prompts[-1])
    return prompts, params, feats


def assert_close(a, b, path="extras"):
    """Nested outputs equal, floats within float32 tolerance (overlap vs normal)."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), f"{path}: {a} != {b}"
    elif dataclasses.is_dataclass(a):  # a feature's result fields
        assert type(a) is type(b), f"{path}: {a!r} != {b!r}"
        for f in dataclasses.fields(a):
            if f.compare:
                assert_close(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def extras_of(outs):
    return [[o.extras for o in req_outs] for req_outs in outs]


def run(model_dir, prompts, params, feats, **args):
    client = SyncClient(
        ServerArgs(
            **{
                "dtype": "float32",
                "loop": "overlap",
                "kv_cache_tokens": 3000,
                "max_running_requests": 12,
                **args,
            }
        ),
        model_dir,
        features=fake_features(),
    )
    try:
        outs = client.generate(prompts, params, feats)
        e = client.engine
        assert e.kv_all_free()
        return (
            [collect(o)[0] for o in outs],
            [o for o in outs],
            {r.feature: r for r in e.features.matrix()},
            e.mode,
        )
    finally:
        client.close()


@pytest.fixture(scope="module")
def references(tiny_llama_dir, request):
    """Normal-loop outputs of each feature's workload: what every cell must equal."""
    refs = {}
    for f in ALL_FEATURES:
        model_dir = request.getfixturevalue(MODELS[f.name]) if f.name in MODELS else tiny_llama_dir
        ids, outs, _, _ = run(
            model_dir, *feature_workload(f.name), disable_overlap=True, **SERVER_ARGS.get(f.name, {})
        )
        refs[f.name] = (ids, extras_of(outs))
    return refs


def test_every_registered_feature_has_a_matrix_workload():
    missing = [f.name for f in builtin_features() if f.per_request and f.name not in WORKLOADS]
    assert not missing, f"add workloads for {missing} to tests/feature_workloads.py"


@pytest.mark.parametrize("policy", ["per-batch", "global", "strict"])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
@pytest.mark.parametrize("feature", [f.name for f in ALL_FEATURES])
def test_matrix_cell(feature, loop, policy, tiny_llama_dir, references, request):
    f = next(x for x in ALL_FEATURES if x.name == feature)
    if feature in MODELS:
        tiny_llama_dir = request.getfixturevalue(MODELS[feature])  # the model this feature's cells run on
    others = [x.name for x in fake_features() if x.name != feature]  # the cell's feature alone is enabled
    args = dict(
        loop=loop,
        overlap_policy=policy,
        disabled_features=others,
        **SERVER_ARGS.get(feature, {}),
        **CELL_ARGS.get(feature, {}),
    )
    if loop == "overlap" and policy == "strict" and f.support is not OverlapSupport.FULL:
        with pytest.raises(ValueError, match=feature):
            run(tiny_llama_dir, *feature_workload(feature), **args)
        return
    ids, outs, matrix, mode = run(tiny_llama_dir, *feature_workload(feature), **args)
    assert ids == references[feature][0]
    assert_close(extras_of(outs), references[feature][1])
    row = matrix[feature]
    if loop == "normal" or (policy == "global" and f.support is not OverlapSupport.FULL):
        assert (
            mode == "normal"
            and row.batches_normal_loop > 0
            and row.batches_overlapped == row.batches_fallback == 0
        )
    elif f.support is OverlapSupport.FULL:
        assert mode == "overlap" and row.batches_overlapped > 0 and row.batches_fallback == 0
    else:
        assert mode == "overlap" and row.batches_fallback > 0 and row.batches_overlapped == 0


def test_mixed_batch_features_and_plain_requests(tiny_llama_dir):
    """One workload mixing all three test features and plain requests in the same batches."""
    prompts, params, _ = feature_workload("test_full", 24, seed=3)
    feats = []
    for i in range(24):
        d = {
            name: WORKLOADS[name](i)
            for name in ("test_full", "test_sync", "test_none")
            if WORKLOADS[name](i) is not None
        }
        feats.append(d or None)
    ref = run(tiny_llama_dir, prompts, params, feats, disable_overlap=True)[0]
    ids, outs, matrix, mode = run(tiny_llama_dir, prompts, params, feats)
    assert mode == "overlap" and ids == ref
    assert matrix["test_none"].batches_fallback > 0
    # The plain requests equal their solo output.
    plain = [i for i, f in enumerate(feats) if f is None]
    solo = run(tiny_llama_dir, [prompts[i] for i in plain], [params[i] for i in plain], [None] * len(plain))[
        0
    ]
    assert [ids[i] for i in plain] == solo
    # The full feature's per-row outputs reach the client.
    i = next(i for i, f in enumerate(feats) if f and "test_full" in f)
    steps = [o.extras["test_full"].step for o in outs[i] if "test_full" in o.extras]
    assert steps == list(range(1, len(ids[i]) + 1))


class FailingLaunchHook(BanTokensFeature):
    name = "test_failing"

    def after_launch(self, batch, rows):
        raise RuntimeError("injected hook failure")


def test_failing_feature_hook_fails_its_batch_and_frees_everything(tiny_llama_dir):
    """Regression: an exception right after a launch leaked the batch's future-map slots."""
    client = SyncClient(
        ServerArgs(dtype="float32", loop="overlap", kv_cache_tokens=2000, max_running_requests=4),
        tiny_llama_dir,
        features=[FailingLaunchHook()],
    )
    try:
        bad = client.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), [{"test_failing": [1]}])[0]
        assert bad[-1].finish_reason.value == "error" and "injected hook failure" in bad[-1].error
        good = client.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4))[0]
        assert good[-1].finish_reason.value == "length"
        e = client.engine
        fm = e.scheduler.overlap_worker.future_map
        assert fm.free_count == fm.size and e.kv_all_free()
    finally:
        client.close()


def test_fallback_is_visible_in_the_trace(tiny_llama_dir, tmp_path):
    trace = tmp_path / "t.json"
    prompts, params, feats = feature_workload("test_none", 8)
    run(tiny_llama_dir, prompts, params, feats, trace_file=str(trace))
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert any("fallback: test_none" in n for n in names) and any(
        n.startswith("sync point [test_none]") for n in names
    )
    assert any(n == "forward decode" for n in names)  # and plain batches overlapped


def test_disabled_and_unavailable_features_are_refused(tiny_llama_dir):
    client = SyncClient(
        ServerArgs(
            dtype="float32", kv_cache_tokens=1000, max_running_requests=4, disabled_features=["test_full"]
        ),
        tiny_llama_dir,
        features=fake_features(),
    )
    try:
        with pytest.raises(RequestError) as e:
            client.submit("a", [5, 6], SamplingParams(max_new_tokens=2), {"test_full": [1]})
        assert e.value.code == "FAILED_PRECONDITION" and "test_full" in e.value.message
        with pytest.raises(RequestError) as e:
            client.submit("b", [5, 6], SamplingParams(max_new_tokens=2), {"test_unavailable": 1})
        assert e.value.code == "FAILED_PRECONDITION" and "vision" in e.value.message
        with pytest.raises(RequestError) as e:
            client.submit("c", [5, 6], SamplingParams(max_new_tokens=2), {"nope": 1})
        assert e.value.code == "INVALID_ARGUMENT"
        rows = {r.feature: r for r in client.engine.features.matrix()}
        assert not rows["test_full"].enabled and not rows["test_unavailable"].available
    finally:
        client.close()
    with pytest.raises(ValueError, match="unknown feature"):
        SyncClient(ServerArgs(dtype="float32", disabled_features=["nope"]), tiny_llama_dir)


def test_get_feature_matrix_rpc(tiny_llama_dir):
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            loop="overlap",
            model=str(tiny_llama_dir),
            port=0,
            kv_cache_tokens=1000,
            max_running_requests=4,
            disabled_features=["test_sync"],
        ),
        features=fake_features(),
    )
    try:
        with grpc.insecure_channel(srv.address) as ch:
            m = pb2_grpc.GenerationStub(ch).GetFeatureMatrix(pb2.GetFeatureMatrixRequest())
        rows = {r.feature: r for r in m.rows}
        assert m.overlap_policy == "per-batch" and m.scheduler_mode == "overlap"
        assert (
            rows["test_none"].overlap_support == "none" and rows["test_sync"].overlap_support == "sync point"
        )
        assert not rows["test_sync"].enabled and rows["test_full"].reason
        assert (
            not rows["test_unavailable"].available and "vision" in rows["test_unavailable"].unavailable_reason
        )
    finally:
        srv.stop()


def test_readme_matrix_is_current():
    text = README.read_text()
    assert readme_with_matrix(text, render_matrix_markdown(builtin_features())) == text, (
        "README.md's feature matrix is stale: run `python -m service matrix --write-readme`"
    )
