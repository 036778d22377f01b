"""The paged KV cache: a request-to-token table and a token-to-KV pool.

ReqToTokenPool maps (request slot, position) to a row of the KV pool;
TokenToKVPool holds the K/V tensors per layer plus the free list of rows.
Row 0 of the pool is never handed out: padded gathers point at it.
Both live on the scheduler thread; the forward thread only reads snapshots
(ForwardBatch.kv_indices) and writes K/V rows it was given.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Slots for running requests; each row lists its tokens' KV rows."""

    def __init__(self, num_slots: int, max_context: int):
        self.table = torch.zeros(num_slots, max_context, dtype=torch.int64)
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


class TokenToKVPool:
    """K and V rows for `size` tokens in every layer, and their free list."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.size = size
        shape = (size + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._free_len = size

    @property
    def free_count(self) -> int:
        return self._free_len

    def alloc(self, n: int) -> torch.Tensor:
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
