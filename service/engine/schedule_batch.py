"""Batch formation: from chosen requests to a ForwardBatch snapshot.

The functions here allocate KV rows, update the request-to-token table and the
requests' counters, and build fresh tensors (never views of shared state), so
the forward thread can read a batch while the scheduler edits its tables.
Metadata is built on the host and sent to the device in one non-blocking
transfer per dtype; the table write and the KV-index gather then run on the
device, on the scheduler's stream (the forward waits for it with an event).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from service.core.device import CPU, Device
from service.core.feature import BatchView, Feature, OverlapSupport
from service.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch
from service.core.request import Req
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool


@dataclass
class ScheduleBatch(BatchView):
    """A formed batch: its requests (row order) and what the forward reads (BatchView), and what the
    scheduler keeps about it while it is in flight."""

    # Overlap loop: the placeholders standing in for this batch's sampled tokens.
    placeholders: list[int] | None = None
    # Features the batch carries (with their rows) and the weakest overlap support among them.
    plan: list[tuple[Feature, list[int]]] = field(default_factory=list)
    support: OverlapSupport = OverlapSupport.FULL
    after_launch_pending: bool = False  # overlap loop: its after_launch hooks wait for older results
    hook_error: Exception | None = None  # a feature hook failed: the batch's requests fail
    number: int = 0  # formation order, kept by a recurrent model's prefix cache (state_snapshots.py)
    # Chunked prefill (service/engine/chunking.py): plan entries of the chunking module itself.
    own_plan: list[tuple[Feature, list[int]]] = field(default_factory=list)


def build_sampling_batch(
    reqs: list[Req], vocab_size: int, discarded: list[int] | None = None
) -> SamplingBatch:
    """Per-row sampling tensors (host). Call after the requests' `launched` counters moved.
    `discarded`: rows whose sampled token is thrown away (non-final prompt chunks)."""
    rows = torch.tensor([r.sampling_row for r in reqs], dtype=torch.float32)
    temps, top_k, top_p, min_p = rows[:, 0], rows[:, 1].to(torch.int64), rows[:, 2], rows[:, 3]
    top_k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
    sampled = temps > 0
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    for i, r in enumerate(reqs):
        if r.launched - 1 < r.params.min_new_tokens and r.ban_stop_before_min:
            banned_rows.extend([i] * len(r.banned_ids))
            banned_tokens.extend(r.banned_ids)
        if r.bias_ids:
            bias_rows.extend([i] * len(r.bias_ids))
            bias_tokens.extend(r.bias_ids)
            bias_values.extend(r.bias_values)
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
        bias_rows=torch.tensor(bias_rows, dtype=torch.int64) if bias_rows else None,
        bias_tokens=torch.tensor(bias_tokens, dtype=torch.int64) if bias_rows else None,
        bias_values=torch.tensor(bias_values, dtype=torch.float32) if bias_rows else None,
        kept=torch.tensor([i not in discarded for i in range(len(reqs))]) if discarded else None,
    )


_SAMPLING_TENSORS = (
    "temperatures",
    "top_ks",
    "top_ps",
    "min_ps",
    "repetition_penalties",
    "frequency_penalties",
    "presence_penalties",
    "seeds",
    "steps",
    "req_slots",
    "banned_rows",
    "banned_tokens",
    "bias_rows",
    "bias_tokens",
    "bias_values",
    "kept",
)


def _send(
    device: Device, host: dict[str, torch.Tensor | None], sb: SamplingBatch
) -> dict[str, torch.Tensor | None]:
    """The batch's host tensors and the sampling tensors -> the device, in one transfer
    per dtype (sampling tensors are replaced on `sb` in place)."""
    named = {k: v for k, v in host.items() if v is not None}
    for k in _SAMPLING_TENSORS:
        if getattr(sb, k) is not None:
            named["sb." + k] = getattr(sb, k)
    sent = dict(zip(named, device.to_device(*named.values())))
    for k in _SAMPLING_TENSORS:
        if "sb." + k in sent:
            setattr(sb, k, sent["sb." + k])
    return {k: sent.get(k) for k in host}


@dataclass
class ExtendRow:
    """One request's part of an extend batch: the tokens this step writes to its KV.

    `prefix_len` tokens of the request are in its KV already (a cached prefix, earlier
    chunks): their rows are in the request-to-token table at positions [0, prefix_len)
    and the new tokens go at [prefix_len, prefix_len + len(token_ids)). A token may be
    a future placeholder (a decode row riding in a mixed batch)."""

    req: Req
    token_ids: list[int]
    prefix_len: int = 0
    new_slot: bool = True  # the request's per-slot sampling state starts with this step
    # The row continues the output (a running request's next token in a mixed batch): its counters
    # advance as in a decode batch.
    decodes: bool = False

    @property
    def partial(self) -> bool:
        """A prefill chunk that is not the last (of the prompt, or of a retracted request's prompt and
        kept tokens): the token sampled after it is not the request's."""
        return not self.decodes and self.prefix_len + len(self.token_ids) < len(self.req.prefill_ids)


def build_extend_batch(
    reqs: list[Req],
    req_pool: ReqToTokenPool,
    kv_pool: TokenToKVPool,
    vocab_size: int,
    device: Device = CPU,
    rows: list[ExtendRow] | None = None,
) -> ScheduleBatch:
    """Extend each (slotted) request by its row's tokens; by default the whole prompt of a new request."""
    if rows is None:
        rows = [ExtendRow(r, r.prompt_ids) for r in reqs]
    assert [row.req for row in rows] == reqs
    lens = [len(row.token_ids) for row in rows]
    prefix = [row.prefix_len for row in rows]
    total = sum(lens)
    locs = kv_pool.alloc(total)
    q_lens = torch.tensor(lens, dtype=torch.int64)
    prefix_t = torch.tensor(prefix, dtype=torch.int64)
    starts = torch.cumsum(q_lens, 0) - q_lens
    slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64)
    token_slots = torch.repeat_interleave(slots, q_lens)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
    req_pool.write_host(token_slots, positions, locs)
    for row, p, n in zip(rows, prefix, lens):
        row.req.kv_len = p + n
        # A decode row advances by one; a prefill row samples the output token after its kept ones
        # (none, or a retracted request's: its re-prefill continues the seeded sampling steps).
        row.req.launched = row.req.launched + 1 if row.decodes else len(row.req.output_ids) + 1
    bs, lq = len(reqs), max(lens)
    j = torch.arange(lq).unsqueeze(0)
    valid = j < q_lens.unsqueeze(1)
    sampling = build_sampling_batch(reqs, vocab_size, [i for i, row in enumerate(rows) if row.partial])
    input_ids = torch.tensor([t for row in rows for t in row.token_ids], dtype=torch.int64)
    # Rows whose sampling state starts now: their prompts mark the penalty state.
    fresh = [row.req for row in rows if row.new_slot]
    prompts = [torch.tensor(r.prompt_ids, dtype=torch.int64) for r in fresh]
    fresh_slots = torch.tensor([r.slot for r in fresh], dtype=torch.int64)
    prompt_slots = torch.repeat_interleave(
        fresh_slots, torch.tensor([len(r.prompt_ids) for r in fresh], dtype=torch.int64)
    )
    host = {
        "input_ids": input_ids,
        "positions": positions,
        "locs": locs,
        "slots": slots,
        "token_slots": token_slots,
        "q_positions": torch.where(valid, prefix_t.unsqueeze(1) + j, 0),
        "logits_index": starts + q_lens - 1,
        "q_pad_index": torch.where(valid, starts.unsqueeze(1) + j, total).reshape(-1),
        "q_unpad_index": (torch.arange(bs).unsqueeze(1) * lq + j)[valid],
        "seq_lens": prefix_t + q_lens,
        "prefix_lens": prefix_t,
        "starts": starts,
        "fresh_slots": fresh_slots if fresh else None,
        "prompt_slots": prompt_slots if fresh else None,
        "prompt_tokens": torch.cat(prompts) if fresh else None,
    }
    d = _send(device, host, sampling)
    req_pool.write_device(d["token_slots"], d["positions"], d["locs"])
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=d["input_ids"],
        positions=d["positions"],
        out_cache_loc=d["locs"],
        kv_indices=req_pool.gather(d["slots"], max(p + n for p, n in zip(prefix, lens))),
        q_positions=d["q_positions"],
        logits_index=d["logits_index"],
        sampling=sampling,
        q_pad_index=d["q_pad_index"],
        q_unpad_index=d["q_unpad_index"],
        extend_lens=lens,
        new_slots=d["fresh_slots"],
        new_prompts=prompts,
        seq_lens=d["seq_lens"],
        extend_prefix_lens=d["prefix_lens"],
        extend_start_loc=d["starts"],
        max_extend_len=lq,
        extend_prefix_lens_cpu=prefix,
        extend_start_loc_cpu=starts.tolist(),
        extend_decodes_cpu=[row.decodes for row in rows],
        new_prompt_slots=d["prompt_slots"],
        new_prompt_tokens=d["prompt_tokens"],
    )
    return ScheduleBatch(reqs, fb, partial_rows=frozenset(i for i, row in enumerate(rows) if row.partial))


def build_decode_batch(
    reqs: list[Req], req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, vocab_size: int, device: Device = CPU
) -> ScheduleBatch:
    """One new token per request; inputs may be future placeholders."""
    bs = len(reqs)
    slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64)
    kv_lens = [r.kv_len for r in reqs]
    positions = torch.tensor(kv_lens, dtype=torch.int64)
    locs = kv_pool.alloc(bs)
    req_pool.write_host(slots, positions, locs)
    for r in reqs:
        r.kv_len += 1
        r.launched += 1
    sampling = build_sampling_batch(reqs, vocab_size)
    d = _send(
        device,
        {
            "input_ids": torch.tensor([r.next_input for r in reqs], dtype=torch.int64),
            "positions": positions,
            "locs": locs,
            "slots": slots,
            "seq_lens": positions + 1,
            "logits_index": torch.arange(bs),
        },
        sampling,
    )
    req_pool.write_device(d["slots"], d["positions"], d["locs"])
    fb = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=d["input_ids"],
        positions=d["positions"],
        out_cache_loc=d["locs"],
        kv_indices=req_pool.gather(d["slots"], max(kv_lens) + 1),
        q_positions=d["positions"].unsqueeze(1),
        logits_index=d["logits_index"],
        sampling=sampling,
        seq_lens=d["seq_lens"],
        extend_prefix_lens=d["positions"],
        extend_start_loc=d["logits_index"],
        max_extend_len=1,
    )
    return ScheduleBatch(reqs, fb)
