"""The Triton paged-attention kernels equal the torch backend.

On CPU they run under TRITON_INTERPRET=1 (tests/conftest.py sets it before
triton is imported). Cases: GQA (power-of-two and not), lengths that are not
multiples of the block size, more KV splits than a sequence needs, empty and
non-empty cached prefixes, scattered KV rows, sliding windows. bf16 is wrong
in the interpreter (not in the kernels), so it is xfailed here and checked on
a GPU by bench/gpu_check.py.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from service.engine.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from service.models.attention import TorchAttention  # noqa: E402
from service.models.triton_attention import TritonAttention  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(prefix_lens: list[int], ext_lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
               seed: int = 0, pool: int = 512) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
    """A batch over a pool whose rows are scattered at random; each request has a cached
    prefix (already in the pool) and `ext` new tokens (DECODE when every ext is 1 and
    every prefix non-empty)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq = [p + e for p, e in zip(prefix_lens, ext_lens)]
    L, lq, total = max(seq), max(ext_lens), sum(ext_lens)
    rows = torch.randperm(pool, generator=g)[: sum(seq)] + 1  # never row 0
    kv_indices = torch.zeros(bs, L, dtype=torch.int64)
    off = 0
    for b, n in enumerate(seq):
        kv_indices[b, :n] = rows[off : off + n]
        off += n
    decode = all(e == 1 for e in ext_lens) and all(p > 0 for p in prefix_lens)
    q_lens = torch.tensor(ext_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    j = torch.arange(lq).unsqueeze(0)
    valid = j < q_lens.unsqueeze(1)
    prefix = torch.tensor(prefix_lens)
    fb = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq)]),
        out_cache_loc=torch.cat([kv_indices[b, p:s] for b, (p, s) in enumerate(zip(prefix_lens, seq))]),
        kv_indices=kv_indices,
        q_positions=torch.where(valid, prefix.unsqueeze(1) + j, 0),
        logits_index=starts + q_lens - 1,
        sampling=None,  # type: ignore[arg-type]  # attention does not sample
        q_pad_index=torch.where(valid, starts.unsqueeze(1) + j, total).reshape(-1),
        q_unpad_index=(torch.arange(bs).unsqueeze(1) * lq + j)[valid],
        extend_lens=list(ext_lens),
        seq_lens=torch.tensor(seq),
        extend_prefix_lens=prefix,
        extend_start_loc=starts,
        max_extend_len=lq,
    )
    data = {
        "q": torch.randn(total, hq, d, generator=g).to(dtype),
        "k": torch.randn(total, hkv, d, generator=g).to(dtype),
        "v": torch.randn(total, hkv, d, generator=g).to(dtype),
        "k_cache": torch.randn(pool + 1, hkv, d, generator=g).to(dtype),
        "v_cache": torch.randn(pool + 1, hkv, d, generator=g).to(dtype),
    }
    for name in ("input_ids", "positions", "out_cache_loc", "kv_indices", "q_positions", "logits_index",
                 "q_pad_index", "q_unpad_index", "seq_lens", "extend_prefix_lens", "extend_start_loc"):
        setattr(fb, name, getattr(fb, name).to(DEVICE))
    return fb, {k: v.to(DEVICE) for k, v in data.items()}


def run_backend(backend, fb: ForwardBatch, data: dict[str, torch.Tensor], hq: int, hkv: int, window: int | None):
    k_cache, v_cache = data["k_cache"].clone(), data["v_cache"].clone()
    meta = backend.prepare(fb, hq, hkv, window)
    d = data["q"].shape[-1]
    out = backend.forward(data["q"], data["k"], data["v"], k_cache, v_cache, meta, d**-0.5)
    return out, k_cache, v_cache


def check(prefix_lens, ext_lens, hq, hkv, d, dtype, window=None, seed=0, **triton_kw):
    fb, data = make_batch(prefix_lens, ext_lens, hq, hkv, d, dtype, seed)
    ref, ref_k, ref_v = run_backend(TorchAttention(), fb, data, hq, hkv, window)
    out, k_cache, v_cache = run_backend(TritonAttention(**triton_kw), fb, data, hq, hkv, window)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "KV store differs"
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.xfail(INTERPRETED, reason="bf16 is wrong in the Triton interpreter", strict=False)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (4, 4)])
def test_decode_matches_torch(dtype, hq, hkv):
    # lengths around the block size (16), one of 1 token; scattered rows
    check([1, 16, 17, 40], [1, 1, 1, 1], hq, hkv, 16, dtype, block_n=16, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_more_splits_than_needed(dtype):
    """8 splits over sequences of 2..9 tokens: most splits are empty and must not count."""
    check([2, 5, 9], [1, 1, 1], 4, 2, 16, dtype, block_n=16, num_splits=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_sliding_window(dtype):
    check([3, 20, 37], [1, 1, 1], 4, 2, 16, dtype, window=8, block_n=16, num_splits=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2)])
def test_extend_empty_prefix_matches_torch(dtype, hq, hkv):
    check([0, 0, 0], [5, 19, 33], hq, hkv, 16, dtype, block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_with_cached_prefix_matches_torch(dtype):
    check([7, 0, 21], [9, 3, 18], 4, 2, 16, dtype, block_m=16, block_n=16, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_sliding_window(dtype):
    check([10, 0], [23, 17], 4, 2, 16, dtype, window=6, block_m=16, block_n=16, seed=2)


def test_head_dim_not_a_power_of_two():
    check([12, 30], [1, 1], 4, 2, 24, torch.float32, block_n=16, num_splits=2)
    check([0, 4], [11, 6], 4, 2, 24, torch.float32, block_m=16, block_n=16)


def test_default_split_choice_is_sane():
    fb, _ = make_batch([40, 3], [1, 1], 4, 2, 16, torch.float32)
    meta = TritonAttention(block_n=16).prepare(fb, 4, 2, None)
    assert 1 <= meta.num_splits <= 3  # never more splits than blocks of the longest sequence
