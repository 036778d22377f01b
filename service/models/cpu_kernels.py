"""Native CPU kernels (plain C, built once with the system compiler, loaded with ctypes).

`csrc/cpu_kernels.c`: paged attention that reads the KV pool in place (decode rows,
short chunks), a row argmax for greedy sampling, the fused elementwise ops of a decoder
layer and the grammar-mask apply of constrained decoding. `csrc/extend_attention.c`:
the attention of long extends (prompts, chunks) over the pool in place, blocked like a
GEMM. `csrc/moe_experts.c`: the routed experts of a mixture-of-experts layer in bf16, one
parallel region per layer. `csrc/panel_linear.c`: linears through weights laid out in panels
(float32 on AVX2, bf16 on AVX-512 BF16). `csrc/recurrent.c`: Gated DeltaNet's delta rule and
Mamba-2's and Mamba-1's scans token by token, in place on the slots' states. All are compiled into one library on
first use with `cc -O3 -march=native -fopenmp` into `$ZEROGAP_CACHE/kernels/`
(less the extensions `ZEROGAP_CPU_ISA` caps, see `cpu_features`; keyed by the
source, the flags and the CPU's feature flags, so a cache copied to another CPU
is rebuilt) and linked against the libgomp torch already
loaded, so both share one OpenMP thread pool. Without a C compiler the
attention backend falls back to pure torch ops (`available()` is False).
ctypes releases the GIL for the call, like a torch op.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from service.models.cpu_features import cpu_features

log = logging.getLogger("zerogap.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / "cpu_kernels.c",
    CSRC / "extend_attention.c",
    CSRC / "moe_experts.c",
    CSRC / "panel_linear.c",
    CSRC / "recurrent.c",
]
HEADERS = [CSRC / "kernel_math.h"]
# + the target flags of cpu_features(). -fno-trapping-math lets an AVX2 build vectorize the selects
# of exp_approx (silu, softmax: scalar before, 3x slower) and changes no result (no reassociation).
FLAGS = ["-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_fns: dict[
    tuple[str, torch.dtype], ctypes._CFuncPtr
] = {}  # (kernel, dtype) -> its function, filled with _lib
_failed: str | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("ZEROGAP_CACHE", Path.home() / ".cache" / "zerogap")) / "kernels"


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    cpu = cpu_features()
    flags = [*cpu.compile_flags(), *FLAGS]
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + " ".join(flags).encode()
        + " ".join(sorted(cpu.flags)).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
            # the sources compile side by side (a few seconds each at -O3), then one link
            compiles = [
                subprocess.Popen(
                    [compiler, *flags, "-c", str(src), "-o", str(obj)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for src, obj in zip(SOURCES, objects)
            ]
            for proc in compiles:
                _, err = proc.communicate()
                if proc.returncode:
                    raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
            subprocess.run(
                [compiler, *flags, *map(str, objects), "-o", str(tmp_out), "-lm"],
                check=True,
                capture_output=True,
                text=True,
            )
            os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(out))
    for name, (restype, argtypes) in _SIGNATURES.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype, fn.argtypes = restype, argtypes
            _fns[name, dtype] = fn
    lib.extend_attention_isa.restype = ctypes.c_int
    lib.extend_attention_scratch_bytes.restype = ctypes.c_int64
    lib.extend_attention_scratch_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.moe_experts_isa.restype = ctypes.c_int
    lib.moe_experts_scratch_bytes.restype = ctypes.c_int64
    lib.moe_experts_scratch_bytes.argtypes = [ctypes.c_int64] * 5
    lib.moe_experts_bf16.restype = ctypes.c_int
    lib.moe_experts_bf16.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _INT]
    lib.panel_linear_isa.restype = ctypes.c_int
    lib.pack_panels_f32.restype = None
    lib.pack_panels_f32.argtypes = [_P, _I64, _I64, _P]
    lib.panel_linear_f32.restype = ctypes.c_int
    lib.panel_linear_f32.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT]
    lib.panel_linear_bf16_isa.restype = ctypes.c_int
    lib.pack_panels_bf16.restype = None
    lib.pack_panels_bf16.argtypes = [_P, _I64, _I64, _P]
    lib.panel_linear_bf16.restype = ctypes.c_int
    lib.panel_linear_bf16.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT]
    lib.gated_delta_rule_f32.restype = ctypes.c_int
    lib.gated_delta_rule_f32.argtypes = [_P] * 10 + [_I64] * 6 + [_INT]
    lib.ssm_scan_f32.restype = ctypes.c_int
    lib.ssm_scan_f32.argtypes = [_P] * 10 + [_I64] * 6 + [_INT]
    lib.ssm1_scan_f32.restype = ctypes.c_int
    lib.ssm1_scan_f32.argtypes = [_P] * 10 + [_I64] * 4 + [_INT]
    return lib


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SSM1_BLOCK = 64  # channels of one work item of ssm1_scan_f32 (csrc/recurrent.c)
_SIGNATURES = {  # each has a _bf16 and an _f32 variant
    "paged_attention": (
        _INT,
        [_P, _I64]
        + [_P] * 3
        + [_I64]
        + [_P] * 2
        + [_I64] * 4
        + [_F32, _I64, _F32, _P, _INT]
        + [_P, _P, _I64, _P, _I64, _I64],
    ),
    "extend_attention": (
        _INT,
        [_P, _I64, _P, _P, _P, _I64, _I64]
        + [_P] * 4
        + [_I64] * 3
        + [_F32, _I64, _F32, _P, _I64, _P, _I64, _INT],
    ),
    "argmax_rows": (None, [_P, _I64, _I64, _P, _INT]),
    "rms_norm": (None, [_P, _P, _P, _F32, _I64, _I64, _P, _P, _INT]),
    "rope": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _INT]),
    "silu_mul": (None, [_P, _I64, _I64, _P, _INT]),
    "apply_token_bitmask": (None, [_P, _I64, _P, _I64, _P, _I64, _I64, _INT]),
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None when it cannot be built here."""
    global _lib, _failed
    if _lib is not None or _failed is not None:  # the hot path: built (or refused) once, no lock
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or ""
                _failed = f"{e!r} {detail}".strip()
                log.warning("native CPU attention unavailable, using torch ops: %s", _failed)
        return _lib


def available() -> bool:
    return load() is not None


MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's stack buffers (MAX_G, MAX_D in the C source)


def has_kernel(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in _SUFFIX and head_dim <= MAX_HEAD_DIM


def _attention_args(
    q, k_cache, v_cache, batch_args: tuple, scale: float, window: int, softcap: float
) -> tuple:
    """The leading arguments both attention kernels take: the query rows, the pool, the batch's
    converted arguments, the head shape, scale, window and cap."""
    _, hq, d = q.shape
    return (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), *batch_args,
            hq, k_cache.shape[1], d, scale, window, softcap)  # fmt: skip


class PagedAttention:
    """One batch's paged-attention calls: the batch's arguments (its table, each query's request
    row and position, the rows this step writes) converted once; every layer then passes only
    its own tensors. Attention of each query row over its request's pool rows up to its
    position (causal, optional sliding window), after storing this step's K/V rows."""

    def __init__(
        self,
        table: torch.Tensor,  # [bs, L] int64 pool rows per kv position
        req_of: torch.Tensor,  # [n] int64 request row of each query
        pos_of: torch.Tensor,  # [n] int64 absolute position of each query
        window: int | None,
        new_loc: torch.Tensor | None = None,  # [m] int64: where this step's K/V rows go
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma-2)
        team: int | None = None,  # the engine's full team size (default: this thread's); the row items need 4
        # query rows per thread of it, any row on a one-thread team (a fixed choice: the results do
        # not change when the team shrinks; row and (row, kv head) items give the same bits anyway)
    ):
        assert load() is not None
        self._keep = (table, req_of, pos_of, new_loc)  # the pointers below stay valid while this lives
        self.n = req_of.shape[0]
        self.m = 0 if new_loc is None else new_loc.shape[0]
        self._batch_args = (table.data_ptr(), table.stride(0), req_of.data_ptr(), pos_of.data_ptr(), self.n)
        self._window = window or 0
        self._softcap = softcap or 0.0
        self._new_loc = new_loc.data_ptr() if self.m else None
        self._threads = torch.get_num_threads()
        team = team or self._threads
        # One thread: a row item (a token's K/V rows of all heads read at once) is faster at any row
        # count (3 decode rows of 1,000 keys, bf16, Zen 4: 12.3-13.4 -> 10.7-10.9 ms per step).
        self._row_min = 4 * team if team > 1 else 1

    def __call__(
        self,
        q: torch.Tensor,  # [n, Hq, D], rows may be strided (a view of the fused qkv output)
        k_cache: torch.Tensor,  # [pool, Hkv, D]
        v_cache: torch.Tensor,
        scale: float,
        k_new: torch.Tensor | None = None,  # [m, Hkv, D], stored at new_loc first (same row stride as v_new)
        v_new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _, hq, d = q.shape
        if q.dtype not in _SUFFIX or d > MAX_HEAD_DIM:
            raise ValueError(f"paged_attention: no kernel for {q.dtype} with head_dim {d}")
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty(self.n, hq, d, dtype=q.dtype)
        m = self.m
        if m:
            assert k_new is not None and v_new is not None and k_new.stride(0) == v_new.stride(0)
            assert (
                k_new.stride(2) == 1
                and k_new.stride(1) == d
                and v_new.stride(2) == 1
                and v_new.stride(1) == d
            )
        rc = _fns["paged_attention", q.dtype](
            *_attention_args(q, k_cache, v_cache, self._batch_args, scale, self._window, self._softcap),
            out.data_ptr(),
            self._threads,
            k_new.data_ptr() if m else None,
            v_new.data_ptr() if m else None,
            k_new.stride(0) if m else 0,
            self._new_loc,
            m,
            self._row_min,
        )
        if rc != 0:
            raise ValueError(
                f"paged_attention: unsupported shape q={tuple(q.shape)} kv={tuple(k_cache.shape)}"
            )
        return out


def extend_isa() -> int:
    """The extend kernel's vector path: 0 not built (no AVX2 + FMA), 8 AVX2, 16 AVX-512F, 32 AVX-512 BF16."""
    lib = load()
    return 0 if lib is None else lib.extend_attention_isa()


def has_extend_kernel(dtype: torch.dtype, head_dim: int) -> bool:
    return extend_isa() > 0 and dtype in _SUFFIX and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM


class ExtendAttention:
    """One batch's long extends (`csrc/extend_attention.c`): per request its table row, first packed
    query row, new rows and kv length, converted once; every layer then passes its own tensors.
    Each new row attends over its request's pool rows up to its position (causal, optional sliding
    window and soft-capping); this step's K/V rows must be in the pool already."""

    def __init__(
        self,
        table: torch.Tensor,  # [bs, L] int64 pool rows per kv position
        rows: list[tuple[int, int, int, int]],  # (table row, first packed query row, new rows, kv length)
        window: int | None,
        softcap: float | None = None,
    ):
        assert load() is not None and table.dtype == torch.int64 and table.stride(1) == 1
        self.rows = rows
        cols = torch.tensor(rows, dtype=torch.int64).view(-1, 4).t().contiguous()  # req_row, q_start, n, len
        self._keep = (table, cols)  # the pointers below stay valid while this lives
        self._batch_args = (
            table.data_ptr(),
            table.stride(0),
            len(rows),
            *(cols[i].data_ptr() for i in range(4)),
        )
        self._max_len = max((r[3] for r in rows), default=0)
        self._window = window or 0
        self._softcap = softcap or 0.0
        self._threads = torch.get_num_threads()
        self._scratch: dict[int, torch.Tensor] = {}  # per head_dim: packed K/V of a head, items' buffers

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D] the batch's packed query rows (row stride free)
        k_cache: torch.Tensor,  # [pool, Hkv, D]
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,  # [T, Hq * D]: the rows of these requests are written
    ) -> None:
        _, hq, d = q.shape
        if not has_extend_kernel(q.dtype, d):
            raise ValueError(f"extend_attention: no kernel for {q.dtype} with head_dim {d}")
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        assert (
            out.is_contiguous()
            and out.dtype == q.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )
        scratch = self._scratch.get(d)
        if scratch is None:
            size = load().extend_attention_scratch_bytes(self._max_len, d, self._threads)
            scratch = self._scratch[d] = torch.empty(size, dtype=torch.uint8)
        rc = _fns["extend_attention", q.dtype](
            *_attention_args(q, k_cache, v_cache, self._batch_args, scale, self._window, self._softcap),
            out.data_ptr(),
            out.stride(0),
            scratch.data_ptr(),
            scratch.numel(),
            self._threads,
        )
        if rc != 0:
            raise ValueError(
                f"extend_attention: unsupported shape q={tuple(q.shape)} kv={tuple(k_cache.shape)}"
            )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    req_of: torch.Tensor,
    pos_of: torch.Tensor,
    scale: float,
    window: int | None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    new_loc: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One call of `PagedAttention` (a batch used once)."""
    kernel = PagedAttention(table, req_of, pos_of, window, new_loc, softcap)
    return kernel(q, k_cache, v_cache, scale, k_new, v_new)


MOE_MAX_TOP_K = 64  # experts per token the experts kernel takes (MOE_MAX_TOP_K in the C source)


# Weight rows per panel (PANEL, BF16_PANEL in csrc/panel_linear.c) and the library's
# functions, per dtype: (pack, multiply, whether the build has the kernel).
PANEL = {torch.float32: 16, torch.bfloat16: 32}
_PANEL_FNS = {
    torch.float32: ("pack_panels_f32", "panel_linear_f32", "panel_linear_isa"),
    torch.bfloat16: ("pack_panels_bf16", "panel_linear_bf16", "panel_linear_bf16_isa"),
}


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """A weight [N, K] laid out for `panel_linear`: float32 in 16-row panels, bf16 in 32-row
    panels by k pairs (K even). None where the kernel does not run: no C compiler, or a build
    without AVX2 + FMA (float32) or AVX-512 BF16 (bf16)."""
    lib = load()
    if lib is None or weight.dtype not in PANEL or weight.device.type != "cpu":
        return None
    pack, _, isa = _PANEL_FNS[weight.dtype]
    n, k = weight.shape
    if not getattr(lib, isa)() or (weight.dtype == torch.bfloat16 and k % 2):
        return None
    rows = PANEL[weight.dtype]
    panels = torch.empty((n + rows - 1) // rows * rows * k, dtype=weight.dtype)
    getattr(lib, pack)(weight.detach().contiguous().data_ptr(), n, k, panels.data_ptr())
    return panels


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (rows may be strided; the panels' dtype) times the weight laid out by
    `pack_panels`: [M, n]. A bias is float32."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=panels.dtype)
    bias_ptr = None if bias is None else bias.data_ptr()
    multiply = getattr(load(), _PANEL_FNS[panels.dtype][1])
    rc = multiply(
        x.data_ptr(), x.stride(0), m, k, panels.data_ptr(), n, bias_ptr, y.data_ptr(), torch.get_num_threads()
    )
    assert rc == 0
    return y


def has_moe_kernel(x: torch.Tensor, top_k: int = 1) -> bool:
    """The native experts kernel runs x: bf16 on a CPU with AVX-512 BF16, library built."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or top_k > MOE_MAX_TOP_K:
        return False
    lib = load()
    return lib is not None and lib.moe_experts_isa() > 0


def moe_experts(
    x: torch.Tensor,  # [T, H] bf16
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32 routing weights
    ids: torch.Tensor,  # [T, k] int64 expert ids
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) per token (`csrc/moe_experts.c`): [T, H] bf16."""
    assert has_moe_kernel(x) and w_gate_up.dtype == w_down.dtype == torch.bfloat16
    assert w_gate_up.is_contiguous() and w_down.is_contiguous()
    x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    (t, h), (e, i2, _), k = x.shape, w_gate_up.shape, ids.shape[1]
    lib = load()
    scratch = torch.empty(lib.moe_experts_scratch_bytes(t, k, e, h, i2 // 2), dtype=torch.uint8)
    out = torch.empty(t, h, dtype=x.dtype)
    rc = lib.moe_experts_bf16(
        x.data_ptr(), t, h, ids.data_ptr(), weights.data_ptr(), k, w_gate_up.data_ptr(), w_down.data_ptr(),
        e, i2 // 2, out.data_ptr(), scratch.data_ptr(), scratch.numel(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"moe_experts: refused (rc {rc}) x={tuple(x.shape)} ids={tuple(ids.shape)} E={e}")
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor | None,
    lens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The gated delta rule token by token (`csrc/recurrent.c`), in place on `states` [slots, Hv, Dk,
    Dv] (float32), for m requests right-padded to L tokens: q, k [m, L, Hk, Dk], v [m, L, Hv, Dv],
    g, beta [m, L, Hv] (float32), slots [m], keep [m] bool (None: all continue their states), lens
    [m] (None: all L) -> o [m, L, Hv, Dv], set at the real tokens. None (nothing done) where the
    kernel does not apply."""
    m, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    return _scan(
        "gated_delta_rule_f32", (q, k, v, g, beta), states, (slots, keep, lens), (m, length, hv, dv),
        (m, length, hk, hv, dk, dv), m * hv,
    )  # fmt: skip


def ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor | None,
    lens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Mamba-2's scan token by token (`csrc/recurrent.c`), in place on `states` [slots, H, P, N]
    (float32), for m requests right-padded to L tokens: x [m, L, H, P], dt [m, L, H], a [H], b, c
    [m, L, G, N] (float32; head h reads group h // (H / G)); slots, keep, lens as gated_delta_rule's
    -> S C per token [m, L, H, P], set at the real tokens. None (nothing done) where the kernel does
    not apply."""
    m, length, h, p = x.shape
    groups, n = b.shape[2], b.shape[3]
    return _scan(
        "ssm_scan_f32", (x, dt, a, b, c), states, (slots, keep, lens), (m, length, h, p),
        (m, length, h, groups, p, n), m * h,
    )  # fmt: skip


def ssm1_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor | None,
    lens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Mamba-1's scan token by token (`csrc/recurrent.c`), in place on `states` [slots, D, N]
    (float32), for m requests right-padded to L tokens: u, dt [m, L, D], a [D, N], b, c [m, L, N]
    (float32); slots, keep, lens as gated_delta_rule's -> S c per token [m, L, D], set at the real
    tokens. None (nothing done) where the kernel does not apply."""
    m, length, d = u.shape
    n = a.shape[1]
    blocks = -(-d // SSM1_BLOCK)
    return _scan(
        "ssm1_scan_f32", (u, dt, a, b, c), states, (slots, keep, lens), (m, length, d), (m, length, d, n),
        m * blocks,
    )  # fmt: skip


def _scan(
    name: str,
    inputs: tuple[torch.Tensor, ...],
    states: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    out_shape: tuple[int, ...],
    dims: tuple[int, ...],
    items: int,
) -> torch.Tensor | None:
    """A recurrent kernel's call: float32 CPU inputs made contiguous, (slots, keep, lens) as int64 /
    uint8 / int64 (keep and lens may be None), the output allocated; None where it does not apply."""
    if (
        any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (*inputs, states))
        or not states.is_contiguous()
        or load() is None
    ):
        return None
    slots, keep, lens = index
    ints = (
        slots.to(torch.int64).contiguous(),
        None if keep is None else keep.to(torch.uint8).contiguous(),
        None if lens is None else lens.to(torch.int64).contiguous(),
    )
    inputs = tuple(t.contiguous() for t in inputs)
    out = torch.empty(out_shape, dtype=torch.float32)
    rc = getattr(_lib, name)(
        *(t.data_ptr() for t in (*inputs, states)),
        *(None if t is None else t.data_ptr() for t in ints),
        out.data_ptr(), *dims, max(1, min(torch.get_num_threads(), items)),
    )  # fmt: skip
    return out if rc == 0 else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D bf16/fp32 tensor (first index on ties), vectorized
    and parallel over rows (aten's argmax runs one row at a time, scalar)."""
    lib = load()
    if lib is None or x.dtype not in _SUFFIX or x.dim() != 2 or x.device.type != "cpu":
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _fns["argmax_rows", x.dtype](
        x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), min(torch.get_num_threads(), x.shape[0])
    )
    return out


def fused_ok(*tensors: torch.Tensor) -> bool:
    """The fused elementwise kernels apply: CPU tensors of one supported dtype, library built."""
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX or tensors[0].device.type != "cpu" or load() is None:
        return False
    return all(t.dtype == dtype for t in tensors[1:])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """(h, normed): h = x + residual (x itself without one), normed = RMSNorm(h) * weight."""
    x = x.contiguous()
    rows, cols = x.shape
    normed = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    res_ptr = residual.contiguous().data_ptr() if residual is not None else None
    _fns["rms_norm", x.dtype](
        x.data_ptr(),
        res_ptr,
        weight.data_ptr(),
        eps,
        rows,
        cols,
        h.data_ptr(),
        normed.data_ptr(),
        _threads(rows, cols),
    )
    return h, normed


def rope_(
    x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate the first `heads` heads of each row of x [T, >= heads * head_dim] in place."""
    assert x.stride(1) == 1 and head_dim <= MAX_HEAD_DIM
    _fns["rope", x.dtype](
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        _threads(x.shape[0], heads * head_dim),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    _fns["silu_mul", gate_up.dtype](
        gate_up.data_ptr(), rows, inter, out.data_ptr(), _threads(rows, 2 * inter)
    )
    return out


# Below this many elements an elementwise kernel runs on one thread: a parallel region's
# barrier costs more than the work, and a preempted team member stalls the whole team.
PARALLEL_MIN_ELEMENTS = 1 << 17


def _threads(rows: int, cols: int) -> int:
    if rows * cols < PARALLEL_MIN_ELEMENTS:
        return 1
    return max(1, min(torch.get_num_threads(), rows))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    """logits[r] = -inf wherever the bitmask row r (xgrammar's layout: int32 words, bit c % 32 of
    word c // 32, 1 = allowed) disallows the token, for the listed rows, in place. False (nothing
    done) when the kernel does not apply: the caller then uses xgrammar's own kernel, which reads
    every bit one by one (~9 ms for 64 x 49k bf16 logits; this one ~0.4 ms). One thread: the work
    is a few stores per 32 tokens, less than a parallel region's barrier under contention."""
    if (
        logits.dtype not in _SUFFIX
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.stride(1) != 1
    ):
        return False
    if (
        bitmask.dtype != torch.int32
        or bitmask.device.type != "cpu"
        or bitmask.dim() != 2
        or bitmask.stride(1) != 1
    ):
        return False
    lib = load()
    if lib is None:
        return False
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    cols = min(logits.shape[1], bitmask.shape[1] * 32)
    _fns["apply_token_bitmask", logits.dtype](
        logits.data_ptr(),
        logits.stride(0),
        bitmask.data_ptr(),
        bitmask.stride(0),
        rows.data_ptr(),
        rows.shape[0],
        cols,
        1,
    )
    return True
