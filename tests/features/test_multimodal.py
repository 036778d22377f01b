"""Multimodal (image) input on a tiny random LLaVA: equal to transformers, overlapped, cached, refused cleanly."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from PIL import Image, ImageDraw

from features.multimodal import ImageInputs, image_hash
from service.config import ServerArgs
from service.core.forward_batch import ForwardMode
from service.core.request import FinishReason, Req, RequestError, SamplingParams
from service.engine.engine import SyncClient, collect
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.schedule_batch import ExtendRow, build_extend_batch
from service.models.backends import get_attention_backend
from service.server import BackgroundServer
from tests.conftest import TINY_LLAVA_IMAGE_TOKEN, make_tiny_llava
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

PER_IMAGE = 16  # (32 / 8) ** 2 patches, CLS dropped
MM = "multimodal"


def draw(w: int, h: int, seed: int, fmt: str = "PNG") -> bytes:
    """A picture with shapes whose colours and places depend on the seed."""
    img = Image.new("RGB", (w, h), ((seed * 41) % 256, (seed * 89 + 60) % 256, (200 - seed * 23) % 256))
    d = ImageDraw.Draw(img)
    d.ellipse((w // 5, h // 4, w * 3 // 4, h * 4 // 5), fill=(255 - seed * 50 % 255, seed * 90 % 255, 30))
    d.rectangle((w // 2, 0, w - 1, h // 3), fill=(seed * 70 % 256, 20, 220))
    d.line((0, h - 1, w - 1, 0), fill=(0, 255, 0), width=3)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


# Sizes and aspect ratios that need a resize (shortest edge 32) and a centre crop; three formats.
IMAGES = [
    draw(64, 48, 1),
    draw(40, 90, 2, "JPEG"),
    draw(100, 37, 3, "WEBP"),
    draw(32, 32, 4),
    draw(333, 200, 5),
]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def mm(*images: bytes) -> dict:
    return {MM: ImageInputs(tuple(images))}


@pytest.fixture(scope="module")
def tok(tiny_llava_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llava_dir)


def hf_reference(
    model_dir: Path, strategy: str, cases: list[tuple[str, list[bytes]]], n: int
) -> list[list[int]]:
    """transformers' LlavaProcessor + LlavaForConditionalGeneration.generate, fp32 greedy."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor

    proc = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model_dir, backend="pil"),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        patch_size=8,
        vision_feature_select_strategy=strategy,
        image_token="<image>",
        num_additional_image_tokens=1,
    )
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for text, images in cases:
        inp = proc(
            text=text, images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
        )
        with torch.inference_mode():
            ids = model.generate(**inp, max_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(ids[0, inp["input_ids"].shape[1] :].tolist())
    return out


def client(model_dir: Path, loop: str = "overlap", **kw) -> SyncClient:
    return SyncClient(
        ServerArgs(
            **{"dtype": "float32", "loop": loop, "kv_cache_tokens": 4000, "max_running_requests": 8, **kw}
        ),
        model_dir,
    )


CASES = [
    ("A picture: <image> What is it?", [IMAGES[0]]),
    ("<image>Describe.", [IMAGES[1]]),
    ("Wide <image> then tall <image> compare them", [IMAGES[2], IMAGES[1]]),
    ("Two: <image><image>", [IMAGES[3], IMAGES[4]]),
]


@pytest.mark.parametrize("variant", ["default", "full-multilayer"])
def test_greedy_tokens_equal_transformers(variant, tiny_llava_dir, smol_dir, tmp_path, tok):
    """One and two images per prompt, resize + crop, PNG / JPEG / WebP; both select strategies,
    one and several feature layers, biased and bias-free projectors, tied and untied heads."""
    if variant == "default":
        model_dir, strategy = tiny_llava_dir, "default"
    else:
        model_dir, strategy = (
            make_tiny_llava(
                smol_dir,
                tmp_path / "llava-full",
                feature_layer=[-3, -1],
                strategy="full",
                act="silu",
                projector_bias=False,
                tie=True,
            ),
            "full",
        )
    ref = hf_reference(model_dir, strategy, CASES, 8)
    c = client(model_dir, loop="overlap" if variant == "default" else "normal")
    try:
        outs = c.generate([tok.encode(t) for t, _ in CASES], GREEDY, [mm(*imgs) for _, imgs in CASES])
        assert [collect(o)[0] for o in outs] == ref
        assert all(
            o[-1].prompt_tokens == len(tok.encode(t)) + len(imgs) * (PER_IMAGE - 1 + (strategy == "full"))
            for o, (t, imgs) in zip(outs, CASES)
        )
        # The images matter: the same prompt with other images gives other tokens.
        other = c.generate([tok.encode(CASES[0][0])], GREEDY, [mm(IMAGES[4])])
        assert collect(other[0])[0] != ref[0]
        assert c.engine.kv_all_free()
    finally:
        c.close()


def mixed_workload(tok):
    """Text-only and image requests, submitted together so that they share batches."""
    prompts, feats = [], []
    for i in range(8):
        if i % 3 == 0:
            prompts.append(tok.encode(f"Picture {i}: <image> says"))
            feats.append(mm(IMAGES[i % len(IMAGES)]))
        else:
            prompts.append(tok.encode(f"Plain text request number {i} about" + " cats" * i))
            feats.append(None)
    return prompts, feats


def run_together(c: SyncClient, prompts, feats, params=GREEDY) -> list[list[int]]:
    reqs = [
        c.engine.build_request(f"r{i}", p, SamplingParams(**vars(params)), f)
        for i, (p, f) in enumerate(zip(prompts, feats))
    ]
    c.engine.submit_all(reqs)
    return [collect(c.wait(r.rid))[0] for r in reqs]


def test_text_and_image_requests_share_batches_overlap_equals_normal(tiny_llava_dir, tok):
    prompts, feats = mixed_workload(tok)
    results, matrix = {}, {}
    for loop in ("normal", "overlap"):
        c = client(tiny_llava_dir, loop=loop)
        try:
            results[loop] = run_together(c, prompts, feats)
            matrix[loop] = {r.feature: r for r in c.engine.features.matrix()}[MM]
            if loop == "overlap":  # text rows equal their solo runs
                text = [i for i, f in enumerate(feats) if f is None]
                solo = c.generate([prompts[i] for i in text], GREEDY)
                assert [collect(o)[0] for o in solo] == [results[loop][i] for i in text]
            assert c.engine.kv_all_free()
        finally:
            c.close()
    assert results["overlap"] == results["normal"]
    assert matrix["overlap"].available and matrix["overlap"].overlap_support == "full"
    assert matrix["overlap"].batches_overlapped > 0 and matrix["overlap"].batches_fallback == 0
    assert matrix["normal"].batches_normal_loop > 0


def test_repeated_image_hits_the_encoder_cache(tiny_llava_dir, tok):
    c = client(tiny_llava_dir)
    f = c.engine.features.features[MM]
    try:
        prompt = tok.encode("Same: <image> and <image>")
        first = collect(c.generate([prompt], GREEDY, [mm(IMAGES[2], IMAGES[2])])[0])[0]
        assert f.encoder_runs == 1  # the same bytes twice in one request: one encode
        hits = f.cache.hits
        again = collect(c.generate([prompt], GREEDY, [mm(IMAGES[2], IMAGES[2])])[0])[0]
        assert again == first and f.encoder_runs == 1 and f.cache.hits == hits + 2
        # Different bytes of the same picture are a different image to every cache.
        png, jpeg = draw(50, 50, 9), draw(50, 50, 9, "JPEG")
        reqs = [
            c.engine.build_request(f"h{i}", tok.encode("<image>"), SamplingParams(**vars(GREEDY)), mm(b))
            for i, b in enumerate((png, jpeg))
        ]
        hashes = [r.features[MM].image_hashes[0] for r in reqs]
        assert hashes == [image_hash(png), image_hash(jpeg)] and hashes[0] != hashes[1]
        assert [r.features[MM].spans for r in reqs] == [((0, PER_IMAGE),)] * 2
    finally:
        c.close()


def _truncated_png() -> bytes:
    data = draw(64, 64, 7)
    return data[: len(data) // 2]


def _gif() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    return buf.getvalue()


def _huge_header_png() -> bytes:  # 4000 x 4000 pixels, tiny file: refused from its header
    buf = io.BytesIO()
    Image.new("1", (4000, 4000)).save(buf, format="PNG")
    return buf.getvalue()


BAD_IMAGES = [
    (b"not an image at all", "not a PNG, JPEG or WebP"),
    (_truncated_png(), "truncated"),
    (_gif(), "unsupported image format GIF"),
    (_huge_header_png(), "--max-image-pixels"),
    (b"\x89PNG" + b"x" * 70_000, "--max-image-bytes"),
    (b"", "empty image data"),
]


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_bad_images_fail_only_their_request(loop, tiny_llava_dir, tok):
    """INVALID_ARGUMENT naming the image's index; a good request in the same batch is unaffected."""
    c = client(tiny_llava_dir, loop=loop, max_image_pixels=1_000_000, max_image_bytes=60_000)
    try:
        good = tok.encode("Good: <image> ok")
        ref = collect(c.generate([good], GREEDY, [mm(IMAGES[0])])[0])[0]
        for bad, why in BAD_IMAGES:
            feats = [mm(IMAGES[0]), mm(IMAGES[1], bad)]
            prompts = [good, tok.encode("<image> then <image>")]
            try:
                reqs = [
                    c.engine.build_request(f"{loop}-{i}-{why}", p, SamplingParams(**vars(GREEDY)), f)
                    for i, (p, f) in enumerate(zip(prompts, feats))
                ]
            except RequestError as e:  # refused while validating (cheap checks): before any work
                assert e.code == "INVALID_ARGUMENT" and "images[1]" in e.message and why in e.message
                continue
            c.engine.submit_all(reqs)
            outs = [c.wait(r.rid) for r in reqs]
            assert collect(outs[0])[0] == ref
            last = outs[1][-1]
            assert last.finish_reason is FinishReason.ERROR and last.error_code == "INVALID_ARGUMENT"
            assert last.error.startswith("images[1]: ") and why in last.error, last.error
        with pytest.raises(RequestError, match="2 image placeholder token.*1 image"):
            c.engine.build_request("mismatch", tok.encode("<image><image>"), GREEDY, mm(IMAGES[0]))
        with pytest.raises(RequestError, match="1 image placeholder token.*0 image"):
            c.engine.build_request("no-images", tok.encode("<image>"), GREEDY)
        assert c.engine.kv_all_free()
    finally:
        c.close()


def test_text_only_model_reports_multimodal_unavailable(tiny_llama_dir):
    """The matrix says why; image requests get FAILED_PRECONDITION (in-process and over gRPC)."""
    server = BackgroundServer(
        ServerArgs(
            model=str(tiny_llama_dir), port=0, dtype="float32", kv_cache_tokens=1000, max_running_requests=4
        )
    )
    try:
        with pytest.raises(RequestError) as e:
            server.engine.build_request("x", [5, 6, 7], GREEDY, mm(IMAGES[0]))
        assert e.value.code == "FAILED_PRECONDITION" and "text-only" in e.value.message
        with grpc.insecure_channel(server.address) as chan:
            stub = pb2_grpc.GenerationStub(chan)
            row = {r.feature: r for r in stub.GetFeatureMatrix(pb2.GetFeatureMatrixRequest()).rows}[MM]
            assert not row.available and "text-only" in row.unavailable_reason
            sp = pb2.SamplingParams(max_new_tokens=3, temperature=0)
            chat = pb2.ChatInput(
                messages=[
                    pb2.ChatMessage(
                        role="user", parts=[pb2.ContentPart(text="hi"), pb2.ContentPart(image=IMAGES[0])]
                    )
                ]
            )
            for req in (
                pb2.GenerateRequest(text="a <image>", images=[IMAGES[0]], sampling=sp),
                pb2.GenerateRequest(chat=chat, sampling=sp),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Generate(req)
                assert (
                    err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    and "text-only" in err.value.details()
                )
            assert (
                len(stub.Generate(pb2.GenerateRequest(text="a <image>", sampling=sp)).token_ids) == 3
            )  # text as usual
    finally:
        server.stop()


def test_chunk_boundary_inside_an_image_span(tiny_llava_dir, tok):
    """Two extends whose boundary falls inside the image's span give the logits of one extend."""
    c = client(tiny_llava_dir, loop="normal")
    try:
        e = c.engine
        feature = e.features.features[MM]
        model, s = e.model, e.model.shape
        prompt = e.features.expand_prompt(mm(IMAGES[2], IMAGES[0]), tok.encode("See <image> and <image> now"))
        payload = feature.validate(ImageInputs((IMAGES[2], IMAGES[0])), e, prompt)
        embeds = [f.result(timeout=60) for f in payload.encoded]
        (a, _), (b, _) = payload.spans
        attention = get_attention_backend("torch")

        def new_req(slot: int) -> Req:
            r = Req(f"c{slot}", prompt, GREEDY, 0, None, frozenset(), {MM: payload})  # type: ignore[arg-type]
            r.slot, r.feature_state[MM] = slot, embeds
            return r

        def logits(batch, kv):
            batch.fb.features = [(feature, list(range(len(batch.reqs))))]
            feature.on_batch_formed(batch, list(range(len(batch.reqs))))
            with torch.inference_mode():
                return model(batch.fb, batch.fb.input_ids, kv, attention).float()

        kv = TokenToKVPool(1024, s.num_layers, s.num_kv_heads, s.head_dim, torch.float32)
        table = ReqToTokenPool(4, 512)
        whole = logits(build_extend_batch([new_req(0)], table, kv, s.vocab_size), kv)
        for cuts in (
            [a + 5],
            [a + 3, b + 9],
            [b + 1],
        ):  # inside the first span, both spans, the second span's start
            kv = TokenToKVPool(1024, s.num_layers, s.num_kv_heads, s.head_dim, torch.float32)
            table = ReqToTokenPool(4, 512)
            r = new_req(1)
            edges = [0, *cuts, len(prompt)]
            for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
                batch = build_extend_batch(
                    [r],
                    table,
                    kv,
                    s.vocab_size,
                    rows=[ExtendRow(r, prompt[lo:hi], prefix_len=lo, new_slot=i == 0)],
                )
                assert batch.fb.mode is ForwardMode.EXTEND
                out = logits(batch, kv)
            torch.testing.assert_close(out[:1], whole[:1], atol=1e-4, rtol=1e-4)
    finally:
        c.close()


LLAVA_STYLE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_chat_parts_follow_the_chat_template(tiny_llava_dir, tmp_path):
    """A template that renders content parts (LLaVA's) places the images itself; a text-only
    template gets the parts joined with the image placeholder where each image is; a processor's
    chat_template.json is used when the tokenizer has none."""
    from service.tokenizer import Tokenizer

    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hi "},
                {"type": "image"},
                {"type": "text", "text": "what?"},
            ],
        }
    ]
    t = Tokenizer(tiny_llava_dir)
    assert "Hi <image>what?" in t.render_chat(parts)  # SmolLM2's template renders strings only
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llava_dir / f, tmp_path / f)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_STYLE_TEMPLATE}))
    t = Tokenizer(tmp_path)
    assert t.has_chat_template and t.render_chat(parts) == "USER: Hi <image>\nwhat?ASSISTANT:"


@pytest.fixture(scope="module")
def llava_server(tiny_llava_dir):
    server = BackgroundServer(
        ServerArgs(
            model=str(tiny_llava_dir),
            port=0,
            dtype="float32",
            loop="overlap",
            kv_cache_tokens=4000,
            max_running_requests=8,
        )
    )
    yield server
    server.stop()


def test_grpc_chat_with_images_tokenize_and_errors(llava_server, tok):
    chan = grpc.insecure_channel(llava_server.address)
    stub = pb2_grpc.GenerationStub(chan)
    sp = pb2.SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    chat = pb2.ChatInput(
        messages=[
            pb2.ChatMessage(
                role="user",
                parts=[
                    pb2.ContentPart(text="What is in "),
                    pb2.ContentPart(image=IMAGES[0]),
                    pb2.ContentPart(text=" and "),
                    pb2.ContentPart(image=IMAGES[2]),
                    pb2.ContentPart(text="?"),
                ],
            )
        ]
    )
    # Tokenize returns the expanded ids: the template's text with each image's run of image tokens.
    expected_text = tok.apply_chat_template(
        [{"role": "user", "content": "What is in <image> and <image>?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    tk = stub.Tokenize(pb2.TokenizeRequest(chat=chat))
    assert tk.text == expected_text
    ids = list(tk.token_ids)
    assert ids.count(TINY_LLAVA_IMAGE_TOKEN) == 2 * PER_IMAGE
    assert len(ids) == len(tok.encode(expected_text, add_special_tokens=False)) + 2 * (PER_IMAGE - 1)
    by_chat = stub.Generate(pb2.GenerateRequest(chat=chat, sampling=sp))
    # The same prompt as expanded token ids (or text with placeholders) + images gives the same tokens.
    by_ids = stub.Generate(
        pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=ids), images=[IMAGES[0], IMAGES[2]], sampling=sp)
    )
    assert list(by_chat.token_ids) == list(by_ids.token_ids) and len(by_chat.token_ids) == 6
    assert by_chat.usage.prompt_tokens == len(ids)
    streamed = [
        t for m in stub.GenerateStream(pb2.GenerateRequest(chat=chat, sampling=sp)) for t in m.token_ids
    ]
    assert streamed == list(by_chat.token_ids)
    tk_text = stub.Tokenize(pb2.TokenizeRequest(text="<image> hi", images=[IMAGES[1]]))
    assert list(tk_text.token_ids)[:PER_IMAGE] == [TINY_LLAVA_IMAGE_TOKEN] * PER_IMAGE
    # Bad input: INVALID_ARGUMENT naming the image, before the request is queued.
    for req, match in [
        (
            pb2.GenerateRequest(
                text="a <image> b <image>", images=[IMAGES[0], _truncated_png()], sampling=sp
            ),
            "images[1]: ",
        ),
        (pb2.GenerateRequest(text="a <image>", images=[IMAGES[0], IMAGES[1]], sampling=sp), "2 image(s)"),
        (pb2.GenerateRequest(chat=chat, images=[IMAGES[0]], sampling=sp), "chat.messages[].parts"),
        (
            pb2.GenerateRequest(text="x <image>" * 9, images=[IMAGES[0]] * 9, sampling=sp),
            "--max-images-per-request",
        ),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details(), (
            e.value.details()
        )
    rows = {r.feature: r for r in stub.GetFeatureMatrix(pb2.GetFeatureMatrixRequest()).rows}
    assert rows[MM].available and rows[MM].batches_overlapped > 0
    assert stub.GetModelInfo(pb2.GetModelInfoRequest()).architecture == "LlavaForConditionalGeneration"
    chan.close()


def test_bfloat16_engine_serves_images(tiny_llava_dir, tok):
    """Vision tower and projector run in the model's dtype; their output is close to float32's."""
    from service.models.llava import load_vision_encoder
    from service.models.loader import load_config

    px = torch.randn(2, 3, 32, 32)
    cfg = load_config(tiny_llava_dir)
    full = load_vision_encoder(tiny_llava_dir, cfg, torch.float32, "cpu")(px)
    half = load_vision_encoder(tiny_llava_dir, cfg, torch.bfloat16, "cpu")(px.bfloat16())
    assert half.dtype is torch.bfloat16
    assert ((half.float() - full).norm() / full.norm()).item() < 0.02
    c = client(tiny_llava_dir, dtype="bfloat16")
    try:
        outs = c.generate([tok.encode(t) for t, _ in CASES[:2]], GREEDY, [mm(*imgs) for _, imgs in CASES[:2]])
        assert all(o[-1].finish_reason is FinishReason.LENGTH and len(collect(o)[0]) == 8 for o in outs)
    finally:
        c.close()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_slow_image_holds_up_nobody(loop, tiny_llava_dir, tok):
    """While an image's encode is stuck, text requests are served (the scheduler never waits for it);
    the stuck request runs once its embeddings are ready."""
    import threading

    c = client(tiny_llava_dir, loop=loop)
    f = c.engine.features.features[MM]
    gate = threading.Event()
    encoder = f.encoder
    f.encoder = lambda px: (gate.wait(60), encoder(px))[1]
    try:
        stuck = c.engine.build_request(
            "stuck", tok.encode("Slow: <image>"), SamplingParams(**vars(GREEDY)), mm(IMAGES[3])
        )
        c.engine.submit(stuck)
        text = c.generate([tok.encode("Meanwhile, plain text"), tok.encode("and more text")], GREEDY)
        assert all(o[-1].finish_reason is FinishReason.LENGTH for o in text)
        assert not c._outputs.get("stuck")  # still waiting for its embeddings
        gate.set()
        assert collect(c.wait("stuck"))[2].finish_reason is FinishReason.LENGTH
    finally:
        gate.set()
        c.close()


def test_cpu_encoder_calls_run_on_threads_that_exit(tiny_llava_dir, tok):
    """A vision thread that kept the OpenMP team of its encoder calls beside the forward's made libgomp
    throttle the forward team's spin-wait (text batches ~10x slower once an image had been encoded, in
    the normal loop): on CPU each call runs on a thread that exits, taking its team with it."""
    import threading

    c = client(tiny_llava_dir, loop="normal")
    f = c.engine.features.features[MM]
    seen: list[threading.Thread] = []
    encode = f.encoder

    def spy(*args, **kwargs):
        seen.append(threading.current_thread())
        return encode(*args, **kwargs)

    f.encoder = spy
    try:
        out = collect(c.generate([tok.encode("Look: <image>")], GREEDY, [mm(IMAGES[1])])[0])
        assert out[2].error is None and seen
        assert all(not t.is_alive() and t.name.startswith("zerogap-vision-call") for t in seen)
    finally:
        c.close()
