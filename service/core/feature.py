"""The feature-module interface.

A feature module says how it gets along with the overlap loop (`support`, with
a one-line `reason`), which requests use it (`active_for`), and implements any
of the hooks below; the scheduler and the worker call them at fixed, named
points. Hooks run on the thread named in their docstring — never both.

    caller thread     from_proto / validate    request admission (gRPC handler / API)
                      pending                  work to finish before the request is queued (awaited
                                               by the server off the event loop, e.g. a grammar compile)
                      to_proto                 a response (delta) for the client
    scheduler thread  on_admit                 the request joins the scheduler
                      admission_ready          may it be scheduled now? (e.g. grammar compiled)
                      on_batch_formed          a batch with active rows was formed
                      after_launch             the batch's forward runs meanwhile; called once the
                                               results of all earlier batches were processed
                      on_result                the batch's result is on the host, per row
                      waited_on_host           (overlap loop, at result) did its forward wait for us?
                      on_retract               the request was retracted; rebuild state from its kept tokens
                      on_finish                the request ended (any reason); may add fields to its last message
                      on_chunk_result          (chunked prefill, features that read chunks) a non-final
                                               prompt chunk's result is on the host, per row
    caller thread     expand_prompt            (prompt hooks) the prompt the model sees, e.g. image
                                               placeholders expanded into per-image token runs
    forward thread    before_forward           right before the model runs
                      modify_embeddings        input embeddings, before the first layer (e.g. images)
                      rope_positions           (M-RoPE models) the [3, T] positions the rotary embeddings see
                      process_logits           at sampling: mask / bias the logits
                      after_sampling           tokens sampled: compute extra outputs
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future
    from pathlib import Path

    import torch

    from service.core.device import Device
    from service.core.forward_batch import ForwardBatch, ForwardMode, LogitsOutput
    from service.core.request import Req


class OverlapSupport(Enum):
    """How a feature gets along with the overlap loop (best first)."""

    FULL = "full"  # runs inside the overlap loop as is
    SYNC_POINT = "sync point"  # needs the previous batch's result before its batch launches
    NONE = "none"  # its batches run the normal way (launch, wait, process)

    @property
    def rank(self) -> int:
        return {"full": 0, "sync point": 1, "none": 2}[self.value]


@dataclass
class FeatureContext:
    """What a feature sees of the engine: bound once the model and tokenizer exist (`bind`), and
    passed to `validate` and `unavailable_reason`. Nothing else of the engine reaches a feature."""

    args: Any  # the serving options (service/config.py's ServerArgs)
    tokenizer: Any  # service/tokenizer.py's Tokenizer
    hf_config: Any  # the checkpoint's configuration (transformers)
    model_dir: Path
    device: Device
    dtype: torch.dtype
    vocab_size: int
    eos_ids: frozenset[int]
    # Forward thread: count (slot, token) pairs into the sampler's penalty state.
    count_tokens: Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class BatchView:
    """What a scheduler-thread hook sees of a formed batch: its requests in row order, the
    forward's inputs and the rows that are a prompt's non-final chunk (chunked prefill: their sampled
    token is not the request's). The scheduler's own batch (service/engine/schedule_batch.py) extends it."""

    reqs: list[Req]
    fb: ForwardBatch
    partial_rows: frozenset[int] = frozenset()

    @property
    def mode(self) -> ForwardMode:
        return self.fb.mode


class Feature:
    """Base class: override the declaration and the hooks the feature needs."""

    name: str = ""
    support: OverlapSupport = OverlapSupport.FULL
    reason: str = ""
    # An event outside any one batch at which the overlap loop first processes every result in
    # flight for this feature (e.g. a KV shortage that retracts requests): a sync point per event,
    # counted apart from its batches (the matrix row's `event_syncs` counter). "" when there is none.
    sync_event: str = ""
    # Reads the model's raw logits (after_sampling) or needs them as float32: the forward then
    # converts the logits once and keeps a raw copy; a batch without such a feature samples from
    # the model's dtype (bf16) with no copy.
    reads_raw_logits: bool = True

    # ---- declaration -----------------------------------------------------------------
    def declared_support(self) -> str:
        """The declaration as the matrix shows it: its batches' support, and its sync event if any."""
        event = f"; sync point at each {self.sync_event}" if self.sync_event else ""
        return self.support.value + event

    def bind(self, ctx: FeatureContext) -> None:
        """Called once the engine (tokenizer, model) exists, with what the feature may use of it."""

    def unavailable_reason(self, model: FeatureContext | None) -> str | None:
        """None when this model can serve the feature, else why not (e.g. images on a text-only model)."""
        return None

    def active_for(self, req: "Req") -> bool:
        """Whether the request uses the feature (default: it carries a payload for it)."""
        return self.name in req.features

    # ---- caller thread -----------------------------------------------------------------
    def from_proto(self, request: Any) -> Any:
        """The feature's payload from a GenerateRequest message, or None when unused."""
        return None

    def to_proto(self, response: Any, fields: list[Any]) -> None:
        """Write the result fields (the feature's own dataclass, from on_result / on_finish) of one or
        more deltas into a GenerateResponse."""

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> Any:
        """Check and normalise a request's payload; raise RequestError when bad."""
        return payload

    def pending(self, payload: Any) -> "Future | None":
        """A future the request should wait for before it is queued, or None. Its exception (a
        RequestError) fails the request at validation; cancelling it says nobody waits any more."""
        return None

    def shutdown(self) -> None:
        """The engine stops: release what the feature holds (threads, processes) without blocking."""

    # ---- scheduler thread --------------------------------------------------------------
    def on_admit(self, req: "Req") -> None:
        pass

    def admission_ready(self, req: "Req") -> bool:
        """False keeps the request waiting (others go ahead); raise RequestError to fail it."""
        return True

    def on_batch_formed(self, batch: "BatchView", rows: list[int]) -> None:
        """`rows` are the batch rows whose requests use the feature."""

    def after_launch(self, batch: "BatchView", rows: list[int]) -> None:
        pass

    def on_result(self, batch: "BatchView", row: int, req: "Req", extras: Any) -> Any:
        """Per active row, after its token was appended. `extras` is what after_sampling returned
        for the batch (on the host). Returns the feature's result fields for the client (a dataclass
        of its own, written into the response by to_proto), or None."""
        return None

    def waited_on_host(self, batch: "BatchView") -> bool:
        """Once the batch's result is processed: whether its forward waited on the host for this
        feature's scheduler-side work (e.g. a mask not filled yet at sampling) — the batch then became a
        sync point, counted in the matrix (`batches_synced`), whatever the declaration says."""
        return False

    def on_retract(self, req: "Req") -> None:
        """The request lost its KV and will be re-run from prompt + kept output tokens."""

    def on_finish(self, req: "Req") -> Any:
        """The request ended (`req.finished` says how); returns result fields (as on_result) for its
        final message, or None."""
        return None

    # ---- prefix cache (scheduler thread) -----------------------------------------------
    # False for engine-level modules that no request carries (the prefix cache's own entry):
    # they are in the matrix, but the per-feature workload harness does not apply to them.
    per_request: bool = True

    def max_cached_prefix(self, req: "Req") -> int | None:
        """The most leading prompt tokens the request may take from the prefix cache instead of
        prefilling them (None: no limit), e.g. 0 for a feature that must see every position."""
        return None

    # ---- forward thread ----------------------------------------------------------------
    def before_forward(self, fb: "ForwardBatch") -> None:
        pass

    def modify_embeddings(self, fb: "ForwardBatch", hidden: "torch.Tensor") -> "torch.Tensor":
        """Packed input embeddings [T, hidden] -> the ones the first layer sees."""
        return hidden

    def changes_embeddings(self, fb: "ForwardBatch") -> bool:
        """Whether this batch's model inputs change (embeddings via modify_embeddings, M-RoPE positions
        via rope_positions): a decode CUDA graph, which covers the model from the token ids on, cannot
        run it then. Default: whenever either is overridden."""
        cls = type(self)
        return (
            cls.modify_embeddings is not Feature.modify_embeddings
            or cls.rope_positions is not Feature.rope_positions
        )

    def rope_positions(self, fb: "ForwardBatch", positions: "torch.Tensor") -> "torch.Tensor":
        """M-RoPE models only: the (time, height, width) positions [3, T] of the packed tokens
        (each stream the token's KV position on entry) -> the ones the rotary embeddings use."""
        return positions

    def process_logits(self, fb: "ForwardBatch", logits: "torch.Tensor") -> "torch.Tensor":
        return logits

    def after_sampling(self, fb: "ForwardBatch", logits: "LogitsOutput", next_ids: "torch.Tensor") -> Any:
        """Extra per-batch outputs: a dataclass of the feature's own whose tensors are copied to the
        host with the tokens, handed to on_result. `logits` are the model's raw logits, before
        penalties, temperature and other features' masks."""
        return None

    # ---- chunked prefill (service/engine/chunking.py) ------------------------------------
    # A prompt split across steps yields, for each non-final chunk, a batch row whose sampled
    # token is not the request's. Features see such rows only when they read prompt chunks
    # (e.g. input logprobs); the others first see the request at its last chunk.
    reads_prompt_chunks: bool = False

    def on_chunk_result(self, batch: "BatchView", row: int, req: "Req", extras: Any) -> None:
        """Scheduler thread, per active non-final chunk row (reads_prompt_chunks only): keep what
        the chunk yielded for the request's first output; emit nothing."""

    def counters(self) -> dict[str, int]:
        """Feature-specific counters for the matrix (e.g. chunks run), by name."""
        return {}

    # ---- prompt hooks (caller thread, before validation; added for multimodal input) -------
    def expand_prompt(self, payload: Any, prompt_ids: list[int]) -> list[int]:
        """The prompt the model sees, for every request of an enabled feature (`payload` None when the
        request does not use it): e.g. one image placeholder -> the image's run of image tokens.
        Raise RequestError when the prompt and the payload disagree."""
        return prompt_ids
