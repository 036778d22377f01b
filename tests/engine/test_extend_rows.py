"""Extend batches with a prefix already in the KV (chunks, cached prefixes, mixed decode rows):
the logits equal those of one extend over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from service.core.request import Req, SamplingParams
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.schedule_batch import ExtendRow, build_extend_batch
from service.models.backends import get_attention_backend
from service.models.loader import load_model


class _Detok:
    def add(self, ids):
        return ""


def _req(rid: str, prompt: list[int], slot: int) -> Req:
    r = Req(rid, prompt, SamplingParams(max_new_tokens=4, temperature=0.0), 0, _Detok(), frozenset())  # type: ignore[arg-type]
    r.slot = slot
    return r


@pytest.mark.parametrize("backend", ["torch", "torch-sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_with_prefix_equals_one_extend(tiny_llama_dir, backend, dtype):
    model = load_model(tiny_llama_dir, dtype, 512)
    s = model.shape
    attention = get_attention_backend(backend)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 90, 33)]

    def pools():
        return (ReqToTokenPool(4, 512), TokenToKVPool(1024, s.num_layers, s.num_kv_heads, s.head_dim, dtype))

    def logits(batch, kv):
        with torch.inference_mode():
            return model(batch.fb, batch.fb.input_ids, kv, attention).float()

    # One extend of each whole prompt.
    table, kv = pools()
    reqs = [_req(str(i), p, i) for i, p in enumerate(prompts)]
    whole = logits(build_extend_batch(reqs, table, kv, s.vocab_size), kv)

    # The same prompts in chunks: first rows of different lengths, then the rest on top of them;
    # the second step mixes a one-token "decode-like" row with longer ones.
    table, kv = pools()
    reqs = [_req(str(i), p, i) for i, p in enumerate(prompts)]
    cut = [8, 20, 1]
    build = build_extend_batch(
        reqs, table, kv, s.vocab_size, rows=[ExtendRow(r, r.prompt_ids[:c]) for r, c in zip(reqs, cut)]
    )
    logits(build, kv)
    rows = [ExtendRow(r, r.prompt_ids[c:], prefix_len=c, new_slot=False) for r, c in zip(reqs, cut)]
    second = build_extend_batch(reqs, table, kv, s.vocab_size, rows=rows)
    assert second.fb.new_slots is None
    assert [r.kv_len for r in reqs] == [len(p) for p in prompts]
    chunked = logits(second, kv)
    tol = 1e-4 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(chunked[: len(prompts)], whole[: len(prompts)], atol=tol, rtol=tol)
    assert chunked.argmax(-1).tolist() == whole.argmax(-1).tolist()


def test_table_gather_is_a_snapshot_of_the_slots_rows():
    table = ReqToTokenPool(5, 16)
    table.table.copy_(torch.arange(80).view(5, 16))
    slots = torch.tensor([3, 0, 4])
    out = table.gather(slots, 6)
    assert out.tolist() == [list(range(48, 54)), list(range(0, 6)), list(range(64, 70))]
    table.table.zero_()
    assert out[0, 0].item() == 48  # a copy, not a view of the table
