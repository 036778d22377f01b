"""The CPU fast paths equal their pure-torch references.

Native kernels (paged attention, argmax, fused add+RMSNorm / RoPE / SiLU*mul, the
grammar-mask apply against xgrammar's own),
oneDNN-packed linears, per-request extend attention, the greedy fast path and
`--dtype auto`; end to end, the fast engine and the pure-torch engine give the
same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.config import ServerArgs, cpu_has_native_bf16, resolve_dtype
from service.core.forward_batch import ForwardBatch, ForwardMode
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from service.models import cpu_kernels, linear, ops
from service.models.attention import (
    FLASH_MIN_EXTEND_AMX,
    KERNEL_MAX_EXTEND,
    KERNEL_MAX_EXTEND_AMX,
    KERNEL_MAX_EXTEND_AMX_ONE_THREAD,
    KERNEL_MAX_EXTEND_AVX2,
    KERNEL_MAX_EXTEND_AVX512_F32,
    KERNEL_MAX_EXTEND_BF16,
    KERNEL_MAX_EXTEND_BF16_ONE_THREAD,
    TorchAttention,
    flash_min_extend,
    kernel_max_extend,
    sdpa,
)
from service.models.cpu_features import cpu_features
from service.models.linear import PanelLinear, fast_twin, packed_twin

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="needs cc (the native kernels are built with it): apt-get install gcc"
)
DTYPES = [torch.float32, torch.bfloat16]


def _reference_attention(q, k_cache, v_cache, table, lens, positions_per_req, window, softcap=None):
    """Per query row: softmax(q K^T) V over its request's rows up to its position (float64);
    softcap: scores -> softcap * tanh(scores / softcap) first (Gemma-2)."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out, row = [], 0
    for r, _n in enumerate(lens):
        for pos in positions_per_req[r]:
            lo = max(0, pos - window + 1) if window else 0
            rows = table[r, lo : pos + 1]
            k = k_cache[rows].double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
            v = v_cache[rows].double().repeat_interleave(hq // hkv, dim=1)
            s = torch.einsum("hd,lhd->hl", q[row].double(), k) * 0.125
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
            row += 1
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (4, 4, 128), (40, 8, 64)])
@pytest.mark.parametrize("few_rows", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_paged_attention_kernel_matches_reference(dtype, window, hq, hkv, d, few_rows, softcap):
    """Both bf16 code paths: one work item per query row (many rows; all heads of a token's row
    read at once, q.k on bf16 pairs) and one per (row, kv head) (few rows, or more heads than the
    row item holds); scores soft-capped or not (the cap of 2 bends most of these scores)."""
    g = torch.Generator().manual_seed(hq * d)
    pool, bs = 700, 5
    k_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    lens = [1, 7, 256, 300, 33]  # across the kernel's 256-key blocks, scattered rows
    table = torch.zeros(bs, max(lens), dtype=torch.int64)
    perm = torch.randperm(pool - 1, generator=g) + 1
    start = 0
    for r, n in enumerate(lens):
        table[r, :n] = perm[start : start + n]
        start += n
    # Extend-like: several query rows per request (the last 3 positions), decode-like: one.
    positions = [list(range(max(0, n - 3), n)) for n in lens]
    req_of = torch.tensor([r for r, ps in enumerate(positions) for _ in ps])
    pos_of = torch.tensor([p for ps in positions for p in ps])
    if few_rows:  # fewer query rows than 4 per thread: the (row, kv head) items
        keep = [1, 7]
        positions = [ps[:1] if r in (1, 3) else [] for r, ps in enumerate(positions)]
        req_of, pos_of = req_of[keep], pos_of[keep]
    q = torch.randn(len(pos_of), hq, d, generator=g).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel picks its path by rows per thread
    try:
        out = cpu_kernels.paged_attention(
            q, k_cache, v_cache, table, req_of, pos_of, 0.125, window, softcap=softcap
        )
    finally:
        torch.set_num_threads(threads)
    ref = _reference_attention(q, k_cache, v_cache, table, lens, positions, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_rows_have_the_same_bits_on_a_team_of_one_and_of_two(dtype):
    """Three decode rows: (row, kv head) items on a team of two (fewer than 4 rows per thread), one
    item per row, all heads, on a team of one (faster there at any row count). Same bits."""
    g = torch.Generator().manual_seed(11)
    pool, hq, hkv, d = 900, 9, 3, 64
    k_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    table = (torch.randperm(pool - 1, generator=g) + 1)[: 3 * 280].view(3, 280)
    req_of, pos_of = torch.arange(3), torch.tensor([279, 100, 7])
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    outs = []
    for team in (2, 1):
        kernel = cpu_kernels.PagedAttention(table, req_of, pos_of, None, team=team)
        outs.append(kernel(q, k_cache, v_cache, 0.125))
    assert torch.equal(outs[0], outs[1])


needs_extend_kernel = pytest.mark.skipif(
    not cpu_kernels.extend_isa(),
    reason="needs cc and a CPU with AVX2 + FMA (the extend kernel's vector paths)",
)


def _extend_case(dtype, hq, hkv, d, lens, news, seed=0):
    """A pool with each request's rows scattered in it, and the new query rows of each request
    (its last `news[r]` positions) packed one request after another."""
    g = torch.Generator().manual_seed(seed)
    pool = 2 * sum(lens) + 1
    k_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    perm = torch.randperm(pool - 1, generator=g) + 1
    for r, n in enumerate(lens):
        table[r, :n] = perm[sum(lens[:r]) : sum(lens[:r]) + n]
    q = torch.randn(sum(news), hq, d, generator=g).to(dtype)
    rows = [(r, sum(news[:r]), n, length) for r, (length, n) in enumerate(zip(lens, news))]
    return q, k_cache, v_cache, table, rows


def _extend(q, k_cache, v_cache, table, rows, window=None, softcap=None, scale=0.125):
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
    cpu_kernels.ExtendAttention(table, rows, window, softcap)(q, k_cache, v_cache, scale, out)
    return out.view(q.shape)


@needs_extend_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,window,softcap",
    [
        (9, 3, 64, None, None),
        (9, 3, 64, 37, 2.0),
        (4, 4, 128, 37, None),
        (12, 4, 96, None, 2.0),
        (8, 1, 16, None, None),
        (32, 8, 128, None, None),
        (6, 6, 80, 37, None),
    ],
)
def test_extend_attention_kernel_matches_reference(dtype, hq, hkv, d, window, softcap):
    """Long extends (prompts whole and chunks over a prefix, of lengths across the 64-key blocks
    and the work items' row counts) against float64 attention; scattered pool rows."""
    lens, news = [300, 129, 70, 65], [300, 65, 70, 1]
    q, k_cache, v_cache, table, rows = _extend_case(dtype, hq, hkv, d, lens, news, seed=hq * d)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = _extend(q, k_cache, v_cache, table, rows, window, softcap)
    finally:
        torch.set_num_threads(threads)
    positions = [list(range(length - n, length)) for length, n in zip(lens, news)]
    ref = _reference_attention(q, k_cache, v_cache, table, lens, positions, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@needs_extend_kernel
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (5, 5, 80)])
@pytest.mark.parametrize("window,softcap", [(None, None), (200, None), (None, 2.0)])
def test_bf16_rows_get_the_same_bits_from_the_paged_and_the_extend_kernel_nearly_always(
    hq, hkv, d, window, softcap
):
    """A prompt's rows go to the paged kernel in short chunks and to the extend kernel in long
    ones: a row must come out the same from either, or the two loops (and any two chunkings) part.
    With AVX-512 BF16 both round the softmax weights to bf16 against a running max kept a whole
    power of two, so a weight does not depend on the kernel's blocks (nor a window's offset from
    them); only float32 sums differ in order. Nearly every output has the same bits (0.01-0.11%
    apart when measured; 0.02-0.06% with float32 weights before), at a scale that is not a power
    of two too, and both stay within bf16's reach of float64 attention."""
    lens, news = [1000], [100]
    q, k_cache, v_cache, table, rows = _extend_case(torch.bfloat16, hq, hkv, d, lens, news, seed=d + hq)
    q = (q.float() * 2).to(torch.bfloat16)  # sharper scores: a few keys weigh most
    positions = [list(range(900, 1000))]
    req_of, pos_of = torch.zeros(100, dtype=torch.int64), torch.tensor(positions[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    outs = {}
    try:
        for scale in (0.125, d**-0.5):
            ext = _extend(q, k_cache, v_cache, table, rows, window, softcap, scale)
            paged = cpu_kernels.paged_attention(
                q, k_cache, v_cache, table, req_of, pos_of, scale, window, softcap=softcap
            ).view(q.shape)
            assert (ext != paged).float().mean() < 0.005, scale
            outs[scale] = (ext, paged)
    finally:
        torch.set_num_threads(threads)
    ref = _reference_attention(q, k_cache, v_cache, table, lens, positions, window, softcap)  # scale 0.125
    for out in outs[0.125]:
        err = (out.double() - ref).abs()
        assert err.mean() < 2.0**-8 * ref.abs().mean(), (err.mean(), ref.abs().mean())


@needs_extend_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (8, 2, 128, 50), (5, 5, 80, None)])
def test_extend_attention_rows_give_the_same_bits_in_any_chunk(dtype, hq, hkv, d, window):
    """A row's arithmetic depends on its query, its position and the keys only: a prompt cut into
    chunks (any cuts, any team size) gives the bits of the prompt in one piece, in bf16 too."""
    q, k_cache, v_cache, table, rows = _extend_case(dtype, hq, hkv, d, [500], [500], seed=d)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = _extend(q, k_cache, v_cache, table, rows, window)
        for t, (a, b) in enumerate([(0, 100), (100, 357), (357, 500), (65, 130), (499, 500)]):
            torch.set_num_threads(1 + t % 2)
            chunk = _extend(q[a:b], k_cache, v_cache, table, [(0, 0, b - a, b)], window)
            assert torch.equal(chunk, whole[a:b]), (a, b)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (6, 1, 80), (40, 8, 64)])
def test_paged_attention_rows_alone_and_in_a_batch_give_the_same_bits(dtype, hq, hkv, d):
    """Many query rows take one work item per row (a token's K/V rows for all heads streamed at
    once), a lone row one item per (row, kv head): each head's arithmetic is the same either way,
    so a request's attention does not change with the batch it is in. (bf16 on AVX-512 BF16 once
    rounded apart: a prompt's last row, prefilled among its 33 rows, and the same row alone after
    a prefix-cache hit gave another greedy first token.)"""
    g = torch.Generator().manual_seed(d)
    pool, bs, n = 4096, 12, 300
    k_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    table = torch.randperm(pool, generator=g)[: bs * n].view(bs, n).contiguous()  # scattered rows
    req_of = torch.arange(bs)
    pos_of = torch.tensor([n - 1 - 17 * r for r in range(bs)])  # across the 256-key blocks
    q = torch.randn(bs, hq, d, generator=g).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = cpu_kernels.paged_attention(q, k_cache, v_cache, table, req_of, pos_of, 0.125, None)
        alone = [
            cpu_kernels.paged_attention(
                q[r : r + 1], k_cache, v_cache, table, req_of[r : r + 1], pos_of[r : r + 1], 0.125, None
            )
            for r in range(bs)
        ]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, torch.cat(alone))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_including_ties_and_nan(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 3000, generator=g).to(dtype)
    x[1, ::5] = x[1].max() + 1  # ties: the first index wins
    x[2] = float("-inf")
    x[3, 2999] = float("nan")
    x[4, 700] = x[4, 1800] = float("nan")
    x[5, 0] = float("nan")
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [3000, 3001 + 30])  # whole words; a partial last word
def test_grammar_mask_kernel_matches_xgrammar(dtype, vocab):
    """logits = -inf where the bitmask forbids, for the listed rows only (strided logits rows,
    words all ones / all zeros / mixed), exactly as xgrammar's CPU kernel does it."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, vocab + 5, generator=g).to(dtype)[:, :vocab]  # row stride != vocab
    mask = xgr.allocate_token_bitmask(7, vocab)
    mask.copy_(torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=g, dtype=torch.int64).to(torch.int32))
    mask[1] = -1
    mask[2] = 0
    mask[3, : mask.shape[1] // 2] = -1
    rows = [0, 2, 3, 5, 6]
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, mask, indices=rows)
    got = logits.clone()
    assert cpu_kernels.apply_token_bitmask_(got, mask, torch.tensor(rows, dtype=torch.int64))
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # unlisted rows untouched
    assert not cpu_kernels.apply_token_bitmask_(
        got.to(torch.float16), mask, torch.tensor(rows)
    )  # no kernel: caller falls back


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layer_ops_match_eager(dtype):
    g = torch.Generator().manual_seed(2)
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for width in (96, 100, 7):  # 16-lane vectors only, vectors and a tail, a tail only
        h, delta, w = (torch.randn(n, width, generator=g).to(dtype) for n in (11, 11, 1))
        w = w[0]
        fused_h, fused_x = cpu_kernels.rms_norm(h, w, 1e-5, delta)
        assert torch.equal(fused_h, h + delta)
        torch.testing.assert_close(fused_x, ops.rms_norm_eager(h + delta, w, 1e-5), **tol)
        torch.testing.assert_close(cpu_kernels.rms_norm(h, w, 1e-5)[1], ops.rms_norm_eager(h, w, 1e-5), **tol)

    hq, hkv, d = 4, 2, 16
    qkv = torch.randn(11, (hq + 2 * hkv) * d, generator=g).to(dtype)
    pos = torch.randint(0, 50, (11,), generator=g)
    cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
    q, k, v = ops.split_qkv_rope(qkv.clone(), hq, hkv, d, pos, cos, sin)
    assert torch.equal(q, ops.rope_eager(qkv[:, : hq * d].reshape(11, hq, d), cos[pos], sin[pos]))
    assert torch.equal(
        k, ops.rope_eager(qkv[:, hq * d : (hq + hkv) * d].reshape(11, hkv, d), cos[pos], sin[pos])
    )
    assert torch.equal(v, qkv[:, (hq + hkv) * d :].reshape(11, hkv, d))

    qw, kw = (torch.randn(d, generator=g).to(dtype) for _ in range(2))  # per-head q/k norms (Qwen3)
    normed = ops.norm_qk_heads(qkv, hq, hkv, d, qw, kw, 1e-6)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    want_q = ops.rms_norm_eager(q.reshape(11, hq, d), qw, 1e-6).reshape(11, -1)
    want_k = ops.rms_norm_eager(k.reshape(11, hkv, d), kw, 1e-6).reshape(11, -1)
    torch.testing.assert_close(normed, torch.cat([want_q, want_k, v], -1), **tol)

    for inter in (40, 48, 5):
        gate_up = torch.randn(11, 2 * inter, generator=g).to(dtype) * 4
        gate_up[0, :3] = torch.tensor([100.0, -100.0, float("inf")])  # exp saturating, vanishing, infinite
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up, **tol, equal_nan=True)


def test_packed_linear_is_bit_identical():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 32, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    packed = packed_twin(w, b)
    if not cpu_features().onednn_packs_bf16:  # an AVX2-only CPU: oneDNN would raise; the layer stays plain
        assert packed is None
        return
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 32, generator=g).bfloat16()
        assert torch.equal(packed(x), F.linear(x, w, b))


def test_float32_linears_pack_on_every_cpu_and_match_to_rounding():
    """Float32 weights are packed for oneDNN on any x86-64 CPU (AVX2 included): its kernels stream
    uncached weights faster than sgemm; they round differently, by ~1e-6 of the output's scale."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    packed = packed_twin(w, b)
    assert packed is not None
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 32, generator=g)
        want = F.linear(x, w, b)
        torch.testing.assert_close(packed(x), want, rtol=0, atol=1e-5 * want.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("n,k", [(48, 32), (37, 19), (200, 576)])
def test_panel_linear_matches_to_rounding_and_a_row_does_not_depend_on_its_batch(n, k):
    """The float32 panel kernel (AVX2 CPUs): F.linear's results to rounding for any N (not a
    multiple of its 16-row panels), K (not of its 8-float vectors) and row count (not of its 6-row
    tiles nor its 48-row blocks); each output summed over k in order, so a row's results are the
    same bits alone and in any batch, wherever in it."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = cpu_kernels.pack_panels(w)
    if panels is None:
        assert not cpu_features().avx2
        pytest.skip("the panel kernel needs AVX2 + FMA")
    x = torch.randn(101, k, generator=g)
    for bias in (b, None):
        got = cpu_kernels.panel_linear(x, panels, n, bias)
        want = F.linear(x, w, bias)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
        for r in (0, 5, 6, 47, 48, 100):
            assert torch.equal(cpu_kernels.panel_linear(x[r : r + 1], panels, n, bias)[0], got[r])
        assert torch.equal(cpu_kernels.panel_linear(x[3:60], panels, n, bias), got[3:60])
    strided = torch.randn(5, k + 7, generator=g)[:, :k]  # a view: rows strided, as in a fused output
    assert torch.equal(
        cpu_kernels.panel_linear(strided, panels, n, b),
        cpu_kernels.panel_linear(strided.contiguous(), panels, n, b),
    )


@needs_kernels
@pytest.mark.parametrize("n,k", [(64, 32), (37, 18), (200, 576)])
def test_bf16_panel_linear_is_one_step_from_onednn_and_a_row_does_not_depend_on_its_batch(n, k):
    """The bf16 panel kernel (AVX-512 BF16): F.linear's results, each element the same or one bf16
    step apart (float32 sums in another order), for any N (not a multiple of its 32-row panels)
    and row count (not of its 8-row tiles nor its 48-row blocks); a row's results are the same
    bits alone and in any batch, wherever in it."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    panels = cpu_kernels.pack_panels(w)
    if panels is None:
        assert not cpu_features().avx512_bf16
        pytest.skip("the bf16 panel kernel needs AVX-512 BF16")
    assert cpu_kernels.pack_panels(torch.randn(8, 5).to(torch.bfloat16)) is None  # k pairs: K even
    x = torch.randn(101, k, generator=g).to(torch.bfloat16)
    for bias in (b, None):
        fbias = None if bias is None else bias.float()
        got = cpu_kernels.panel_linear(x, panels, n, fbias)
        want = F.linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        step = linear.BF16_ULP * want.float().abs() + 1e-5 * want.float().abs().max()
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got == want).float().mean() > 0.99
        for r in (0, 5, 8, 47, 48, 100):
            assert torch.equal(cpu_kernels.panel_linear(x[r : r + 1], panels, n, fbias)[0], got[r])
        assert torch.equal(cpu_kernels.panel_linear(x[3:60], panels, n, fbias), got[3:60])
    strided = torch.randn(5, k + 6, generator=g).to(torch.bfloat16)[:, :k]
    assert torch.equal(
        cpu_kernels.panel_linear(strided, panels, n, None),
        cpu_kernels.panel_linear(strided.contiguous(), panels, n, None),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_take_panels_where_they_pay_and_onednn_elsewhere(dtype):
    """Panels for float32 on AVX2 CPUs without AVX-512, for bf16 on AVX-512 BF16 CPUs without AMX
    (measured ahead of oneDNN there); elsewhere oneDNN's packing or the plain layer."""
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(48, 32, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    twin = fast_twin(w, b)
    cpu = cpu_features()
    pays = cpu.avx2 and not cpu.avx512 if dtype == torch.float32 else cpu.avx512_bf16 and not cpu.amx_bf16
    assert linear.panels_pay(w) == pays
    if not cpu_kernels.available() or not pays:
        assert not isinstance(twin, PanelLinear)
        return
    assert isinstance(twin, PanelLinear)
    for shape in ((2, 3, 32), (1, 32), (300, 32)):  # any leading shape, any row count
        x = torch.randn(*shape, generator=g).to(dtype)
        want = cpu_kernels.panel_linear(x.reshape(-1, 32), twin.panels, 48, twin.bias)
        assert torch.equal(twin(x), want.view(*shape[:-1], 48))


def _extend_batch(table: torch.Tensor, lens: list[int], news: list[int]) -> ForwardBatch:
    """An extend batch: request r holds lens[r] pool rows (table[r]), the last news[r] of them new."""
    prefix = [length - n for length, n in zip(lens, news)]
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(sum(news), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, length) for p, length in zip(prefix, lens)]),
        out_cache_loc=torch.cat([table[r, p:length] for r, (p, length) in enumerate(zip(prefix, lens))]),
        kv_indices=table,
        q_positions=torch.zeros(1),
        logits_index=torch.zeros(1),
        sampling=None,  # type: ignore[arg-type]
        seq_lens=torch.tensor(lens),
        extend_lens=news,
        extend_prefix_lens=torch.tensor(prefix),
        extend_prefix_lens_cpu=prefix,
    )


@pytest.mark.parametrize("use_kernel", [False, True])
def test_extend_attention_costs_what_its_tokens_cost(use_kernel):
    """A long prompt beside one-token prompts and a 20-token one runs per request (no padding to
    the longest): the batch's attention equals each request's own, through SDPA per request or the
    native kernels (the extend kernel for the long prompt, and for the 20 tokens where its AVX2
    tiles beat the paged kernel; the paged kernel for the rest)."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, pool = 4, 2, 16, 200
    lens = [1, 120, 1, 20, 1]
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=g), torch.randn(pool, hkv, d, generator=g)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    start = 1
    for r, n in enumerate(lens):
        table[r, :n] = torch.arange(start, start + n)
        start += n
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    fb = _extend_batch(table, lens, lens)
    backend = TorchAttention(use_kernel=use_kernel)
    meta = backend.prepare(fb, hq, hkv, None)
    assert [length for length, _, _ in meta.extend_rows] == lens  # per request, not a padded [bs, 120] block
    if use_kernel and cpu_kernels.extend_isa():
        avx2 = cpu_kernels.extend_isa() == 8
        assert kernel_max_extend() == (KERNEL_MAX_EXTEND_AVX2 if avx2 else KERNEL_MAX_EXTEND)
        isa = cpu_kernels.extend_isa()
        amx = cpu_features().onednn_amx_bf16
        bf16_max = {8: KERNEL_MAX_EXTEND_AVX2, 32: KERNEL_MAX_EXTEND_AMX if amx else KERNEL_MAX_EXTEND_BF16}
        assert kernel_max_extend(torch.bfloat16, team=2) == bf16_max.get(isa, 64)
        one = {
            8: KERNEL_MAX_EXTEND_AVX2,
            32: KERNEL_MAX_EXTEND_AMX_ONE_THREAD if amx else KERNEL_MAX_EXTEND_BF16_ONE_THREAD,
        }
        assert kernel_max_extend(torch.bfloat16, team=1) == one.get(isa, 64)
        f32 = {8: KERNEL_MAX_EXTEND_AVX2, 16: KERNEL_MAX_EXTEND_AVX512_F32, 32: KERNEL_MAX_EXTEND_AVX512_F32}
        assert kernel_max_extend(torch.float32, team=2) == f32[isa]
        assert kernel_max_extend(torch.float32, team=8) == 15  # two rows a thread at least
        assert kernel_max_extend(torch.bfloat16, team=8) == (64 if isa == 16 else 15)
        long = [(1, 1, 120, 120)] + ([(3, 122, 20, 20)] if avx2 else [])
        assert meta.extend_kernel is not None and meta.extend_kernel.rows == long
        short = [0, 121] + ([] if avx2 else list(range(122, 142))) + [142]
        assert meta.short_q is not None and meta.short_q.tolist() == short
    out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    row = 0
    for _r, n in enumerate(lens):
        kr = k[row : row + n].transpose(0, 1).repeat_interleave(2, 0)
        vr = v[row : row + n].transpose(0, 1).repeat_interleave(2, 0)
        ref = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1), kr, vr, is_causal=True, scale=0.25
        )
        torch.testing.assert_close(out[row : row + n], ref.transpose(0, 1).reshape(n, -1))
        row += n


@needs_extend_kernel
def test_a_head_size_the_extend_kernel_lacks_keeps_short_extends_on_the_paged_kernel():
    """The split at a few rows is measured against the extend kernel: where it has no variant for
    the head size (not a multiple of 16), extends of up to KERNEL_MAX_EXTEND rows stay with the
    paged kernel instead of falling to one SDPA per request."""
    lens, news = [300, 200], [20, 1]
    table = torch.arange(1, 1 + 2 * 300, dtype=torch.int64).view(2, 300)
    fb = _extend_batch(table, lens, news)
    fb.logits_index = torch.tensor([19, 20])  # one row a request: the batch's size
    backend = TorchAttention(use_kernel=True, team=2, dtype=torch.float32)
    lacking = backend.prepare(fb, 4, 2, None, head_dim=72)
    assert lacking.use_kernel and lacking.kernel is not None and lacking.extend_kernel is None
    built = backend.prepare(fb, 4, 2, None, head_dim=64)
    assert not built.use_kernel and built.extend_kernel is not None
    assert [r for r, *_ in built.extend_kernel.rows] == [0]


@needs_kernels
@pytest.mark.parametrize("team", [2, 1])
def test_bf16_extends_split_between_paged_extend_and_flash_paths_by_length(team):
    """bf16: a batch's requests go to the paged kernel (few new rows), the extend kernel (more) and,
    with AMX, ATen's flash kernel (long chunks, from FLASH_MIN_EXTEND_AMX rows on: its matmuls run
    on AMX tiles); whichever path takes a request, its rows equal float32 attention over its rows."""
    lens, news = [300, 260, 500, 700, 90], [1, 8, 40, 200, 90]
    q, k_cache, v_cache, table, rows = _extend_case(torch.bfloat16, 9, 3, 64, lens, news, seed=3)
    fb = _extend_batch(table, lens, news)
    backend = TorchAttention(use_kernel=True, team=team, dtype=torch.bfloat16)
    meta = backend.prepare(fb, 9, 3, None)
    amx = cpu_features().onednn_amx_bf16
    assert flash_min_extend(torch.bfloat16) == (FLASH_MIN_EXTEND_AMX if amx else None)
    assert flash_min_extend(torch.float32) is None
    if cpu_kernels.extend_isa():
        short_max = kernel_max_extend(torch.bfloat16, team)
        flash = [r for r, n in enumerate(news) if amx and n >= FLASH_MIN_EXTEND_AMX]
        assert meta.flash_rows == flash and (not amx or flash == [3, 4])
        kernel_rows = [r for r, n in enumerate(news) if n > short_max and r not in flash]
        if kernel_rows:
            assert [r for r, *_ in meta.extend_kernel.rows] == kernel_rows
        else:
            assert meta.extend_kernel is None
        assert meta.short_q is not None
    k, v = k_cache[fb.out_cache_loc], v_cache[fb.out_cache_loc]
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125).view(q.shape)
    for r, start, n, length in rows:
        kr = k_cache[table[r, :length]].float().transpose(0, 1).repeat_interleave(3, 0)
        vr = v_cache[table[r, :length]].float().transpose(0, 1).repeat_interleave(3, 0)
        mask = torch.arange(length).view(1, -1) <= torch.arange(length - n, length).view(-1, 1)
        ref = F.scaled_dot_product_attention(
            q[start : start + n].float().transpose(0, 1), kr, vr, attn_mask=mask, scale=0.125
        )
        torch.testing.assert_close(out[start : start + n].float(), ref.transpose(0, 1), atol=2e-2, rtol=2e-2)


def test_loop_auto_is_the_measured_faster_loop_per_device():
    """README "Serving": overlap on CUDA, normal on CPU; explicit choices win."""
    assert ServerArgs().loop == "auto"
    assert not ServerArgs().use_overlap("cpu") and ServerArgs().use_overlap("cuda")
    assert ServerArgs(loop="overlap").use_overlap("cpu") and not ServerArgs(loop="normal").use_overlap("cuda")
    assert not ServerArgs(loop="overlap", disable_overlap=True).use_overlap("cuda")
    with pytest.raises(ValueError):
        ServerArgs(loop="fast").use_overlap("cpu")


def test_dtype_auto_picks_bf16_only_with_native_bf16_matmuls():
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", device="cuda") == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("float16x")
    assert ServerArgs().dtype == "auto"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_engine_and_pure_torch_engine_give_the_same_greedy_tokens(tiny_llama_dir, dtype, monkeypatch):
    """The whole fast path (kernels, packing, greedy argmax) against the pure-torch one."""
    prompts = [[5 + i * 7 + j for j in range(2 + 9 * i)] for i in range(5)]
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    fast = SyncClient(ServerArgs(dtype=dtype, kv_cache_tokens=1024, max_running_requests=8), tiny_llama_dir)
    try:
        fast_ids = [collect(o)[0] for o in fast.generate(prompts, greedy)]
    finally:
        fast.close()
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    slow = SyncClient(
        ServerArgs(dtype=dtype, kv_cache_tokens=1024, max_running_requests=8, attention_backend="torch-sdpa"),
        tiny_llama_dir,
    )
    try:
        slow_ids = [collect(o)[0] for o in slow.generate(prompts, greedy)]
    finally:
        slow.close()
    if dtype == "float32":
        assert fast_ids == slow_ids
    else:  # bf16 roundings differ between SDPA and the kernel: a random model's near-ties may flip later on
        assert [ids[0] for ids in fast_ids] == [ids[0] for ids in slow_ids]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 7])
def test_masked_sdpa_matches_the_reference(dtype, window):
    """A prompt chunk over its prefix (the extend path for long chunks): the CPU flash kernel
    with an additive mask, against float64 attention with the boolean mask."""
    g = torch.Generator().manual_seed(3)
    n, length, heads, d = 40, 100, 4, 32
    q, k, v = (torch.randn(heads, m, d, generator=g).to(dtype) for m in (n, length, length))
    q_pos = torch.arange(length - n, length).view(-1, 1)
    kv_pos = torch.arange(length).view(1, -1)
    allowed = kv_pos <= q_pos
    if window:
        allowed &= kv_pos > q_pos - window
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    out = sdpa(q, k, v, 0.2, additive_mask=additive)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed, scale=0.2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_sdpa_matches_the_reference(dtype):
    """A whole prompt (no prefix): the CPU flash kernel on 4-D inputs, causal (3-D inputs sent SDPA down
    its math path, 4.5x slower at 1,024 tokens), against float64 attention."""
    g = torch.Generator().manual_seed(4)
    n, heads, d = 70, 3, 32
    q, k, v = (torch.randn(heads, n, d, generator=g).to(dtype) for _ in range(3))
    out = sdpa(q, k, v, 0.2, causal=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=0.2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
