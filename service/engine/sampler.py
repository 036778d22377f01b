"""Batched sampling with per-request state kept on the device.

Penalty state (output token counts, prompt-token mask) lives in tensors indexed
by request slot and is updated by the forward thread right after sampling, so
penalties only ever see real tokens, never future placeholders.

Randomness is counter-based: the noise for (seed, step, token) is a hash, so a
request's samples depend only on its own seed and position — never on which
other requests share the batch, nor on the loop that ran it.
"""

from __future__ import annotations

import torch

from service.core.forward_batch import SamplingBatch
from service.models.cpu_kernels import argmax_rows

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 lanes holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[bs, vocab] float32 uniforms in (0, 1), a pure function of (seed, step, token)."""
    key = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ _mix32(steps & _M32)))
    tok = (torch.arange(vocab, dtype=torch.int64, device=seeds.device) * 0x9E3779B9) & _M32
    h = _mix32(key.unsqueeze(1) ^ tok.unsqueeze(0))
    # 23 bits + 0.5 is exact in float32, so u < 1 strictly (24 bits would round to 1.0).
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


class Sampler:
    """Turns logits into next tokens; owns the per-slot penalty state."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        # Values for index_put_ already on the device: `t[index] = scalar` copies the scalar
        # from the host, a synchronizing copy on CUDA.
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self._neg_inf = torch.full((), float("-inf"), device=device)

    def reset_slots(self, slots: torch.Tensor, token_slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """New requests took `slots`: forget the previous owners' tokens and mark each
        (token_slots[i], tokens[i]) prompt token. Device tensors; no host sync."""
        self.counts.index_fill_(0, slots, 0)
        self.prompt_mask.index_fill_(0, slots, False)
        self.prompt_mask.index_put_((token_slots, tokens), self._true)

    def count_tokens(self, token_slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count (token_slots[i], tokens[i]) as generated (a retracted request's kept tokens,
        after its new slot was reset). Device tensors; no host sync."""
        self.counts.index_put_(
            (token_slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
        )

    def apply_penalties(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        counts = self.counts[sb.req_slots]
        seen = counts > 0
        rep = sb.repetition_penalties.unsqueeze(1)
        appeared = seen | self.prompt_mask[sb.req_slots]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(appeared, penalised, logits)
        logits = logits - sb.frequency_penalties.unsqueeze(1) * counts
        return logits - sb.presence_penalties.unsqueeze(1) * seen

    def sample(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Next token ids [bs] int64 for logits [bs, vocab] (any float dtype).

        Token counts (penalty state) are kept only for batches with a penalised
        row: a request's own penalty flag never changes, so a batch without one
        holds no row whose counts are ever read.
        """
        logits = logits[:, : self.vocab_size]
        edits = sb.banned_rows is not None or sb.bias_rows is not None
        if sb.all_greedy and not sb.need_penalties and not edits:
            return argmax_rows(logits)  # the greedy fast path: no float copy, no softmax
        # Edits go to a copy: the model's logits stay as they are (logprobs read them). The
        # penalties make a new tensor before the bans, not before the bias.
        copy = sb.bias_rows is not None or (sb.banned_rows is not None and not sb.need_penalties)
        logits = logits.to(torch.float32, copy=copy)
        if sb.bias_rows is not None:  # before the penalties, as vLLM applies it
            logits.index_put_((sb.bias_rows, sb.bias_tokens), sb.bias_values, accumulate=True)
        if sb.need_penalties:
            logits = self.apply_penalties(logits, sb)  # a new tensor
        if sb.banned_rows is not None:
            logits.index_put_((sb.banned_rows, sb.banned_tokens), self._neg_inf)
        greedy = argmax_rows(logits)
        if sb.all_greedy:
            ids = greedy
        else:
            temps = torch.where(sb.temperatures > 0, sb.temperatures, torch.ones_like(sb.temperatures))
            probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
            if sb.need_top_k_p:
                probs = self._top_k_top_p(probs, sb.top_ks, sb.top_ps)
            if sb.need_min_p:
                top = probs.max(dim=-1, keepdim=True).values
                probs = torch.where(probs < sb.min_ps.unsqueeze(1) * top, 0.0, probs)
            # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p.
            noise = -torch.log(counter_uniform(sb.seeds, sb.steps, probs.shape[1]))
            # Tokens with zero probability (masked, filtered) can never win, whatever the noise.
            sampled = torch.where(probs > 0, probs / noise, -1.0).argmax(dim=-1)
            ids = torch.where(sb.temperatures > 0, sampled, greedy)
        if sb.need_penalties:
            ones = torch.ones_like(ids, dtype=torch.int32) if sb.kept is None else sb.kept.to(torch.int32)
            self.counts.index_put_((sb.req_slots, ids), ones, accumulate=True)
        return ids

    @staticmethod
    def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
        drop = rank >= top_ks.unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        # (rows with top_p = 1 keep everything: float rounding of the cumsum must not cut their tail)
        drop |= ((sorted_p.cumsum(dim=-1) - sorted_p) >= top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)
