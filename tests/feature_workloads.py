"""Per-feature workloads for the matrix harness.

Every registered feature needs an entry: a function returning, for request i
of a workload, the feature payload to send (or None: the request does not use
the feature, so batches mix users and non-users). Feature issues add theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WORKLOADS: dict[str, Callable[[int], Any]] = {
    "test_full": lambda i: [i % 7 + 200, 13, 11] if i % 3 == 0 else None,
    "test_sync": lambda i: True if i % 2 == 0 else None,
    "test_none": lambda i: 1000 + i if i % 4 == 1 else None,
}
WORKLOADS["logprobs"] = lambda i: (
    dict(
        return_logprob=True,
        top_logprobs_num=i % 6,
        token_ids_logprob=(5, 17) if i % 3 == 0 else (),
        logprob_start_len=i % 3 - 1,
    )
    if i % 2 == 0
    else None
)
# Retraction: no client payload (the scheduler attaches one to the requests it retracts); a tiny
# KV pool and a low new-token ratio make the workload retract.
WORKLOADS["retraction"] = lambda i: None
SERVER_ARGS: dict[str, dict[str, Any]] = {
    "retraction": dict(kv_cache_tokens=160, init_new_token_ratio=0.1, min_new_token_ratio=0.05),
}
WORKLOADS["constrained"] = lambda i: (
    [
        dict(kind="regex", text=r"[a-z]{2,6}( [0-9]+)?"),
        dict(kind="json_object"),
        dict(kind="ebnf", text='root ::= "yes" | "no" | "maybe " [0-9]'),
    ][i % 3]
    if i % 2 == 0
    else None
)
# A server setting, not a request payload: its cells run every request with prompts cut in
# chunks of 7 and mixed with the decodes, against the reference's whole-prompt prefill.
WORKLOADS["chunked_prefill"] = lambda i: None

# Server arguments a feature's matrix cells run with (its reference runs without them).
CELL_ARGS: dict[str, dict[str, Any]] = {
    "chunked_prefill": dict(chunked_prefill_size=7, enable_mixed_chunk=True),
}


def _picture(i: int) -> bytes:
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (40 + 7 * i, 30 + 5 * i), (i * 37 % 256, 90, 180))
    ImageDraw.Draw(img).ellipse((5, 5, 30, 25), fill=(250, i * 53 % 256, 10))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _images(i: int) -> Any:
    from features.multimodal import ImageInputs

    return ImageInputs((_picture(i % 4),) * (1 + i % 3 // 2)) if i % 2 == 0 else None


WORKLOADS["multimodal"] = _images
# A feature whose cells need another model than tiny_llama_dir names that model's fixture here,
# and how a request's prompt changes when it uses the feature (e.g. one image placeholder per image).
MODELS: dict[str, str] = {"multimodal": "tiny_llava_dir"}
PROMPTS: dict[str, Callable[[Any, list[int]], list[int]]] = {
    "multimodal": lambda payload, prompt: [49152] * len(payload.images) + prompt,  # TINY_LLAVA_IMAGE_TOKEN
}
