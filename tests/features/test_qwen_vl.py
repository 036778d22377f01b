"""Qwen2.5-VL / Qwen2-VL on tiny random models: dynamic resolution, M-RoPE, equal to transformers,
chunked / cached / retracted / overlapped runs equal to plain ones."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from features.multimodal import ImageInputs, ImageSplices
from service.config import ServerArgs
from service.core.request import RequestError, SamplingParams
from service.engine.engine import SyncClient, collect
from tests.conftest import TOKENIZER_FILES
from tests.features.test_multimodal import BAD_IMAGES, draw
from tests.helpers import need_triton

MM = "multimodal"
VISION_START, IMAGE_PAD, VISION_END = 49152, 49153, 49154
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)  # the interpreted Triton kernels

# Two Qwen2.5-VL towers: 8-pixel patches, windows of 32 pixels (2x2 merged units), full attention at
# blocks 1 and 3; 4-pixel patches, windows of 16, full attention at block 2 only, another M-RoPE
# split. And a Qwen2-VL tower (full attention everywhere, LayerNorm + GELU MLP).
CONFIGS = {
    "p8-w32": dict(patch=8, window=32, fullatt=[1, 3], depth=4, mrope=[2, 3, 3], max_pixels=96 * 96),
    "p4-w16": dict(patch=4, window=16, fullatt=[2], depth=3, mrope=[4, 2, 2], max_pixels=40 * 40),
    "qwen2-vl": dict(patch=8, depth=2, mrope=[2, 3, 3], max_pixels=64 * 64, qwen2=True),
}


def hf_class(model_dir: Path):
    import json

    import transformers

    return getattr(transformers, json.loads((model_dir / "config.json").read_text())["architectures"][0])


def make_tiny_qwen_vl(
    smol: Path, out: Path, patch: int, depth: int, mrope, max_pixels: int, window=0, fullatt=(), qwen2=False
) -> Path:
    """A random-init Qwen2.5-VL (or Qwen2-VL): SmolLM2's tokenizer plus the three vision tokens, a
    Pillow Qwen2-VL image processor (min 2 merged units, max `max_pixels`)."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    common = dict(patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, depth=depth, num_heads=4)
    if qwen2:
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(
            common,
            hidden_size=32,
            intermediate_size=64,
            window_size=window,
            out_hidden_size=64,
            fullatt_block_indexes=list(fullatt),
        )
    cfg = config_class(
        vision_config=vision,
        text_config=dict(
            vocab_size=VISION_END + 1,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
            tie_word_embeddings=False,
            initializer_range=0.2,
            eos_token_id=2,
            bos_token_id=1,
        ),
        image_token_id=IMAGE_PAD,
        video_token_id=VISION_END + 10,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    model = model_class(cfg)
    with torch.no_grad():  # large enough that the image changes the output
        for p in model.model.visual.merger.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]}
    )
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD
    tok.save_pretrained(out)
    unit = (patch * 2) ** 2
    Qwen2VLImageProcessorPil(
        min_pixels=2 * unit, max_pixels=max_pixels, patch_size=patch, merge_size=2, temporal_patch_size=2
    ).save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def qwen_dir(request, smol_dir, tmp_path_factory) -> Path:
    return make_tiny_qwen_vl(
        smol_dir, tmp_path_factory.mktemp(f"qwen-vl-{request.param}"), **CONFIGS[request.param]
    )


@pytest.fixture(scope="module")
def tok(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


IMAGES = [draw(64, 48, 1), draw(40, 90, 2, "JPEG"), draw(200, 37, 3, "WEBP"), draw(33, 33, 4)]
CASES = [
    ("Just text, no picture at all", []),
    (f"A picture: {IMG} What is it?", [IMAGES[0]]),
    (f"Tall {IMG} then wide {IMG} compare them", [IMAGES[1], IMAGES[2]]),
    (f"{IMG}{IMG} two", [IMAGES[3], IMAGES[0]]),
]


def mm(*images: bytes) -> dict | None:
    return {MM: ImageInputs(tuple(images))} if images else None


def client(model_dir: Path, loop: str = "overlap", **kw) -> SyncClient:
    return SyncClient(
        ServerArgs(
            **{"dtype": "float32", "loop": loop, "kv_cache_tokens": 4000, "max_running_requests": 8, **kw}
        ),
        model_dir,
    )


def hf_inputs(model_dir: Path, tok, text: str, images: list[bytes]) -> dict:
    """transformers' processing: the Pillow image processor, image pads expanded by the grid."""
    from transformers import AutoImageProcessor

    ids = tok.encode(text)
    out: dict = {}
    if images:
        proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        px = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
        counts = iter((px["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for i in ids for t in ([IMAGE_PAD] * next(counts) if i == IMAGE_PAD else [i])]
        out = dict(px)
    input_ids = torch.tensor([ids])
    out.update(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE_PAD).int())
    return out


@pytest.fixture(scope="module")
def hf_model(qwen_dir):
    return hf_class(qwen_dir).from_pretrained(qwen_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(qwen_dir, tok, hf_model) -> list[list[int]]:
    """transformers' greedy tokens for CASES."""
    out = []
    for text, images in CASES:
        inp = hf_inputs(qwen_dir, tok, text, images)
        with torch.inference_mode():
            ids = hf_model.generate(
                **inp, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, pad_token_id=0
            )
        out.append(ids[0, inp["input_ids"].shape[1] :].tolist())
    return out


def run(c: SyncClient, cases=CASES, params: SamplingParams = GREEDY, tag: str = "r") -> list:
    """All requests in one scheduler command (they share batches): (ids, text, last output) each."""
    reqs = [
        c.engine.build_request(f"{tag}{i}", tok_ids, SamplingParams(**vars(params)), mm(*imgs))
        for i, (tok_ids, imgs) in enumerate(cases)
    ]
    for r in reqs:
        for fut in c.engine.features.pending(r):
            fut.result(timeout=60)
    c.engine.submit_all(reqs)
    return [collect(c.wait(r.rid)) for r in reqs]


def test_greedy_tokens_and_positions_equal_transformers(qwen_dir, tok, hf_model, reference):
    """0, 1 and 2 images of different sizes and aspect ratios in one batch (overlap loop); the
    positions the request carries equal get_rope_index; a second wave hits the prefix cache past
    the images (keyed by their hashes) and gives the same tokens; the images matter."""
    c = client(qwen_dir, max_image_pixels=1_000_000, max_image_bytes=60_000)
    try:
        cases = [(tok.encode(t), imgs) for t, imgs in CASES]
        first = run(c, cases)
        assert [ids for ids, _, _ in first] == reference
        for (text, images), (ids, imgs) in zip(CASES, cases):
            if not images:
                continue
            inp = hf_inputs(qwen_dir, tok, text, images)
            want, delta = hf_model.model.get_rope_index(
                inp["input_ids"], inp["mm_token_type_ids"], image_grid_thw=inp["image_grid_thw"]
            )
            req = c.engine.build_request("p", ids, SamplingParams(**vars(GREEDY)), mm(*imgs))
            rope = req.features[MM].rope
            n = len(req.prompt_ids)
            assert req.prompt_ids == inp["input_ids"][0].tolist()
            assert torch.equal(rope.offsets + torch.arange(n), want[:, 0]) and rope.delta == int(delta)
        again = run(c, cases, tag="again")
        assert [ids for ids, _, _ in again] == reference
        for (ids, imgs), (_, _, last) in zip(cases[1:], again[1:]):
            spans = (
                c.engine.build_request("s", ids, SamplingParams(**vars(GREEDY)), mm(*imgs)).features[MM].spans
            )
            assert last.cached_tokens >= spans[-1][0] + spans[-1][1]  # a hit past the last image
        other = run(c, [(cases[1][0], [IMAGES[3]])], tag="other")
        assert other[0][0] != reference[1]
        for data, why in BAD_IMAGES:  # refused before queueing, naming the image (the header's checks
            with pytest.raises(RequestError) as e:  # at admission, before any decoding)
                bad = c.engine.build_request(
                    "bad", cases[2][0], SamplingParams(**vars(GREEDY)), mm(IMAGES[0], data)
                )
                for fut in c.engine.features.pending(bad):
                    fut.result(timeout=60)
            assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith("images[1]: ")
            assert why in e.value.message
            assert why in e.value.message
        assert c.engine.kv_all_free()
    finally:
        c.close()


QWEN2_5 = pytest.mark.parametrize("qwen_dir", ["p8-w32", "p4-w16"], indirect=True)  # the windowed towers


@QWEN2_5
@pytest.mark.parametrize(
    "loop, args",
    [
        ("normal", dict(chunked_prefill_size=7, enable_mixed_chunk=True)),
        ("overlap", dict(chunked_prefill_size=7, enable_mixed_chunk=True, disable_prefix_cache=True)),
    ],
)
def test_chunked_prefill_through_images_equals_whole(loop, args, qwen_dir, tok, reference):
    """Chunks of 7 tokens cut through image spans (and the M-RoPE positions after them), mixed with
    running decodes; both loops."""
    c = client(qwen_dir, loop=loop, **args)
    try:
        assert [ids for ids, _, _ in run(c, [(tok.encode(t), imgs) for t, imgs in CASES])] == reference
        assert c.engine.kv_all_free()
    finally:
        c.close()


@QWEN2_5
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_retracted_image_requests_re_prefill_the_same(loop, qwen_dir, tok):
    """A tiny pool retracts image requests mid-decode; their re-prefill (prompt + kept tokens, at
    M-RoPE positions index + delta past the prompt) continues exactly as an ample pool's run."""
    cases = [(tok.encode(t), imgs) for t, imgs in CASES[1:]] * 3
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    ample = client(qwen_dir, loop=loop, disable_prefix_cache=True)
    try:
        want = [ids for ids, _, _ in run(ample, cases, params)]
    finally:
        ample.close()
    c = client(
        qwen_dir,
        loop=loop,
        kv_cache_tokens=160,
        disable_prefix_cache=True,
        chunked_prefill_size=0,
        init_new_token_ratio=0.15,
        min_new_token_ratio=0.05,
        new_token_ratio_decay_steps=5,
    )
    try:
        got = run(c, cases, params)
        assert [ids for ids, _, _ in got] == want
        assert any(
            "retraction" in last.extras and last.extras["retraction"].retractions for _, _, last in got
        )
        assert c.engine.kv_all_free()
    finally:
        c.close()


def test_exif_orientation_is_applied_like_load_image():
    """A phone's portrait JPEG (stored landscape, EXIF orientation 6) decodes upright, as transformers'
    load_image gives it, and its upright size is known from the header (Qwen-VL's token count)."""
    import numpy as np
    from transformers.image_utils import load_image

    from features.images import ImageLimits, decode, upright_size

    stored = Image.open(io.BytesIO(draw(60, 30, 7)))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", exif=exif.tobytes(), quality=95)
    data = buf.getvalue()
    got = decode(data, ImageLimits())
    want = load_image(Image.open(io.BytesIO(data)))
    assert got.size == want.size == (30, 60) == upright_size(data, ImageLimits())
    assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("qwen_dir", ["p8-w32"], indirect=True)
def test_images_ready_together_are_encoded_in_one_call(qwen_dir, tok):
    """While the vision thread is busy, the images prepared meanwhile queue up and go through the
    tower in one call (patches back to back); each keeps its own cache entry and its own output."""
    import threading

    c = client(qwen_dir)
    f = c.engine.features.features[MM]
    gate, calls, tower = threading.Event(), [], f.encoder

    def gated(patches, grids):
        gate.wait(60)
        calls.append(len(grids))
        return tower(patches, grids)

    f.encoder = gated
    try:
        cases = [(tok.encode(f"Picture {i}: {IMG} is"), [img]) for i, img in enumerate(IMAGES)]
        reqs = [
            c.engine.build_request(f"b{i}", ids, SamplingParams(**vars(GREEDY)), mm(*imgs))
            for i, (ids, imgs) in enumerate(cases)
        ]
        for r in reqs:  # all decoded and preprocessed; the first may already wait in the tower
            for fut in c.engine.features.pending(r):
                fut.result(timeout=60)
        c.engine.submit_all(reqs)
        gate.set()
        first = [collect(c.wait(r.rid))[0] for r in reqs]
        assert sum(calls) == len(IMAGES) and len(calls) <= 2 and f.encoder_calls == len(calls)
        assert len(f.cache) == len(IMAGES)
        assert [ids for ids, _, _ in run(c, cases, tag="again")] == first  # from the cache, one by one
        assert sum(calls) == len(IMAGES)
    finally:
        gate.set()
        c.close()


# ---- the device path (CUDA's code on CPU: tests/engine/test_device_path.py) ----------------------


@pytest.mark.parametrize("qwen_dir", ["p8-w32"], indirect=True)
@pytest.mark.parametrize(
    "loop, args", [("normal", dict(chunked_prefill_size=7, enable_mixed_chunk=True)), ("overlap", {})]
)
def test_forward_path_has_no_host_sync(loop, args, qwen_dir, tok):
    """Image splices and M-RoPE positions reach the model without a device -> host read: the offsets
    were computed at admission and sent with the batch (prompt chunks cut inside images, decodes at
    index + delta, mixed with running decodes)."""
    from tests.engine.test_device_path import watch_forward
    from tests.helpers import before_each_forward

    found: list[str] = []
    seen: list[tuple[str, bool, bool]] = []  # per forward: mode, image rows spliced, M-RoPE rows moved

    def note(fb) -> None:
        data = fb.feature_data.get(ImageSplices)
        seen.append(
            (fb.mode.value, bool(data and data.splices), data is not None and data.rope_rows is not None)
        )

    c = client(qwen_dir, loop=loop, disable_prefix_cache=True, **args)
    watch_forward(c, found)
    try:
        with before_each_forward(c.engine.worker, note):
            got = run(c, [(tok.encode(t), imgs) for t, imgs in CASES])
        assert all(last.error is None for _, _, last in got)
    finally:
        c.close()
    assert found == [], f"host syncs in the forward path: {sorted(set(found))}"
    assert ("extend", True, True) in seen and ("decode", False, True) in seen


@pytest.mark.parametrize("qwen_dir", ["p8-w32"], indirect=True)
def test_triton_backend_matches_torch(qwen_dir, tok):
    """The Triton kernels (interpreted on CPU) under M-RoPE: the same greedy tokens as the torch
    backend for prompts with 0, 1 and 2 images, in both loops."""
    need_triton()
    cases = [(tok.encode(t), imgs) for t, imgs in CASES[:3]]
    results = {}
    for backend, loop in (("torch", "normal"), ("triton", "normal"), ("triton", "overlap")):
        c = client(qwen_dir, loop=loop, attention_backend=backend)
        try:
            assert c.engine.worker.attention.name == backend
            results[(backend, loop)] = [ids for ids, _, _ in run(c, cases, SHORT)]
        finally:
            c.close()
    assert results[("triton", "normal")] == results[("torch", "normal")]
    assert results[("triton", "overlap")] == results[("torch", "normal")]


def submit_ready(c: SyncClient, cases, budgets: list[int]) -> list:
    """Requests with max_new_tokens budgets[i], submitted together once their images are encoded (so
    they are admitted in one step)."""
    reqs = [
        c.engine.build_request(
            f"g{i}", ids, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), mm(*imgs)
        )
        for i, ((ids, imgs), n) in enumerate(zip(cases, budgets))
    ]
    for r in reqs:
        payload = r.features.get(MM)
        for fut in payload.encoded if payload is not None else ():
            fut.result(timeout=60)
    c.engine.submit_all(reqs)
    return reqs


@pytest.mark.parametrize("qwen_dir", ["p8-w32"], indirect=True)
def test_decode_graphs_replay_only_plain_rope_steps(qwen_dir, tok):
    """CUDA's decode graphs (captured with plain RoPE) on CPU, their replays emulated: a decode step
    with image rows at index + delta runs eagerly; one of text rows and of an image request whose
    delta is 0 (a 1 x 2 strip) replays; the tokens equal the eager normal loop's."""
    from tests.engine.test_graph_safety import emulate_graphs
    from tests.helpers import before_each_forward

    strip = draw(32, 16, 5)  # one row of two merged units: its tokens take as many positions
    texts = [CASES[1][0], f"A strip {IMG} here", CASES[0][0]]
    cases = [(tok.encode(t), imgs) for t, imgs in zip(texts, ([IMAGES[0]], [strip], []))]
    results = {}
    for loop in ("normal", "overlap"):
        decodes: list[bool] = []
        c = client(qwen_dir, loop=loop, disable_prefix_cache=True)
        try:
            graphs = None
            if loop == "overlap":
                graphs = emulate_graphs(c.engine.worker, 8, c.engine.context_length, c.engine.vocab_size)
            with before_each_forward(c.engine.worker, lambda fb: decodes.append(fb.mode.value == "decode")):
                reqs = submit_ready(c, cases, [4, 8, 12])
                results[loop] = [collect(c.wait(r.rid))[0] for r in reqs]
            assert [r.features[MM].rope.delta != 0 for r in reqs[:2]] == [True, False]
            if graphs is not None:  # the image request's first 3 decodes (4 in overlap: one step late)
                assert 0 < graphs.replays <= sum(decodes) - 3
        finally:
            c.close()
    assert results["overlap"] == results["normal"]
