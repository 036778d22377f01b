"""Batch formation: from chosen requests to a ForwardBatch snapshot.

The functions here allocate KV rows, update the request-to-token table and the
requests' counters, and build fresh tensors (never views of shared state), so
the forward thread can read a batch while the scheduler edits its tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from features.base import Feature, OverlapSupport
from service.engine.forward_batch import ForwardBatch, ForwardMode, SamplingBatch
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.request import Req


@dataclass
class ScheduleBatch:
    """A formed batch: its requests (row order) and what the forward reads."""

    reqs: list[Req]
    fb: ForwardBatch
    # Overlap loop: the placeholders standing in for this batch's sampled tokens.
    placeholders: list[int] | None = None
    # Features the batch carries (with their rows) and the weakest overlap support among them.
    plan: list[tuple[Feature, list[int]]] = field(default_factory=list)
    support: OverlapSupport = OverlapSupport.FULL
    after_launch_pending: bool = False  # overlap loop: its after_launch hooks wait for older results
    hook_error: Exception | None = None  # a feature hook failed: the batch's requests fail

    @property
    def mode(self) -> ForwardMode:
        return self.fb.mode


def build_sampling_batch(reqs: list[Req], vocab_size: int) -> SamplingBatch:
    """Per-row sampling tensors. Call after the requests' `launched` counters moved."""
    rows = torch.tensor([r.sampling_row for r in reqs], dtype=torch.float32)
    temps, top_k, top_p, min_p = rows[:, 0], rows[:, 1].to(torch.int64), rows[:, 2], rows[:, 3]
    top_k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
    sampled = temps > 0
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for i, r in enumerate(reqs):
        if r.launched - 1 < r.params.min_new_tokens and r.ban_stop_before_min:
            banned_rows.extend([i] * len(r.banned_ids))
            banned_tokens.extend(r.banned_ids)
    return SamplingBatch(
        temperatures=temps,
        top_ks=top_k,
        top_ps=top_p,
        min_ps=min_p,
        repetition_penalties=rows[:, 4],
        frequency_penalties=rows[:, 5],
        presence_penalties=rows[:, 6],
        seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64),
        steps=torch.tensor([r.launched - 1 for r in reqs], dtype=torch.int64),
        req_slots=torch.tensor([r.slot for r in reqs], dtype=torch.int64),
        all_greedy=not bool(sampled.any()),
        need_top_k_p=bool((sampled & ((top_k < vocab_size) | (top_p < 1))).any()),
        need_min_p=bool((sampled & (min_p > 0)).any()),
        need_penalties=any(r.uses_penalties for r in reqs),
        banned_rows=torch.tensor(banned_rows, dtype=torch.int64) if banned_rows else None,
        banned_tokens=torch.tensor(banned_tokens, dtype=torch.int64) if banned_rows else None,
    )


def _kv_indices(table: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    return table[slots.unsqueeze(1), torch.arange(length).unsqueeze(0)]


def build_extend_batch(
    reqs: list[Req], req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, vocab_size: int
) -> ScheduleBatch:
    """Prefill the whole prompt of each (newly admitted, slotted) request."""
    lens = [len(r.prompt_ids) for r in reqs]
    total = sum(lens)
    locs = kv_pool.alloc(total)
    q_lens = torch.tensor(lens, dtype=torch.int64)
    starts = torch.cumsum(q_lens, 0) - q_lens
    slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64)
    prompts = [torch.tensor(r.prompt_ids, dtype=torch.int64) for r in reqs]
    for r, start, n in zip(reqs, starts.tolist(), lens):
        req_pool.table[r.slot, :n] = locs[start : start + n]
        r.kv_len = n
        r.launched = 1
    bs, lq = len(reqs), max(lens)
    j = torch.arange(lq).unsqueeze(0)
    valid = j < q_lens.unsqueeze(1)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.cat(prompts),
        positions=torch.cat([torch.arange(n) for n in lens]),
        out_cache_loc=locs,
        kv_indices=_kv_indices(req_pool.table, slots, lq),
        q_positions=torch.where(valid, j, 0),
        logits_index=starts + q_lens - 1,
        sampling=build_sampling_batch(reqs, vocab_size),
        q_pad_index=torch.where(valid, starts.unsqueeze(1) + j, total).reshape(-1),
        q_unpad_index=(torch.arange(bs).unsqueeze(1) * lq + j)[valid],
        seq_lens=q_lens,
        extend_lens=lens,
        prefix_lens=torch.zeros(bs, dtype=torch.int64),
        new_slots=slots,
        new_prompts=prompts,
    )
    return ScheduleBatch(reqs, fb)


def build_decode_batch(
    reqs: list[Req], req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, vocab_size: int
) -> ScheduleBatch:
    """One new token per request; inputs may be future placeholders."""
    bs = len(reqs)
    slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64)
    positions = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
    locs = kv_pool.alloc(bs)
    req_pool.table[slots, positions] = locs
    for r in reqs:
        r.kv_len += 1
        r.launched += 1
    fb = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([r.next_input for r in reqs], dtype=torch.int64),
        positions=positions,
        out_cache_loc=locs,
        kv_indices=_kv_indices(req_pool.table, slots, int(positions.max()) + 1),
        q_positions=positions.unsqueeze(1),
        logits_index=torch.arange(bs),
        sampling=build_sampling_batch(reqs, vocab_size),
        seq_lens=positions + 1,
    )
    return ScheduleBatch(reqs, fb)
