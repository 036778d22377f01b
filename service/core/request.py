"""Requests as the scheduler sees them: sampling settings, state, outputs."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from service.core.text import IncrementalDetokenizer, StopStringMatcher


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # the client or the server aborted it
    ERROR = "error"  # a fault while serving this request


class RequestError(Exception):
    """A request that cannot be served; `code` is a gRPC status code name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
MAX_SEED = 2**64 - 1
MAX_SAMPLES = 128  # `n` of one call (the SMG worker contract, the OpenAI gateway)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value's magnitude, as OpenAI's API
MAX_LOGIT_BIAS_TOKENS = 1024


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request for n samples: the seed itself for sample 0 (so n = 1
    is unchanged), a distinct one derived from it for the others (splitmix64 of seed + index x the
    golden ratio), so each sample differs and all repeat with the seed. None stays None (random)."""
    if seed is None or index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


# generation_config.json keys that set a request's sampling defaults (generation_defaults): the
# values taken (others are left out)
GENERATION_DEFAULTS: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v == int(v) and v >= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0,
}


@dataclass
class SamplingParams:
    """Sampling settings of one request (see proto SamplingParams)."""

    max_new_tokens: int | None = None  # None: DEFAULT_MAX_NEW_TOKENS, capped by the context
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError(INVALID_ARGUMENT) naming the first bad field."""

        def bad(name: str, why: str) -> RequestError:
            return RequestError("INVALID_ARGUMENT", f"sampling.{name}: {why}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise bad("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "must not exceed max_new_tokens")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (all) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise bad("stop_token_ids", f"token id {t} outside the vocabulary [0, {vocab_size})")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", f"must be in [0, 2^64), got {self.seed}")
        if any(s == "" for s in self.stop):
            raise bad("stop", "stop strings must not be empty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for t, v in self.logit_bias.items():
            if not 0 <= t < vocab_size:
                raise bad("logit_bias", f"token id {t} outside the vocabulary [0, {vocab_size})")
            if not (math.isfinite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                raise bad("logit_bias", f"token {t}: the bias must be in [-100, 100], got {v}")

    @property
    def greedy(self) -> bool:
        # A vanishing temperature is greedy: dividing by it would overflow the logits.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def generation_defaults(generation: dict) -> tuple[SamplingParams, int | None]:
    """What a model's generation_config.json sets for a request that leaves it unset: the sampling
    fields (temperature, top_p, top_k, min_p, repetition_penalty) and max_new_tokens (the engine
    caps it by the context); the built-in defaults elsewhere, and for values of the wrong kind or
    range."""
    p = SamplingParams()
    for name, takes in GENERATION_DEFAULTS.items():
        v = generation.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and takes(v):
            setattr(p, name, int(v) if name == "top_k" else float(v))
    most = generation.get("max_new_tokens")
    return p, most if type(most) is int and most >= 1 else None  # not a bool; None: the model sets none


@dataclass
class RequestOutput:
    """One delta for a client: new tokens and text, and the end when finished."""

    rid: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    # Feature result fields by feature name: each the feature's own dataclass (e.g. LogprobFields).
    extras: dict[str, Any] = field(default_factory=dict)
    error_code: str = "INTERNAL"  # gRPC status code name, with error
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


OutputSink = Callable[[list[RequestOutput]], None]


class Req:
    """A request's scheduling state. Owned by the scheduler thread."""

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        detokenizer: IncrementalDetokenizer,
        stop_ids: frozenset[int],
        features: dict[str, Any] | None = None,
    ):
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_new_tokens = params.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.seed = seed
        self.detok = detokenizer
        self.stops = StopStringMatcher(params.stop)
        self.stop_ids = stop_ids  # stop_token_ids, and EOS unless ignore_eos
        self.output_ids: list[int] = []  # real tokens, in order
        self.launched = 0  # output tokens launched (processed or in flight)
        self.slot = -1  # request slot (req-to-token row, sampler state row)
        self.kv_len = 0  # tokens whose KV rows are allocated
        self.next_input = -1  # next decode input: a token id or a future placeholder
        self.finished: FinishReason | None = None
        self.features: dict[str, Any] = features or {}  # feature name -> validated payload
        self.feature_stop = False  # set by a feature (e.g. a finished grammar): stop after this token
        self.feature_state: dict[str, Any] = {}  # per-request state a feature keeps (e.g. a matcher)
        self.ban_stop_before_min = True  # False when a grammar governs termination
        self.arrival = time.monotonic()
        self.skipped_by = 0  # requests admitted ahead of it while it waited for KV
        # Prefix cache (service/engine/cache_manager.py): the matched prompt tokens, the leading
        # rows the cache's tree owns (the match, then the prompt once prefilled) and the
        # deepest tree node this request locks.
        self.cached_tokens = 0
        self.cache_owned = 0
        self.cache_node: Any = None
        # A recurrent model's prompt: the snapshot of its states after it, until the tree takes it.
        self.prompt_snapshot: Any = None
        # ... and where its prompt parts from a cached one (chunked prefill cuts a chunk there, and the
        # cache keeps a snapshot after it: a shared system prompt's); 0: nowhere.
        self.snapshot_at = 0
        # What a prefix cache matches the prompt by: its ids, except where equal ids stand for
        # different content (a feature sets it, e.g. image-token spans keyed by the image's hash).
        self.prompt_key: list[int] | None = None
        # Constant per-request sampling row, built once (temperature, top_k, top_p,
        # min_p, repetition, frequency, presence).
        p = params
        self.sampling_row = (
            p.temperature if not p.greedy else 0.0,
            float(p.top_k),
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        )
        self.uses_penalties = (
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        )
        self.banned_ids = sorted(stop_ids)  # forbidden while below min_new_tokens
        self.bias_ids = sorted(p.logit_bias)  # added to these tokens' logits at every step
        self.bias_values = [p.logit_bias[t] for t in self.bias_ids]

    @property
    def budget_tokens(self) -> int:
        """KV rows this request may need at most (reserved at admission)."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def prefill_ids(self) -> list[int]:
        """What a (re-)prefill writes to the KV: the prompt, and a retracted request's kept output."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, fin={self.finished})"
