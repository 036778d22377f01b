"""Logprobs, fully overlapped.

Output (and, when asked, input) token logprobs, top-N alternatives and the
logprobs of chosen token ids. They are those of the model's raw next-token
distribution — log_softmax of the logits before temperature, penalties and
grammar masks — whatever the sampling settings. Everything is computed on the
forward thread right after sampling and travels to the host with the tokens,
so the overlap loop needs no extra synchronisation point.

Input logprobs are chunk-aware: a batch row covers prompt positions
[chunk_start, chunk_start + chunk_len) and yields the logprobs of the tokens it
can score itself (position p needs the logits at p - 1). The chunk's first
position takes the previous chunk's last row; with whole-prompt prefill
(chunk_start = 0) position 0 has no logprob.

Chunked prefill (service/engine/chunking.py): a non-final chunk's row is seen here
(`reads_prompt_chunks`). Its last row scores the next chunk's first token (the
boundary: the row's "output" logprob targets that prompt token instead of the
discarded sample); `on_chunk_result` keeps the chunk's entries on the request
and its first output message carries them all, as without chunking. A decode row
riding in a mixed extend batch (prefix at or past the prompt) gets output
logprobs only, like a decode batch's row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from service.core.device import Device
from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.forward_batch import ForwardBatch, ForwardMode, LogitsOutput
from service.core.request import Req, RequestError

MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS = 128

# (token_id, logprob, top [(id, logprob)], token_ids [(id, logprob)]); the texts are decoded when a
# zerogap.v1 response is built (to_proto), off the scheduler thread
TokenEntry = tuple[int, float, list[tuple[int, float]], list[tuple[int, float]]]


@dataclass(frozen=True)
class LogprobParams:
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    logprob_start_len: int = -1  # -1: no input logprobs


@dataclass
class LogprobLists:
    """LogprobValues as host lists, converted once per batch for all its rows."""

    lp: list[float]
    top_vals: list[list[float]] | None
    top_ids: list[list[int]] | None
    tid_vals: list[list[float]] | None


@dataclass
class LogprobValues:
    """Logprobs of a set of scored positions (one per row, or per scored prompt position): the
    target token's, and when asked the top-N alternatives and the listed token ids'."""

    lp: torch.Tensor  # [n]
    top_vals: torch.Tensor | None = None  # [n, top_n], best first
    top_ids: torch.Tensor | None = None  # [n, top_n]
    tid_vals: torch.Tensor | None = None  # [n, width]: of the token ids each row asks for
    _lists: LogprobLists | None = field(default=None, init=False, repr=False, compare=False)

    def lists(self) -> LogprobLists:
        if self._lists is None:
            self._lists = LogprobLists(
                self.lp.tolist(), _tolist(self.top_vals), _tolist(self.top_ids), _tolist(self.tid_vals)
            )
        return self._lists


def _tolist(t: torch.Tensor | None) -> Any:
    return None if t is None else t.tolist()


@dataclass
class LogprobsOutput:
    """What after_sampling returns (copied to the host with the tokens): the output logprobs, one
    per active row, and the input logprobs of the prompt positions this extend scores."""

    output: LogprobValues
    input: LogprobValues | None = None


@dataclass
class LogprobFields:
    """Result fields of one delta: its output tokens' entries and, on a request's first output
    only, the prompt's (from `input_start`) and their mean."""

    output: list[TokenEntry] = field(default_factory=list)
    input: list[TokenEntry] | None = None
    input_start: int = 0
    normalized_prompt_logprob: float = 0.0


@dataclass
class KeptInputLogprobs:
    """Chunked prefill (`req.feature_state["logprobs"]`): the input entries of a request's
    non-final chunks, for its first output message."""

    start: int | None = None  # prompt position of the first entry
    entries: list[TokenEntry] = field(default_factory=list)


@dataclass
class LogprobsBatch:
    """A batch's logprob plan (`fb.feature_data[LogprobsBatch]`): built on the scheduler thread, its
    tensors sent to the device in one transfer, read by after_sampling on the forward thread."""

    rows: torch.Tensor  # the batch rows that want logprobs
    index: dict[int, int]  # batch row -> its index in `rows`
    top_n: int  # the most top logprobs any of them asks for
    token_ids: torch.Tensor | None  # [len(rows), width]: the token ids each asks the logprob of (padded)
    input_targets: torch.Tensor | None = None  # input logprobs: the prompt token each extra logit row scores
    input_owners: torch.Tensor | None = None  # ... and the index into `rows` it belongs to
    input_spans: dict[int, tuple[int, int, int]] = field(
        default_factory=dict
    )  # row -> (first pos, offset, count)
    boundary: torch.Tensor | None = None  # non-final chunks: the prompt token each row's last logit scores
    boundary_cpu: dict[int, int] = field(default_factory=dict)  # the same on the host, by batch row


class LogprobsFeature(Feature):
    name = "logprobs"
    support = OverlapSupport.FULL
    reason = "computed from the raw logits on the forward thread and copied to host with the tokens"
    reads_prompt_chunks = True  # input logprobs of non-final prompt chunks

    def __init__(self) -> None:
        self._text_cache: dict[int, str] = {}
        self._tokenizer: Any = None  # service/tokenizer.py's Tokenizer
        self._device: Device | None = None  # the engine's Device: batch tensors are sent there

    def bind(self, ctx: FeatureContext) -> None:
        self._tokenizer = ctx.tokenizer
        self._device = ctx.device

    # ---- caller thread -------------------------------------------------------------------
    def from_proto(self, request: Any) -> LogprobParams | None:
        start = request.logprob_start_len if request.HasField("logprob_start_len") else -1
        if not (
            request.return_logprob or request.top_logprobs_num or request.token_ids_logprob or start != -1
        ):
            return None
        return LogprobParams(
            request.return_logprob, request.top_logprobs_num, tuple(request.token_ids_logprob), start
        )

    def validate(self, payload: Any, ctx: FeatureContext, prompt_ids: list[int]) -> LogprobParams:
        p = LogprobParams(**payload) if isinstance(payload, dict) else payload
        if not 0 <= p.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(
                "INVALID_ARGUMENT",
                f"top_logprobs_num: must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs_num}",
            )
        if len(p.token_ids_logprob) > MAX_TOKEN_IDS:
            raise RequestError("INVALID_ARGUMENT", f"token_ids_logprob: at most {MAX_TOKEN_IDS} ids")
        bad = next((t for t in p.token_ids_logprob if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            raise RequestError(
                "INVALID_ARGUMENT", f"token_ids_logprob: token id {bad} outside the vocabulary"
            )
        if not -1 <= p.logprob_start_len < len(prompt_ids):
            raise RequestError(
                "INVALID_ARGUMENT",
                f"logprob_start_len: must be -1 or a prompt position in [0, {len(prompt_ids)}), got {p.logprob_start_len}",
            )
        return p

    def to_proto(self, response: Any, fields: list[LogprobFields]) -> None:
        for f in fields:
            for e in f.output:
                self._add(response.output_logprobs, e)
            if f.input is not None:
                for e in f.input:
                    self._add(response.input_logprobs, e)
                response.input_logprobs_start = f.input_start
                response.normalized_prompt_logprob = f.normalized_prompt_logprob

    def _add(self, repeated: Any, e: TokenEntry) -> None:
        m = repeated.add(token_id=e[0], logprob=e[1], text=self._text(e[0]))
        for tid, lp in e[2]:
            m.top_logprobs.add(token_id=tid, logprob=lp, text=self._text(tid))
        for tid, lp in e[3]:
            m.token_ids_logprobs.add(token_id=tid, logprob=lp)

    # ---- scheduler thread ----------------------------------------------------------------
    def on_batch_formed(self, batch: BatchView, rows: list[int]) -> None:
        fb = batch.fb
        params = [batch.reqs[r].features[self.name] for r in rows]
        data = LogprobsBatch(
            rows=torch.tensor(rows, dtype=torch.int64),
            index={r: j for j, r in enumerate(rows)},
            top_n=max(p.top_logprobs_num for p in params),
            token_ids=self._token_id_matrix(params),
        )
        if fb.mode is ForwardMode.EXTEND:
            self._plan_input_logprobs(batch, rows, params, data)
        self._send(data, fb)
        fb.feature_data.put(data)

    def _send(self, data: LogprobsBatch, fb: ForwardBatch) -> None:
        """The forward reads these on the device: one transfer (scheduler stream)."""
        if self._device is None:
            return
        keys = [f.name for f in dataclasses.fields(data) if isinstance(getattr(data, f.name), torch.Tensor)]
        tensors = [getattr(data, k) for k in keys] + (
            [fb.extra_logit_rows] if fb.extra_logit_rows is not None else []
        )
        sent = self._device.to_device(*tensors)
        for k, t in zip(keys, sent):
            setattr(data, k, t)
        if fb.extra_logit_rows is not None:
            fb.extra_logit_rows = sent[-1]

    @staticmethod
    def _token_id_matrix(params: list[LogprobParams]) -> torch.Tensor | None:
        width = max(len(p.token_ids_logprob) for p in params)
        if width == 0:
            return None
        return torch.tensor(
            [list(p.token_ids_logprob) + [0] * (width - len(p.token_ids_logprob)) for p in params]
        )

    def _plan_input_logprobs(
        self, batch: BatchView, rows: list[int], params: list[LogprobParams], data: LogprobsBatch
    ) -> None:
        """Which packed rows' logits score which prompt tokens (this chunk only)."""
        fb = batch.fb
        extra_rows: list[int] = []
        targets: list[int] = []
        owners: list[int] = []  # index into `rows` of each scored position
        spans: dict[int, tuple[int, int, int]] = {}  # row -> (first position, offset, count)
        boundary = [-1] * len(rows)  # per active row: the prompt token its last row scores (non-final chunks)
        partial = batch.partial_rows
        for j, (r, p) in enumerate(zip(rows, params)):
            req = batch.reqs[r]
            if p.logprob_start_len < 0 or req.output_ids:  # a re-prefill after a retraction: sent already
                continue
            chunk_start = fb.extend_prefix_lens_cpu[r]  # host copies: no device read
            if p.logprob_start_len < 0 or chunk_start >= len(req.prompt_ids):
                continue  # no input logprobs asked, or a decode row of a mixed batch
            chunk_len = fb.extend_lens[r]
            packed_start = fb.extend_start_loc_cpu[r]
            end = min(chunk_start + chunk_len, len(req.prompt_ids))
            if r in partial and end >= p.logprob_start_len:
                boundary[j] = req.prompt_ids[end]
            first = max(p.logprob_start_len, chunk_start + 1)
            positions = range(first, end)
            spans[r] = (first, len(targets), len(positions))
            for pos in positions:
                extra_rows.append(packed_start + pos - chunk_start - 1)
                targets.append(req.prompt_ids[pos])
                owners.append(j)
        if targets:
            fb.extra_logit_rows = torch.tensor(extra_rows, dtype=torch.int64)
            data.input_targets = torch.tensor(targets, dtype=torch.int64)
            data.input_owners = torch.tensor(owners, dtype=torch.int64)
        data.input_spans = spans
        if any(t >= 0 for t in boundary):
            data.boundary = torch.tensor(boundary, dtype=torch.int64)
            data.boundary_cpu = {r: t for r, t in zip(rows, boundary)}  # host copy, by batch row

    def on_result(self, batch: BatchView, row: int, req: Req, extras: LogprobsOutput) -> LogprobFields | None:
        data = batch.fb.feature_data[LogprobsBatch]
        p: LogprobParams = req.features[self.name]
        fields = LogprobFields()
        if p.return_logprob or p.top_logprobs_num or p.token_ids_logprob:
            fields.output = [self._entry(req.output_ids[-1], extras.output.lists(), data.index[row], p)]
        span = data.input_spans.get(row)
        kept: KeptInputLogprobs | None = req.feature_state.pop(self.name, None)  # earlier chunks' entries
        if span is not None:
            first, entries = span[0], self._input_entries(req, span, extras, p)
            if kept is not None and kept.start is not None:
                first, entries = kept.start, kept.entries + entries
            fields.input = entries
            fields.input_start = first
            fields.normalized_prompt_logprob = sum(e[1] for e in entries) / len(entries) if entries else 0.0
        return fields if fields.output or fields.input is not None else None

    def on_chunk_result(self, batch: BatchView, row: int, req: Req, extras: LogprobsOutput) -> None:
        """A non-final chunk: keep its input entries and the boundary token's for the first output."""
        data = batch.fb.feature_data[LogprobsBatch]
        span = data.input_spans.get(row)
        if span is None:
            return
        p: LogprobParams = req.features[self.name]
        entries = self._input_entries(req, span, extras, p)
        target = data.boundary_cpu.get(row, -1)
        if target >= 0:  # scored by this chunk's last row
            entries.append(self._entry(target, extras.output.lists(), data.index[row], p))
        kept: KeptInputLogprobs = req.feature_state.setdefault(self.name, KeptInputLogprobs())
        if entries and kept.start is None:
            kept.start = span[0]  # with no entry of its own (count 0) the chunk's boundary is at its start
        kept.entries.extend(entries)

    def _input_entries(
        self, req: Req, span: tuple[int, int, int], out: LogprobsOutput, p: LogprobParams
    ) -> list[TokenEntry]:
        """The entries of the prompt positions a batch row scored: span = (first, offset, count)."""
        first, offset, count = span
        if not count:
            return []
        assert out.input is not None
        values = out.input.lists()
        return [self._entry(req.prompt_ids[first + k], values, offset + k, p) for k in range(count)]

    def on_retract(self, req: Req) -> None:
        req.feature_state.pop(self.name, None)  # the prompt is prefilled again

    def on_finish(self, req: Req) -> None:
        req.feature_state.pop(self.name, None)
        return None

    def _entry(self, token: int, values: LogprobLists, i: int, p: LogprobParams) -> TokenEntry:
        top: list[tuple[int, float]] = []
        if p.top_logprobs_num and values.top_ids is not None and values.top_vals is not None:
            top = list(zip(values.top_ids[i][: p.top_logprobs_num], values.top_vals[i][: p.top_logprobs_num]))
        tids: list[tuple[int, float]] = []
        if p.token_ids_logprob and values.tid_vals is not None:
            tids = list(zip(p.token_ids_logprob, values.tid_vals[i][: len(p.token_ids_logprob)]))
        return (token, values.lp[i], top, tids)

    def _text(self, token: int) -> str:
        text = self._text_cache.get(token)
        if text is None:
            text = self._text_cache[token] = self._tokenizer.decode([token], False) if self._tokenizer else ""
        return text

    # ---- prefix cache ----------------------------------------------------------------------
    def max_cached_prefix(self, req: Req) -> int | None:
        """Input logprobs from position s need the logits at s - 1, which only a prefill computes:
        such a request reuses at most s - 1 cached tokens (none for s <= 1)."""
        start = req.features[self.name].logprob_start_len
        return None if start < 0 else max(start - 1, 0)

    # ---- forward thread ------------------------------------------------------------------
    def after_sampling(
        self, fb: ForwardBatch, logits: LogitsOutput, next_ids: torch.Tensor
    ) -> LogprobsOutput:
        data = fb.feature_data[LogprobsBatch]
        rows = data.rows
        lp = torch.log_softmax(logits.next_token[rows].float(), dim=-1)
        targets = next_ids[rows]
        if data.boundary is not None:  # non-final chunks: the next prompt token, not the discarded sample
            targets = torch.where(data.boundary >= 0, data.boundary, targets)
        out = LogprobsOutput(self._values(lp, targets, data.top_n, data.token_ids))
        if logits.extra is not None and data.input_targets is not None and data.input_owners is not None:
            ilp = torch.log_softmax(logits.extra.float(), dim=-1)
            tids = data.token_ids[data.input_owners] if data.token_ids is not None else None
            out.input = self._values(ilp, data.input_targets, data.top_n, tids)
        return out

    @staticmethod
    def _values(
        lp: torch.Tensor, targets: torch.Tensor, top_n: int, token_ids: torch.Tensor | None
    ) -> LogprobValues:
        values = LogprobValues(lp.gather(1, targets.unsqueeze(1)).squeeze(1))
        if top_n:
            vals, ids = lp.topk(top_n, dim=-1)
            # Deterministic ties: equal logprobs ordered by lower token id.
            order = torch.argsort(ids, dim=-1, stable=True)
            vals, ids = vals.gather(1, order), ids.gather(1, order)
            order = torch.argsort(vals, dim=-1, descending=True, stable=True)
            values.top_vals, values.top_ids = vals.gather(1, order), ids.gather(1, order)
        if token_ids is not None:
            values.tid_vals = lp.gather(1, token_ids)
        return values
