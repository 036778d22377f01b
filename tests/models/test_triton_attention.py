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

from service.models.attention import TorchAttention  # noqa: E402
from service.models.triton_attention import TritonAttention  # noqa: E402
from tests.attention_batches import make_batch, run_backend  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def check(prefix_lens, ext_lens, hq, hkv, d, dtype, window=None, seed=0, softcap=None, **triton_kw):
    fb, data = make_batch(prefix_lens, ext_lens, hq, hkv, d, dtype, seed, DEVICE)
    ref, ref_k, ref_v = run_backend(TorchAttention(), fb, data, hq, hkv, window, softcap)
    out, k_cache, v_cache = run_backend(TritonAttention(**triton_kw), fb, data, hq, hkv, window, softcap)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "KV store differs"
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


BF16 = pytest.mark.xfail(INTERPRETED, reason="bf16 is wrong in the Triton interpreter", strict=False)
CASES = [(dt, hq, hkv) for hq, hkv in ((4, 2), (6, 2)) for dt in (torch.float32, torch.float16)]
CASES.append(pytest.param(torch.bfloat16, 4, 2, marks=BF16, id="bf16"))


@pytest.mark.parametrize("dtype,hq,hkv", CASES + [(torch.float32, 4, 4)])
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


@pytest.mark.parametrize("dtype,hq,hkv", CASES)
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
    fb, _ = make_batch([40, 3], [1, 1], 4, 2, 16, torch.float32, device=DEVICE)
    meta = TritonAttention(block_n=16).prepare(fb, 4, 2, None)
    assert 1 <= meta.num_splits <= 3  # never more splits than blocks of the longest sequence


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 6])
def test_soft_capped_scores_match_torch(dtype, window):
    """Gemma-2's capped scores (the torch backend takes them through eager_attention)."""
    check([3, 20, 37], [1, 1, 1], 4, 2, 16, dtype, window, softcap=0.5, block_n=16, num_splits=2)
    check([10, 0], [23, 17], 4, 2, 16, dtype, window, seed=2, softcap=0.5, block_m=16, block_n=16)
