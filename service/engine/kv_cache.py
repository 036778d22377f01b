"""The paged KV cache: a request-to-token table and a token-to-KV pool.

ReqToTokenPool maps (request slot, position) to a row of the KV pool. Its
table lives on the device (batch formation gathers each batch's KV indices
from it there); a host mirror holds the same rows for the scheduler's
bookkeeping (freeing a finished request's rows needs no device read).
TokenToKVPool holds the K/V tensors per layer on the device, and the free
list of rows on the host. Row 0 of the pool is never handed out: padded
gathers point at it. Both are edited on the scheduler thread only; the forward
reads snapshots (ForwardBatch.kv_indices) and writes K/V rows it was given.
SlotStates holds what a recurrent layer (service/models/recurrent.py) carries instead of K/V rows:
its states per request slot, read and written by the forward only, in launch order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.core.forward_batch import StateCopies
from service.models.recurrent import StateSpec


class ReqToTokenPool:
    """Slots for running requests; each row lists its tokens' KV rows."""

    def __init__(self, num_slots: int, max_context: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.table = torch.zeros(num_slots, max_context, dtype=torch.int64, device=self.device)
        # The scheduler's copy (the same tensor on CPU).
        self.host = (
            self.table
            if self.device.type == "cpu"
            else torch.zeros(num_slots, max_context, dtype=torch.int64)
        )
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def rows(self, slot: int, length: int) -> torch.Tensor:
        """The KV rows of a slot's first `length` tokens (host copy)."""
        return self.host[slot, :length].clone()

    def write_host(self, slots: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor) -> None:
        """Host mirror: table[slots[i], positions[i]] = locs[i] (host tensors)."""
        if self.host is not self.table:
            self.host[slots, positions] = locs

    def write_device(self, slots: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor) -> None:
        """Device table, same write (device tensors; ordered on the current stream)."""
        self.table[slots, positions] = locs

    def gather(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """[bs, length] KV rows of each slot (device, a fresh tensor: a snapshot). A row gather of the
        table's first `length` columns: 2-D advanced indexing costs milliseconds here at bs 64 on CPU."""
        return self.table[:, :length].index_select(0, slots)


class SlotStates:
    """Per layer (None where a layer keeps K/V rows), its states for every request slot; a state's
    row of a slot is what the layer left after the slot's last token. Rows past the request slots
    hold the prefix cache's snapshots (`snapshots` of them: service/engine/state_snapshots.py)."""

    def __init__(
        self,
        num_slots: int,
        specs: Sequence[StateSpec | None],
        device: torch.device | str = "cpu",
        snapshots: int = 0,
    ):
        self.num_slots = num_slots
        self.snapshots = snapshots
        rows = num_slots + snapshots
        self.layers: list[list[torch.Tensor] | None] = [
            None
            if spec is None
            else [torch.zeros((rows, *shape), dtype=dtype, device=device) for shape, dtype in spec]
            for spec in specs
        ]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every state's rows `dst` = its rows `src` (on the forward, in launch order; no row is in both)."""
        for layer in self.layers:
            for t in layer or ():
                t.index_copy_(0, dst, t.index_select(0, src))

    def apply(self, copies: StateCopies) -> None:
        """A batch's saves, then its restores (a restore may read a snapshot saved just before)."""
        for pair in (copies.saves, copies.restores):
            if pair is not None:
                self.copy(*pair)

    @staticmethod
    def bytes_per_slot(specs: Sequence[StateSpec | None]) -> int:
        return sum(
            torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            for spec in specs
            if spec is not None
            for shape, dtype in spec
        )


class TokenToKVPool:
    """K and V rows for `size` tokens in every layer that attends (`kv_layers`; default all: the
    others get empty tensors), their free list, and the recurrent layers' `states` where the model
    has such layers."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_layers: Sequence[bool] | None = None,
        states: SlotStates | None = None,
    ):
        self.size = size
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        kv_layers = kv_layers or [True] * num_layers
        self.k = [torch.zeros(shape if kv else (0,), dtype=dtype, device=self.device) for kv in kv_layers]
        self.v = [torch.zeros(shape if kv else (0,), dtype=dtype, device=self.device) for kv in kv_layers]
        self.states = states
        self._free = torch.arange(1, size + 1, dtype=torch.int64)  # host
        self._free_len = size

    @property
    def free_count(self) -> int:
        return self._free_len

    def alloc(self, n: int) -> torch.Tensor:
        """n free rows (a host tensor)."""
        if n > self._free_len:
            raise RuntimeError(f"KV pool exhausted: need {n}, free {self._free_len}")
        self._free_len -= n
        return self._free[self._free_len : self._free_len + n].clone()

    def free(self, rows: torch.Tensor) -> None:
        n = rows.numel()
        if n == 0:
            return
        if self._free_len + n > self.size:
            raise RuntimeError("KV pool double free")
        self._free[self._free_len : self._free_len + n] = rows
        self._free_len += n

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
