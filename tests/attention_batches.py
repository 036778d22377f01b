"""Synthetic attention batches over a scattered paged KV pool (kernel tests and bench/gpu_check.py)."""

from __future__ import annotations

import torch

from service.core.forward_batch import ForwardBatch, ForwardMode

_DEVICE_FIELDS = (
    "input_ids",
    "positions",
    "out_cache_loc",
    "kv_indices",
    "q_positions",
    "logits_index",
    "q_pad_index",
    "q_unpad_index",
    "seq_lens",
    "extend_prefix_lens",
    "extend_start_loc",
)


def make_batch(
    prefix_lens: list[int],
    ext_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str | torch.device = "cpu",
    pool: int | None = None,
) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
    """A batch whose requests each have a cached prefix (already in the pool, at rows
    scattered at random) and `ext` new tokens: DECODE when every ext is 1 and every
    prefix non-empty, else EXTEND. Returns the batch and q/k/v/k_cache/v_cache."""
    g = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq = [p + e for p, e in zip(prefix_lens, ext_lens)]
    pool = pool or 2 * sum(seq)
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
    for name in _DEVICE_FIELDS:
        setattr(fb, name, getattr(fb, name).to(device))
    gd = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gd, device=device).to(dtype)

    data = {
        "q": randn(total, hq, d),
        "k": randn(total, hkv, d),
        "v": randn(total, hkv, d),
        "k_cache": randn(pool + 1, hkv, d),
        "v_cache": randn(pool + 1, hkv, d),
    }
    return fb, data


def run_backend(
    backend,
    fb: ForwardBatch,
    data: dict[str, torch.Tensor],
    hq: int,
    hkv: int,
    window: int | None,
    softcap: float | None = None,
):
    """(output [T, Hq*D], k_cache, v_cache) of one attention call on copies of the caches."""
    k_cache, v_cache = data["k_cache"].clone(), data["v_cache"].clone()
    meta = backend.prepare(fb, hq, hkv, window, softcap)
    d = data["q"].shape[-1]
    out = backend.forward(data["q"], data["k"], data["v"], k_cache, v_cache, meta, d**-0.5)
    return out, k_cache, v_cache
