"""Multimodal benchmark: image requests mixed with text, overlap vs normal loop in one run.

    .venv/bin/python bench/bench_multimodal.py [--num-requests 32] [--image-fraction 0.25] [--max-new-tokens 32]
    .venv/bin/python bench/bench_multimodal.py --family qwen_vl --num-requests 16   # Qwen2.5-VL, 16 streams

The model is a LLaVA built here without any download: SmolLM2-135M's architecture and
tokenizer (plus "<image>") as the language model, with random weights (--load-format dummy), and
a random-init CLIP vision tower (224x224 images, 16x16 patches: 196 image tokens each; hidden
--vision-hidden, --vision-layers) + projector saved as safetensors. A fraction of the requests
(default 25%) carry one distinct image each (Pillow-drawn, 320x240 PNG: decode, resize, crop,
encode); the rest are text. Each loop runs on a fresh engine (cold encoder cache) after a
warm-up. Prints throughput per loop and their ratio, and the time the scheduler thread spent in
the multimodal feature's hooks (admission check, splice plan) next to the time the image
workers spent decoding, preprocessing and encoding — the work kept off the scheduler thread.

`--family qwen_vl` builds a Qwen2.5-VL the same way (SmolLM2's sizes as a Qwen2 language model
with M-RoPE, dummy weights; a random-init windowed vision tower, 14-pixel patches merged 2x2):
each 320x240 picture is resized to 308x224 within max_pixels, 22x16 patches -> 88 image tokens,
and the scheduler's image hooks also plan each batch's M-RoPE offsets.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch
from PIL import Image, ImageDraw

from features.multimodal import ImageInputs
from service.config import ServerArgs
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from service.model_prep import resolve_model_path

IMAGE_TOKEN = 49152
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def build_bench_llava(smol: Path, out: Path, vision_hidden: int, vision_layers: int) -> Path:
    """Config + vision/projector weights + tokenizer + image processor; the language model is dummy."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig

    from service.models.llava import VisionEncoder

    text = AutoConfig.from_pretrained(smol)
    text.vocab_size = IMAGE_TOKEN + 1
    text.tie_word_embeddings = True
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=4 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=max(1, vision_hidden // 64),
        image_size=224,
        patch_size=16,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-2,
        image_seq_length=196,
        tie_word_embeddings=True,
    )
    cfg.architectures = ["LlavaForConditionalGeneration"]
    cfg.save_pretrained(out)
    torch.manual_seed(0)
    enc = VisionEncoder(cfg)
    tensors = {f"vision_tower.{k}": v.contiguous() for k, v in enc.tower.state_dict().items()}
    tensors.update(
        {f"multi_modal_projector.{k}": v.contiguous() for k, v in enc.projector.state_dict().items()}
    )
    save_file(tensors, str(out / "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(smol)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.save_pretrained(out)
    if (smol / "chat_template.jinja").exists():
        shutil.copy(smol / "chat_template.jinja", out / "chat_template.jinja")
    CLIPImageProcessorPil(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    ).save_pretrained(out)
    return out


def build_bench_qwen_vl(smol: Path, out: Path, vision_hidden: int, vision_layers: int) -> Path:
    """A Qwen2.5-VL config (SmolLM2's sizes), its vision tower's weights, tokenizer and image processor."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from service.models.qwen_vl import QwenVisionEncoder

    text = AutoConfig.from_pretrained(smol)
    head_dim = text.hidden_size // text.num_attention_heads
    unit = head_dim // 16  # mrope_section covers half the head: 2 + 3 + 3 units
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=vision_layers,
            hidden_size=vision_hidden,
            intermediate_size=4 * vision_hidden,
            num_heads=max(1, vision_hidden // 64),
            patch_size=14,
            spatial_merge_size=2,
            window_size=112,
            out_hidden_size=text.hidden_size,
            fullatt_block_indexes=list(range(vision_layers - 1, -1, -4))[::-1],
        ),
        text_config=dict(
            vocab_size=IMAGE_TOKEN + 3,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads,
            max_position_embeddings=text.max_position_embeddings,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2 * unit, 3 * unit, 3 * unit],
            },
            tie_word_embeddings=True,
            bos_token_id=text.bos_token_id,
            eos_token_id=text.eos_token_id,
        ),
        vision_start_token_id=IMAGE_TOKEN,
        image_token_id=IMAGE_TOKEN + 1,
        vision_end_token_id=IMAGE_TOKEN + 2,
        video_token_id=IMAGE_TOKEN + 10,
        tie_word_embeddings=True,
    )
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    cfg.save_pretrained(out)
    torch.manual_seed(0)
    enc = QwenVisionEncoder(cfg)
    save_file(
        {f"visual.{k}": v.contiguous() for k, v in enc.tower.state_dict().items()},
        str(out / "model.safetensors"),
    )
    tok = AutoTokenizer.from_pretrained(smol)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]}
    )
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=320 * 240, patch_size=14, merge_size=2
    ).save_pretrained(out)
    return out


def picture(i: int) -> bytes:
    rng = random.Random(i)
    img = Image.new("RGB", (320, 240), tuple(rng.randrange(256) for _ in range(3)))
    d = ImageDraw.Draw(img)
    for _ in range(8):
        x, y = rng.randrange(300), rng.randrange(220)
        d.ellipse(
            (x, y, x + rng.randrange(10, 120), y + rng.randrange(10, 120)),
            fill=tuple(rng.randrange(256) for _ in range(3)),
        )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def workload(tok, n: int, fraction: float, max_new: int, placeholder: str = "<image>", seed: int = 0):
    rng = random.Random(seed)
    users = set(rng.sample(range(n), max(1, round(n * fraction))))
    prompts, feats = [], []
    for i in range(n):
        words = " ".join(
            rng.choice(["cat", "tree", "river", "blue", "quickly", "house", "seven"])
            for _ in range(rng.randrange(12, 40))
        )
        if i in users:
            prompts.append(tok.encode(f"Describe {placeholder} with {words}"))
            feats.append({"multimodal": ImageInputs((picture(i),))})
        else:
            prompts.append(tok.encode(f"Tell me about {words}"))
            feats.append(None)
    params = [SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True) for _ in range(n)]
    return prompts, params, feats


def run_loop(model_dir: Path, loop: str, args, prompts, params, feats, placeholder: str) -> dict:
    n = len(prompts)
    client = SyncClient(
        ServerArgs(
            dtype=args.dtype,
            loop=loop,
            load_format="dummy",
            max_running_requests=n,
            kv_cache_tokens=n * (args.max_new_tokens + 300),
        ),
        model_dir,
    )
    try:
        # Warm-up (text and one image, not in the workload): kernels, the encoder's first run.
        tok = client.engine.tokenizer
        client.generate(
            [tok.encode("Warm up the text path")], SamplingParams(temperature=0, max_new_tokens=4)
        )
        client.generate(
            [tok.encode(f"{placeholder} hi")],
            SamplingParams(temperature=0, max_new_tokens=4),
            [{"multimodal": ImageInputs((picture(10_000),))}],
        )
        f = client.engine.features.features["multimodal"]
        sched0, work0 = f.scheduler_s, sum(f.worker_s)
        start = time.perf_counter()
        outs = client.generate(prompts, params, feats)
        elapsed = time.perf_counter() - start
        errors = [o[-1].error for o in outs if o[-1].error]
        assert not errors, errors[:3]
        row = {r.feature: r for r in client.engine.features.matrix()}["multimodal"]
        return dict(
            loop=client.engine.mode,
            tok_s=sum(len(collect(o)[0]) for o in outs) / elapsed,
            elapsed=elapsed,
            sched_ms=(f.scheduler_s - sched0) * 1e3,
            worker_ms=(sum(f.worker_s) - work0) * 1e3,
            encodes=f.encoder_runs - 1,
            encoder_calls=f.encoder_calls - 1,
            busy=client.engine.stats().forward_busy_fraction,
            batches=(row.batches_overlapped, row.batches_fallback, row.batches_normal_loop),
            ids=[collect(o)[0] for o in outs],
        )
    finally:
        client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--image-fraction", type=float, default=0.25)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--vision-hidden", type=int, default=384)
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument("--family", choices=["llava", "qwen_vl"], default="llava")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix=f"zerogap-bench-{args.family}-"))
    try:
        build = build_bench_llava if args.family == "llava" else build_bench_qwen_vl
        model_dir = build(resolve_model_path(None), tmp, args.vision_hidden, args.vision_layers)
        placeholder, per_image = ("<image>", 196) if args.family == "llava" else (QWEN_IMAGE, 88)
        from transformers import AutoTokenizer

        prompts, params, feats = workload(
            AutoTokenizer.from_pretrained(model_dir),
            args.num_requests,
            args.image_fraction,
            args.max_new_tokens,
            placeholder,
        )
        n_img = sum(f is not None for f in feats)
        print(
            f"workload ({args.family}): {len(prompts)} requests ({n_img} with one 320x240 PNG -> {per_image} "
            "image tokens), "
            f"{args.max_new_tokens} new tokens each; vision tower {args.vision_layers}x{args.vision_hidden}; "
            f"load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        results = {}
        for loop in ("normal", "overlap"):
            r = results[loop] = run_loop(model_dir, loop, args, prompts, params, feats, placeholder)
            print(
                f"{loop:>8}: {r['tok_s']:7.1f} tok/s ({r['elapsed']:.2f} s)  forward busy={r['busy']:.3f}  "
                f"images encoded={r['encodes']} in {r['encoder_calls']} calls  scheduler thread in image hooks={r['sched_ms']:.2f} ms "
                f"({r['sched_ms'] / 10 / r['elapsed']:.3f}% of wall)  image workers={r['worker_ms']:.0f} ms  "
                f"multimodal batches (overlapped, fallback, normal loop)={r['batches']}",
                flush=True,
            )
        o, n = results["overlap"], results["normal"]
        same = sum(a == b for a, b in zip(o["ids"], n["ids"]))
        print(
            f"overlap / normal throughput: {o['tok_s'] / n['tok_s']:.3f}x; requests with the same tokens in both loops: "
            f"{same}/{len(prompts)} (float32: all; bfloat16: batches form as images finish encoding, and a row's "
            f"low bits depend on its batch); load average {os.getloadavg()[0]:.2f}"
        )
        print(json.dumps({k: {x: v for x, v in r.items() if x != "ids"} for k, r in results.items()}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
