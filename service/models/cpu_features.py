"""What this x86 CPU can run, as the engine's CPU paths need to know it.

Three paths depend on instruction-set extensions, and each checks here first:
- the native kernels (`cpu_kernels`, built with `-march=native`): AVX-512 BF16 row items and
  MoE experts, AVX-512F items, or the portable C the compiler vectorises for AVX2;
- oneDNN's packed bf16 linears (`linear`): oneDNN packs bf16 weights only with AVX-512
  BW/VL/DQ or AVX-NE-CONVERT, and raises otherwise;
- `--dtype auto`: bf16 only where matmuls run natively in it (AVX-512 BF16 or AMX), since
  elsewhere bf16 is emulated and about 5x slower than float32.

`ZEROGAP_CPU_ISA` caps what is used, so the paths of an older CPU can be run on a newer one:
`avx2` (no AVX-512 of any kind: what an AMD Zen 3 or an Intel client CPU has), `avx512`
(AVX-512F/BW/VL/DQ without BF16 or AMX: Skylake-X, Ice Lake), or `native` (the default).
torch's own kernels have their own caps (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`,
both read at start): `ONEDNN_MAX_CPU_ISA` is honoured here too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

ISA_CAPS = ("avx2", "avx512", "native")
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # the subset oneDNN's bf16 packing asks for
# oneDNN's ONEDNN_MAX_CPU_ISA values, lowest first (its docs); below AVX512_CORE it packs no bf16.
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "DEFAULT",
    "ALL",
)


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # the CPU's model name (/proc/cpuinfo)
    flags: frozenset[str]  # the kernel's feature flags, less what the cap removes
    cap: str  # ZEROGAP_CPU_ISA: avx2 | avx512 | native
    onednn_cap: str  # ONEDNN_MAX_CPU_ISA ("" when unset)

    @property
    def avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        return set(AVX512) <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        return self.avx512 and "avx512_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run in hardware (else they are emulated, ~5x slower than float32)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def onednn_amx_bf16(self) -> bool:
        """oneDNN's kernels (ATen's CPU flash attention among them) may use AMX for bf16: the CPU has
        it and ONEDNN_MAX_CPU_ISA does not cap below it."""
        if self.onednn_cap and _ONEDNN_ISAS.index(self.onednn_cap) < _ONEDNN_ISAS.index("AVX10_1_512_AMX"):
            return False
        return self.amx_bf16

    @property
    def onednn_packs_bf16(self) -> bool:
        """oneDNN can lay bf16 weights out for its own kernels (`_reorder_linear_weight`)."""
        if self.onednn_cap and _ONEDNN_ISAS.index(self.onednn_cap) < _ONEDNN_ISAS.index("AVX512_CORE"):
            return False
        return self.avx512 or "avx_ne_convert" in self.flags

    def compile_flags(self) -> list[str]:
        """The C compiler's target flags for the native kernels: this CPU, less the capped extensions."""
        flags = ["-march=native"]
        if self.cap == "avx2":
            flags.append("-mno-avx512f")  # turns off every AVX-512 subset (and AMX)
        elif self.cap == "avx512":
            flags += ["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
        return flags

    def kernel_variant(self) -> str:
        """Which paged-attention work items and extend-attention tiles the native kernels use."""
        if self.avx512_bf16:
            return "avx512-bf16 rows, extend scores and MoE experts (bf16), avx512 (fp32)"
        if self.avx512:
            return "avx512"
        if self.avx2:
            return "portable C (auto-vectorised, AVX2), AVX2 extend tiles and float32 panel linears"
        return "portable C (auto-vectorised); long extends on ATen's SDPA"

    def describe(self) -> str:
        have = [
            n
            for n, ok in (
                ("avx2", self.avx2),
                ("avx512", self.avx512),
                ("avx512_bf16", self.avx512_bf16),
                ("amx_bf16", self.amx_bf16),
            )
            if ok
        ]
        capped = "" if self.cap == "native" else f", capped by ZEROGAP_CPU_ISA={self.cap}"
        return f"{self.model or 'unknown CPU'} ({' '.join(have) or 'no AVX2'}{capped})"


def _read_cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model, flags


def _capped(flags: set[str], cap: str) -> frozenset[str]:
    if cap == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx", "avx10"))}
    elif cap == "avx512":
        flags = {
            f for f in flags if f not in ("avx512_bf16", "avx512_fp16") and not f.startswith(("amx", "avx10"))
        }
    return frozenset(flags)


def parse_cap(value: str | None) -> str:
    cap = (value or "native").strip().lower()
    if cap not in ISA_CAPS:
        raise ValueError(f"ZEROGAP_CPU_ISA={value!r}: expected one of {', '.join(ISA_CAPS)}")
    return cap


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU's features under the caps set in the environment (read once: they are fixed at start)."""
    model, flags = _read_cpuinfo()
    cap = parse_cap(os.environ.get("ZEROGAP_CPU_ISA"))
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()
    return CpuFeatures(
        model=model, flags=_capped(flags, cap), cap=cap, onednn_cap=onednn if onednn in _ONEDNN_ISAS else ""
    )
