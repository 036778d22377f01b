"""One code path for CPU and CUDA: streams, events and host <-> device transfers.

`torch.get_device_module(device)` gives streams and events; on CPU they are
no-ops (work is synchronous there), on CUDA they order the scheduler's and the
forward's work without blocking the host. Host metadata travels in one pinned
buffer per dtype with `non_blocking=True`; results come back into pinned host
memory the same way, and a per-batch event says when they have arrived.
On CPU every transfer is the identity (CPU torch rejects pinned memory).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch


class HostTimingEvent:
    """A CPU stand-in for a timing CUDA event: the host clock when recorded
    (CPU work is synchronous, so that is when the stream reached it)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "HostTimingEvent") -> float:
        """Milliseconds from this event to `end` (as torch.cuda.Event.elapsed_time)."""
        return (end.t - self.t) * 1e3


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (cpu, cuda or auto)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass
class Device:
    """The engine's device, with its stream/event module and transfer helpers."""

    device: torch.device

    def __post_init__(self) -> None:
        self.module = torch.get_device_module(self.device)
        self.is_cuda = self.device.type == "cuda"

    @classmethod
    def of(cls, name: str) -> "Device":
        return cls(resolve_device(name))

    # ---- streams and events ------------------------------------------------------------
    def new_stream(self) -> Any:
        if self.is_cuda:
            return torch.cuda.Stream(device=self.device)
        return self.module.Stream()

    def use_stream(self, stream: Any) -> Any:
        """Context manager: make `stream` current on this thread."""
        return self.module.stream(stream)

    def current_stream(self) -> Any:
        return self.module.current_stream(self.device) if self.is_cuda else self.module.current_stream()

    def new_event(self, timing: bool = False) -> Any:
        if self.is_cuda:
            return torch.cuda.Event(enable_timing=timing)
        return HostTimingEvent() if timing else self.module.Event()

    def record_event(self, stream: Any = None) -> Any:
        """An event recorded now on `stream` (default: the current stream)."""
        event = self.new_event()
        if self.is_cuda:
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    # ---- transfers -----------------------------------------------------------------------
    def to_device(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host tensors -> device tensors of the same shapes and dtypes, in the
        current stream's order. On CUDA, one pinned staging buffer and one
        non-blocking copy per dtype; on CPU the tensors themselves."""
        if not self.is_cuda:
            return list(tensors)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        for dtype, idx in groups.items():
            total = sum(tensors[i].numel() for i in idx)
            staging = torch.empty(total, dtype=dtype, pin_memory=True)
            if total:
                torch.cat([tensors[i].reshape(-1) for i in idx], out=staging)
            # The caching host allocator keeps `staging` until this copy is done.
            flat = staging.to(self.device, non_blocking=True)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[offset : offset + n].view(tensors[i].shape)
                offset += n
        return out  # type: ignore[return-value]

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying a device tensor into pinned host memory (valid once an event
        recorded after this call has completed). On CPU: the tensor itself."""
        if not self.is_cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def tree_to_host(self, value: Any) -> Any:
        """to_host over the tensors of nested dataclasses / dicts / lists / tuples (feature extras)."""
        if isinstance(value, torch.Tensor):
            return self.to_host(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value,
                **{
                    f.name: self.tree_to_host(getattr(value, f.name))
                    for f in dataclasses.fields(value)
                    if f.init
                },
            )
        if isinstance(value, dict):
            return {k: self.tree_to_host(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.tree_to_host(v) for v in value)
        return value

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)


CPU = Device(torch.device("cpu"))
