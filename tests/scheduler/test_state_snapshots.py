"""The prefix cache's state snapshots (a recurrent model's), through its manager alone: a request that
ends queues a save for the next batch, the next request restores from it in the same batch, and a
failed step spoils the snapshots copied after it (the requests whose path runs through them fail). End to end against
transformers: tests/models/test_hybrid_models.py."""

from __future__ import annotations

import torch

from service.core.device import CPU
from service.core.request import FinishReason, Req, SamplingParams
from service.engine.cache_manager import PrefixCacheManager
from service.engine.kv_cache import ReqToTokenPool, SlotStates, TokenToKVPool

SLOTS, SNAPSHOTS = 4, 2


def _cache() -> PrefixCacheManager:
    from service.engine.state_snapshots import StateSnapshots

    states = SlotStates(SLOTS, [[((3,), torch.float32)], None], snapshots=SNAPSHOTS)
    kv = TokenToKVPool(64, 2, 1, 2, torch.float32, kv_layers=[False, True], states=states)
    return PrefixCacheManager(ReqToTokenPool(SLOTS, 32), kv, CPU, StateSnapshots(SLOTS, SNAPSHOTS))


def _running(
    cache: PrefixCacheManager, rid: str, prompt: list[int], outputs: list[int], launched: int
) -> Req:
    """A request admitted (with whatever the cache holds for it), its prompt and `launched` more tokens'
    rows allocated, `outputs` processed."""
    req = Req(rid, prompt, SamplingParams(max_new_tokens=8), 0, None, frozenset())  # type: ignore[arg-type]
    assert cache.admit(req, len(prompt) - 1, room=64) is not None
    req.slot = cache.req_pool.alloc()
    cache.start(req)
    own = len(prompt) + launched - req.cache_owned
    rows = cache.kv_pool.alloc(own)
    positions = torch.arange(req.cache_owned, req.cache_owned + own)
    cache.req_pool.write_host(torch.full((own,), req.slot), positions, rows)
    req.kv_len, req.output_ids = len(prompt) + launched, outputs
    return req


def _end(cache: PrefixCacheManager, req: Req, reason: FinishReason = FinishReason.STOP) -> None:
    req.finished = reason
    cache.release(req)
    cache.req_pool.free(req.slot)


def _state(cache: PrefixCacheManager, row: int) -> torch.Tensor:
    return cache.kv_pool.states.layers[0][0][row]  # type: ignore[union-attr,index]


def test_a_save_and_a_restore_ride_the_next_batch_in_that_order():
    """Under overlap the request ends while the step that runs its last token late is in flight: its
    snapshot follows all its launched tokens (prompt and both outputs); the next turn restores it in
    the batch that carries the save, after it."""
    cache = _cache()
    first = _running(cache, "a", [1, 2, 3, 4], [5, 6], launched=2)
    _state(cache, first.slot).copy_(torch.tensor([1.0, 2.0, 3.0]))
    _end(cache, first)
    assert cache.tree.snapshot_len([1, 2, 3, 4, 5, 6, 7]) == 6
    second = _running(cache, "b", [1, 2, 3, 4, 5, 6, 7, 8], [], launched=0)
    assert second.cache_owned == 6 and second.slot == first.slot  # the slot's next owner, in this batch
    _state(cache, second.slot).zero_()  # what the in-flight step leaves there does not matter: ...
    _state(cache, first.slot).copy_(torch.tensor([1.0, 2.0, 3.0]))  # ... the save copies before the model
    number, copies = cache.formed()
    assert copies is not None and copies.saves is not None and copies.restores is not None
    cache.kv_pool.states.apply(copies)  # type: ignore[union-attr]
    assert _state(cache, second.slot).tolist() == [1.0, 2.0, 3.0]
    assert cache.batch_done(number - 1, True, [second]) == []  # the batches before it went well, but ...
    assert not cache.tree.match([1, 2, 3, 4, 5, 6]).node.snapshot.settled  # ... its own copy may not
    assert cache.batch_done(number, True, [second]) == []  # its carrier went well: settled
    assert (
        cache.batch_done(number + 1, False, [second]) == []
    )  # a later failure spoils nothing copied before it
    _end(cache, second)
    cache.tree.check()
    assert cache.flush() and cache.kv_pool.free_count == 64 and cache.states.free_count == SNAPSHOTS


def test_a_failed_step_before_the_save_spoils_it_and_fails_its_readers():
    cache = _cache()
    in_flight, _ = cache.formed()  # the step that runs the first request's last token, late
    first = _running(cache, "a", [1, 2, 3, 4], [5, 6], launched=2)
    _end(cache, first)
    second = _running(cache, "b", [1, 2, 3, 4, 5, 6, 7, 8], [], launched=0)
    assert second.cache_owned == 6
    cache.formed()  # carries the save and the restore
    assert cache.batch_done(in_flight, False, [second]) == [
        second
    ]  # the late step failed: states half updated
    assert cache.tree.snapshot_len([1, 2, 3, 4, 5, 6, 7]) == 0
    _end(cache, second, FinishReason.ERROR)
    cache.prune()  # rows no snapshot follows any more go
    assert cache.tree.total_tokens == 0 and cache.states.free_count == SNAPSHOTS
    cache.tree.check()
    assert cache.kv_pool.free_count == 64


def test_an_error_a_token_not_sampled_yet_or_no_row_to_spare_keep_no_snapshot():
    cache = _cache()
    failed = _running(cache, "e", [1, 2, 3], [4], launched=1)
    _end(cache, failed, FinishReason.ERROR)
    unknown = _running(cache, "u", [1, 2, 3], [4], launched=2)  # two steps in flight: one token unknown
    _end(cache, unknown, FinishReason.ABORT)
    assert cache.tree.total_tokens == 0 and cache.states.free_count == SNAPSHOTS
    # two rows, both held by running requests' paths: a third conversation keeps nothing
    held = []
    for i in range(2):
        r = _running(cache, f"h{i}", [10 + i, 1], [2], launched=1)
        _end(cache, r)
        held.append(_running(cache, f"n{i}", [10 + i, 1, 2, 3], [], launched=0))
    assert [r.cache_owned for r in held] == [3, 3] and cache.states.free_count == 0
    third = _running(cache, "t", [20, 1], [2], launched=1)
    _end(cache, third)
    assert cache.tree.snapshot_len([20, 1, 2, 3]) == 0 and cache.tree.match_len([20, 1, 2]) == 0
    for r in held:
        _end(cache, r)
    cache.tree.check()
