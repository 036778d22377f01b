"""State snapshots: what the prefix cache keeps for a model's recurrent layers.

A recurrent layer (service/models/recurrent.py) keeps, per request slot, what it left after the
slot's last token; a cached prefix's K/V rows say nothing of it. So for such a model the prefix
cache also keeps snapshots: copies of a slot's states, each held by the tree node after whose last
token they were taken (service/engine/prefix_cache.py, `Node.snapshot`). A request then matches only
up to a node holding one, and its slot's states start from a copy of it.

Snapshots live in `SlotStates` rows past the request slots. The copies run on the forward, in launch
order, before the batch's model (`StateCopies`): first the saves queued since the last batch was
formed (request slot -> snapshot row), then the restores of the requests this batch admits (snapshot
row -> request slot). A slot's states, once every launched batch has run, follow its request's
`kv_len` tokens; a save queued when the request ends is carried by the next batch, so it copies
exactly that, even when the slot's next owner starts in that same batch (its model runs after).

A save is visible to matches at once: whoever restores from it is admitted in its carrier or a later
batch. What a failed step breaks: a batch that fails partway may leave a slot's states half updated,
and a save carried after it copies that; a carrier that fails before (or while) it copies leaves the
row stale. So a snapshot is *settled* once its carrier and every batch before it have been processed
without failing; when one fails, the unsettled snapshots carried by it or after it (or not yet) are
dropped, and the requests whose cached path runs through their nodes are failed (the manager's
`batch_done`: those that started from them, and those whose table points at rows only they vouched
for, such as a late row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from service.core.device import Device
from service.core.forward_batch import StateCopies


@dataclass(eq=False)
class Snapshot:
    """A copy of one request's states, in `row` of SlotStates, held by the tree's `node`."""

    row: int
    node: Any  # the prefix tree's Node whose last token the states follow
    carrier: int | None = None  # the batch whose forward copies it (None: not formed yet)
    settled: bool = False  # its carrier, and every batch before it, was processed without failing


class StateSnapshots:
    """Scheduler thread: snapshot rows (free and held), the copies the next batch carries, and which
    snapshots a failed step could have spoiled."""

    def __init__(self, first_row: int, count: int, device: Device | None = None):
        self.count = count
        self.device = device  # where the copies' indices go
        self._free = list(range(first_row + count - 1, first_row - 1, -1))
        self.held: set[Snapshot] = set()
        self._saves: list[tuple[int, Snapshot]] = []  # (request slot, snapshot) for the next batch
        self._restores: list[tuple[Snapshot, int]] = []  # (snapshot, request slot) for the next batch
        self._unsettled: list[Snapshot] = []
        self._formed = 0  # batches formed so far: a batch's number orders it among launches

    @property
    def free_count(self) -> int:
        return len(self._free)

    def save(self, slot: int, node: Any) -> Snapshot:
        """Queue a copy of `slot`'s states (as they will be once every launched batch ran) for `node`
        (None: a node the tree makes later)."""
        snap = Snapshot(self._free.pop(), node)
        self.held.add(snap)
        self._saves.append((slot, snap))
        self._unsettled.append(snap)
        return snap

    def restore(self, snap: Snapshot, slot: int) -> None:
        """The request admitted into `slot` in the batch being formed starts from `snap`."""
        self._restores.append((snap, slot))

    def discard(self, snap: Snapshot) -> None:
        """Its node (or its request) lets it go: the row is free again (a save not carried yet is not
        made). Once only: a second call does nothing."""
        if snap not in self.held:
            return
        self.held.discard(snap)
        if snap.carrier is None:
            self._saves = [(s, x) for s, x in self._saves if x is not snap]
        if not snap.settled:
            self._unsettled = [x for x in self._unsettled if x is not snap]
        snap.node = None
        self._free.append(snap.row)

    def formed(self) -> tuple[int, StateCopies | None]:
        """A batch was formed: its number and the copies its forward makes first."""
        self._formed += 1
        if not self._saves and not self._restores:
            return self._formed, None
        saves = restores = None
        if self._saves:
            for _, snap in self._saves:
                snap.carrier = self._formed
            saves = self._pairs([slot for slot, _ in self._saves], [s.row for _, s in self._saves])
        if self._restores:
            restores = self._pairs([s.row for s, _ in self._restores], [slot for _, slot in self._restores])
        self._saves, self._restores = [], []
        return self._formed, StateCopies(saves, restores)

    def _pairs(self, src: list[int], dst: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor([src, dst], dtype=torch.int64)
        if self.device is not None:
            t = self.device.to_device(t)[0]
        return t[0], t[1]

    def batch_done(self, number: int, ok: bool) -> list[Snapshot]:
        """Batch `number`'s result was processed. Returns the snapshots it spoils (a failed batch: the
        unsettled ones copied by it or after it, or not yet); the caller drops them."""
        if not ok:
            return [s for s in self._unsettled if s.carrier is None or s.carrier >= number]
        still = []
        for snap in self._unsettled:
            if snap.carrier is not None and snap.carrier <= number:
                snap.settled = True
            else:
                still.append(snap)
        self._unsettled = still
        return []

    def unsettled(self) -> list[Snapshot]:
        """After a scheduler failure (batches abandoned unprocessed): every snapshot not settled."""
        return list(self._unsettled)

    def forget_restores(self) -> None:
        """After a scheduler failure: restores of a batch that was never formed."""
        self._restores = []
