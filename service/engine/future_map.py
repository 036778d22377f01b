"""The future map: values of tokens a launched batch has not sampled yet, by slot.

A placeholder -(slot + 1) stands in a later batch's inputs for a token still being sampled; the
forward thread resolves it on the device right before that batch's forward (overlap_worker.py).
"""

from __future__ import annotations

from collections import deque

import torch

from service.core.device import CPU, Device


class FutureMapFull(Exception):
    """Not enough free slots for a batch's placeholders right now."""


class FutureMap:
    """Values of not-yet-sampled tokens, with an allocator that never reuses a live slot.

    A batch's slots are released only after the scheduler has processed that
    batch's result and replaced its placeholders with real tokens; every batch
    that may still read them was launched earlier, and the forward thread runs
    batches in launch order, so a later writer can never overwrite a slot
    before its readers resolved it.
    """

    def __init__(self, size: int, device: Device = CPU):
        if size < 1:
            raise ValueError("future map size must be >= 1")
        self.size = size
        self.device = device
        self.values = torch.zeros(size, dtype=torch.int64, device=device.device)
        self._free: deque[int] = deque(range(size))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        """n free slots (scheduler thread, a host tensor); raises FutureMapFull when short."""
        if n > len(self._free):
            raise FutureMapFull(f"need {n} future slots, {len(self._free)} free of {self.size}")
        return torch.tensor([self._free.popleft() for _ in range(n)], dtype=torch.int64)

    def release(self, slots: torch.Tensor) -> None:
        self._free.extend(slots.tolist())

    @staticmethod
    def placeholders(slots: torch.Tensor) -> torch.Tensor:
        return -(slots + 1)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Forward stream: placeholders -> the tokens their batch sampled (on the device)."""
        future = input_ids < 0
        return torch.where(future, self.values[(-input_ids - 1).clamp(min=0)], input_ids)

    def store(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Forward stream: `slots` is the device copy of the batch's slots."""
        self.values[slots] = tokens
