"""Workloads and per-request figures for the peer benchmark (`bench/peers.py`).

A workload is a list of `RequestSpec` (prompt, tokens to generate, arrival time); every system
turns each spec into a `RequestRecord` (when its first and last tokens came); `summarize` makes
the same `Stats` from those records whatever system produced them.

- burst: the issue's workload, `build_prompts(n)` chat prompts, all sent at t = 0.
- realistic: seeded long-tailed (lognormal, clipped) prompt and output lengths, Poisson arrivals.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol

from bench_serving import build_prompts, pct


@dataclass(frozen=True)
class RequestSpec:
    prompt: str  # the user message of a one-turn chat
    max_new_tokens: int  # generated exactly (ignore_eos)
    arrival_s: float = 0.0  # offset from the workload's start (paced workloads only)


@dataclass
class RequestRecord:
    """One request's timing, in seconds from when it was sent."""

    first_token_s: float
    last_token_s: float
    end_s: float  # the response (stream) is complete
    output_tokens: int
    token_gaps_s: list[float] = field(default_factory=list)  # one per token after the first


@dataclass
class Stats:
    requests: int
    output_tokens: int
    wall_s: float
    tok_per_s: float
    req_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float  # over all inter-token gaps of all requests
    itl_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    ttft_ms: list[float]  # samples, for the CDF plots
    itl_ms: list[float]
    e2e_ms: list[float]


def summarize(records: list[RequestRecord], wall_s: float) -> Stats:
    ttft = [round(r.first_token_s * 1e3, 3) for r in records]  # ms, to the µs: enough, and a smaller JSON
    itl = [round(g * 1e3, 3) for r in records for g in r.token_gaps_s]
    e2e = [round(r.end_s * 1e3, 3) for r in records]
    tokens = sum(r.output_tokens for r in records)
    return Stats(
        requests=len(records), output_tokens=tokens, wall_s=wall_s,
        tok_per_s=tokens / wall_s, req_per_s=len(records) / wall_s,
        ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), itl_p50_ms=pct(itl, 50), itl_p99_ms=pct(itl, 99),
        e2e_p50_ms=pct(e2e, 50), e2e_p99_ms=pct(e2e, 99), ttft_ms=ttft, itl_ms=itl, e2e_ms=e2e,
    )  # fmt: skip


def split_gap(gap_s: float, tokens: int) -> list[float]:
    """A chunk of `tokens` tokens that arrived `gap_s` after the previous one: one gap per token."""
    return [gap_s / tokens] * tokens


# ---- burst -------------------------------------------------------------------------------
def burst_specs(num_prompts: int, max_new_tokens: int) -> list[RequestSpec]:
    return [RequestSpec(p, max_new_tokens) for p in build_prompts(num_prompts)]


# ---- realistic ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    """Lognormal with this median and sigma (of the log), rounded and clipped to [low, high]."""

    median: int
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return min(self.high, max(self.low, round(rng.lognormvariate(math.log(self.median), self.sigma))))


@dataclass(frozen=True)
class RealisticConfig:
    rate: float = 2.0  # mean arrivals per second (Poisson)
    num_requests: int = 64
    duration_s: float | None = None  # when set: every arrival before it, instead of num_requests
    seed: int = 0
    prompt_tokens: LengthDist = LengthDist(median=128, sigma=0.8, low=16, high=1024)
    output_tokens: LengthDist = LengthDist(median=64, sigma=0.8, low=8, high=256)


@dataclass(frozen=True)
class RequestShape:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def realistic_shapes(cfg: RealisticConfig) -> list[RequestShape]:
    """Arrival times and lengths; the same config (seed included) gives the same list."""
    if cfg.rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(cfg.seed)
    shapes: list[RequestShape] = []
    t = 0.0
    while True:
        t += rng.expovariate(cfg.rate)
        done = t >= cfg.duration_s if cfg.duration_s is not None else len(shapes) >= cfg.num_requests
        if done:
            return shapes
        shapes.append(RequestShape(t, cfg.prompt_tokens.draw(rng), cfg.output_tokens.draw(rng)))


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def realistic_specs(cfg: RealisticConfig, tokenizer: Tokenizer) -> list[RequestSpec]:
    """Prompts of about the drawn length: windows of a fixed text (distinct per request), as a chat turn."""
    corpus = tokenizer.encode(" ".join(build_prompts(512)), add_special_tokens=False)
    specs = []
    for i, s in enumerate(realistic_shapes(cfg)):
        start = (i * 997) % len(corpus)
        window = [corpus[(start + k) % len(corpus)] for k in range(s.prompt_tokens)]
        specs.append(
            RequestSpec(
                f"Answer the questions below.\n{tokenizer.decode(window)}", s.output_tokens, s.arrival_s
            )
        )
    return specs
