"""Attention backends by name: `torch` (CPU: native paged kernels where built, SDPA
elsewhere; any device), `torch-sdpa` (SDPA over gathered KV only) and `triton`
(paged kernels; CUDA, or CPU under TRITON_INTERPRET=1 for tests).

A backend has `name`, `prepare(fb, num_q_heads, num_kv_heads, sliding_window)`
-> per-batch metadata built once per forward on the device, and
`forward(q, k, v, k_cache, v_cache, meta, scale)` -> [T, Hq * D], which writes
this step's K/V into the pool at fb.out_cache_loc and then attends.
"""

from __future__ import annotations

from typing import Any

from service.core.device import Device

BACKENDS = ("torch", "torch-sdpa", "triton")


def resolve_attention_backend(name: str, device: Device) -> str:
    """`auto`: triton on CUDA, torch elsewhere."""
    if name == "auto":
        return "triton" if device.is_cuda else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: auto, {', '.join(BACKENDS)})")
    return name


def get_attention_backend(name: str, cpu_team: int | None = None, dtype: Any = None) -> Any:
    """cpu_team: the engine's full CPU team size (the native kernels' work split follows it);
    dtype: the model's (which CPU kernel takes a short extend depends on it)."""
    if name in ("torch", "torch-sdpa"):
        from service.models.attention import TorchAttention

        return TorchAttention(use_kernel=name == "torch", team=cpu_team, dtype=dtype)
    if name == "triton":
        from service.models.triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
