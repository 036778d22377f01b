"""Chunked prefill and mixed batches: one token budget per step.

With `--chunked-prefill-size N` a step carries at most N prompt tokens: the
continuing chunk of the request part-way through its prompt, then new prompts
in admission order; the first that does not fit whole is cut at the budget and
continues next step. New prompts shorter than what the one part-way has left
go whole before its chunk (`ChunkStep.overtakes`): a short prompt that arrives
while a long one is cut into chunks gets its first token after one step, not
after the long one's last chunk. A step that prompts overtook leaves the chunk
out, unless the step before it left it out too: then the chunk keeps its floor,
a quarter of the budget (and prompts overtake only beside it). Where a step's
time grows with its rows (a CPU, a large model on a GPU) the overtakers' first
tokens come after a step of their own rows, and the long prompt pays one more
step for it (its rows are computed all the same); however many prompts keep
overtaking, it advances by its floor at least every other step that admits
prompts (decode turns, below, come between). A cut request keeps its slot and its KV rows
between chunks (they are in the request-to-token table, the next chunk extends
them with `prefix_len` = tokens done), and is not decodable — nor in
`Scheduler.running` — until its last chunk is launched. The token sampled after
a non-final chunk is not the request's: the batch marks those rows
(`ScheduleBatch.partial_rows`), the sampler does not count it, features other
than those reading prompt chunks never see the row, and the scheduler drops it.

Steps without mixing alternate: after a step that cut a prompt, the running
requests decode before the next chunk, so a long prompt delays each running
stream by one chunk at a time instead of by the whole prefill.

With `--enable-mixed-chunk` the running decodes ride in the chunk's EXTEND
batch as one-token rows on top of their KV (`prefix_len` = kv_len), taking one
token of the budget each; under the overlap loop their input is the future
placeholder of their previous step, resolved on the device like any other
(SGLang's #2158). When the decodes alone fill the budget the chunk runs in its
own step, and the decodes in the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.core.device import Device
from service.core.feature import Feature, OverlapSupport
from service.core.request import Req
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.schedule_batch import ExtendRow, ScheduleBatch, build_extend_batch


# ---- the module's declaration: its matrix row and counters -----------------------------
@dataclass
class ChunkCounters:
    chunks: int = 0  # prompt chunks launched (final ones included)
    chunked_requests: int = 0  # requests whose prompt was split
    mixed_steps: int = 0  # EXTEND steps that carried decode rows
    mixed_decode_rows: int = 0  # decode rows carried by them


class ChunkedPrefill(Feature):
    name = "chunked_prefill"
    support = OverlapSupport.FULL
    reason = (
        "chunks and decode rows are rows of one extend batch; decode inputs are future placeholders "
        "resolved on the device, a non-final chunk's token is dropped at result time"
    )
    reads_raw_logits = False  # no forward-thread work: never forces a float copy of the logits

    def __init__(self) -> None:
        self.stats = ChunkCounters()

    def active_for(self, req: object) -> bool:
        return False  # never a per-request feature: the scheduler adds it to the batches it shapes

    def counters(self) -> dict[str, int]:
        return dict(vars(self.stats))


@dataclass
class ChunkStep:
    """One step's token budget while the scheduler admits requests into it."""

    budget: int  # tokens the step may carry (0: a decode turn, no prefill)
    rows: list[ExtendRow] = field(default_factory=list)  # prefill rows, in the order they were added
    decodes: list[Req] = field(default_factory=list)  # mixed: running requests as one-token rows
    used: int = 0
    split: bool = False  # a prompt was cut at the budget: nothing is admitted after it
    pending: Req | None = None  # part-way through its prompt: its chunk goes in after the overtakers
    floor: int = 0  # tokens the pending chunk keeps however many prompts overtake it (0: none)
    overtaken: bool = False  # a new prompt went in before the pending chunk: its floor, or it is left out
    left_out: bool = False  # overtaken with a floor of 0: the pending chunk waits for the next step

    def room(self) -> bool:
        return not self.split and not self.left_out and self.used < self.budget

    def overtakes(self, tokens: int) -> bool:
        """A new prompt of `tokens` goes whole before the pending chunk: shorter than what the pending
        request has left, and it fits beside the chunk's floor."""
        if self.pending is None:
            return False
        left = len(self.pending.prefill_ids) - self.pending.kv_len
        return tokens < left and self.used + tokens + min(left, self.floor) <= self.budget

    def resume(self) -> None:
        """The pending chunk goes in: its floor when prompts overtook it (none: it is left out), else
        what the budget leaves."""
        if self.pending is not None:
            req, self.pending = self.pending, None
            if self.overtaken and self.floor == 0:
                self.left_out = True
                return
            self.add(req, req.kv_len, fresh=False, limit=self.floor if self.overtaken else None)

    def add(self, req: Req, start: int, fresh: bool, limit: int | None = None) -> None:
        """The request's prompt from `start` on (tokens before it are in its KV: earlier chunks, or a
        cached prefix of a `fresh` request, whose sampling state starts now), as much as the budget
        leaves, and at most `limit` tokens."""
        seq = req.prefill_ids  # a retracted request re-prefills its kept output tokens too
        take = min(len(seq) - start, self.budget - self.used, self.budget if limit is None else limit)
        if start < req.snapshot_at and self.pending is None:  # a chunk ends where the prefix cache keeps
            take = min(take, req.snapshot_at - start)  # a snapshot (not beside another part-way prompt)
        self.overtaken = self.overtaken or self.pending is not None
        self.rows.append(ExtendRow(req, seq[start : start + take], prefix_len=start, new_slot=fresh))
        self.used += take
        self.split = start + take < len(seq)


class PrefillChunker:
    """The scheduler's chunked-prefill state: the request part-way through its prompt, and whose turn it is."""

    def __init__(self, size: int, mixed: bool, feature: ChunkedPrefill | None = None):
        if size < 1:
            raise ValueError(f"chunked prefill size must be >= 1, got {size}")
        self.size = size
        self.mixed = mixed
        self.feature = feature
        self.stats = feature.stats if feature is not None else ChunkCounters()
        self.partial: Req | None = None  # cut at the budget: its next chunk goes first
        self.decode_turn = False  # the last step cut a prompt without carrying the decodes
        self.left_out = False  # prompts overtook the partial one's chunk last step and it was left out

    @property
    def holding(self) -> int:
        """Requests admitted but neither running nor waiting (the one part-way through its prompt)."""
        return 1 if self.partial is not None and not self.partial.finished else 0

    def begin_step(self, running: list[Req], free_rows: int) -> ChunkStep:
        """This step's budget (at most the KV rows free now): the decodes' share (mixed) is taken first;
        the continuing chunk is pending (`ChunkStep.resume` adds it after the prompts that overtake it;
        overtaken, it keeps a quarter of the budget if it was left out last step, else none)."""
        if self.partial is not None and self.partial.finished:
            self.partial = None  # aborted or failed mid-prefill: finish() freed its KV and slot
        decodable = [r for r in running if not r.finished and r.launched < r.max_new_tokens]
        if self.decode_turn:
            self.decode_turn = False
            if decodable:
                return ChunkStep(budget=0)
        step = ChunkStep(budget=min(self.size, free_rows))
        if self.mixed and len(decodable) < step.budget:
            step.decodes = decodable
            step.used = len(decodable)
        if self.partial is not None and step.room():
            step.pending = self.partial
            step.floor = max(1, step.budget // 4) if self.left_out else 0
        return step

    def build(
        self,
        step: ChunkStep,
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        vocab_size: int,
        device: Device,
    ) -> tuple[ScheduleBatch | None, list[Req]]:
        """(the step's batch, the requests whose whole prompt is now launched: they start decoding)."""
        self.settle(step)
        if not step.rows:
            return None, []
        done = [row.req for row in step.rows if not row.partial]
        decode_rows = [
            ExtendRow(r, [r.next_input], prefix_len=r.kv_len, new_slot=False, decodes=True)
            for r in step.decodes
        ]
        rows = step.rows + decode_rows
        chunk_rows = [i for i, row in enumerate(step.rows) if row.partial or not row.new_slot]
        batch = build_extend_batch(
            [row.req for row in rows], req_pool, kv_pool, vocab_size, device, rows=rows
        )
        self.decode_turn = self.partial is not None and not decode_rows
        self._count(step, chunk_rows, decode_rows)
        mine = chunk_rows + list(range(len(step.rows), len(rows)))
        if self.feature is not None and mine:
            batch.own_plan = [(self.feature, mine)]
        return batch, done

    def settle(self, step: ChunkStep) -> None:
        """The pending chunk goes in (or is left out), and what the next step inherits is set: the
        request part-way through its prompt, and whether its chunk was left out (a decode turn, with
        no budget, changes neither)."""
        step.resume()
        if step.budget > 0:
            self.left_out = step.left_out
        if step.left_out:  # the partial request stays; only whole overtakers went in
            assert not any(row.partial for row in step.rows)
        elif step.rows:
            cut = [row.req for row in step.rows if row.partial]
            self.partial = cut[0] if cut else None

    def _count(self, step: ChunkStep, chunk_rows: list[int], decode_rows: list[ExtendRow]) -> None:
        s = self.stats
        s.chunks += len(chunk_rows)
        s.chunked_requests += sum(1 for i in chunk_rows if step.rows[i].new_slot)
        if decode_rows:
            s.mixed_steps += 1
            s.mixed_decode_rows += len(decode_rows)


def run_chunk_hooks(batch: ScheduleBatch, row: int, req: Req, extras: dict[str, Any]) -> None:
    """A non-final chunk's result: the features that read prompt chunks keep what it yielded."""
    for feature, rows in batch.plan:
        if feature.reads_prompt_chunks and row in rows:
            feature.on_chunk_result(batch, row, req, extras.get(feature.name))
