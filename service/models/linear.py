"""Linear layers with weights laid out once for oneDNN (CPU).

`F.linear` runs a float32 weight through MKL's sgemm and re-blocks a bf16 weight for AMX /
AVX-512 BF16 on every call. oneDNN can lay a weight out once at load time
(`_reorder_linear_weight`) and then run `_linear_pointwise` on the packed copy:

- bf16: the same arithmetic as `F.linear` (bit-identical results), 1.3-2x faster at decode batch
  sizes. oneDNN packs bf16 weights only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT and raises
  elsewhere (an AMD Zen 3, say): there the layers stay plain `nn.Linear`s, whose bf16 matmuls torch
  runs on any x86-64 CPU (emulated, so slower).
- float32: oneDNN's kernels stream a weight that is not in cache (every layer's, at each step)
  about twice as fast as sgemm at 1-64 rows on an AVX2 Zen 3 (docs/benchmarks.md, "Float32
  linears and the realistic load"); they sum in another order, so results differ from `F.linear` by rounding only
  (relative ~1e-6). A packed twin is kept only where it matches `F.linear` to that.
- float32 on AVX2 CPUs without AVX-512 (an AMD Zen 3): the native panel kernel instead
  (`csrc/panel_linear.c`) for every row count: 1.3-2x oneDNN's speed at 1-32 rows (decode steps),
  even from 64 on, and each output summed over k in one order, so a row's results do not depend
  on its batch (oneDNN's do, by rounding). The panels are the only copy of the weight.
- bf16 on CPUs with AVX-512 BF16 but no AMX (an AMD Zen 4): the same panels in bf16
  (`vdpbf16ps`), every row count: 1.8-1.9x oneDNN's speed at 1-3 rows on one core, 1.5x at 8,
  1.1x at 16-32, even from 64 on (two threads: 1.2-1.5x up to 32 rows). Their float32 sums may round differently from oneDNN's in the last bit
  of the bf16 result (a few elements in 10^5), so they are kept only where they agree with
  `F.linear` to that. With AMX, oneDNN's kernels stay (far ahead from 16 rows on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.models import cpu_kernels
from service.models.cpu_features import cpu_features

# Batch-size hint for oneDNN's weight layout; measured equally good from 1 to 2,624 rows.
PACK_BATCH_HINT = 64
FLOAT32_REL_TOL = 1e-5  # a packed float32 twin's largest error, relative to the output's scale
BF16_ULP = 2.0**-7  # one bf16 step, relative to the value (8 significant bits)


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return cpu_features().onednn_packs_bf16
    return weight.dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN. Not a Parameter: `.to()` leaves it alone."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def agrees(twin: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, exact_bf16: bool = True) -> bool:
    """The twin gives `F.linear`'s results on a probe: float32 up to rounding; bf16 the same bits,
    or (`exact_bf16=False`) each element at most one bf16 step from them."""
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    got, want = twin(x), F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16 and exact_bf16:
        return torch.equal(got, want)  # oneDNN's packing: the same kernels as F.linear, the same bits
    got, want = got.float(), want.float()
    step = BF16_ULP * want.abs() if weight.dtype == torch.bfloat16 else 0.0
    return bool(((got - want).abs() <= step + FLOAT32_REL_TOL * want.abs().max()).all())


def packed_twin(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """A packed twin of (weight, bias) where oneDNN runs it with `F.linear`'s results, else None."""
    if not can_pack(weight):
        return None
    try:
        packed = PackedLinear(weight, bias)
        return packed if agrees(packed, weight, bias) else None
    except RuntimeError:  # a CPU oneDNN refuses that the flags did not tell apart: stay plain
        return None


class PanelLinear(nn.Module):
    """y = x W^T + b with W laid out in panels (`cpu_kernels.panel_linear`), any row count; float32
    or bf16. Not a Parameter: `.to()` leaves it alone."""

    def __init__(self, panels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.panels = panels
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        y = cpu_kernels.panel_linear(
            x.reshape(rows, self.in_features), self.panels, self.out_features, self.bias
        )
        return y.view(*x.shape[:-1], self.out_features)


def panels_pay(weight: torch.Tensor) -> bool:
    """The panel kernel was measured ahead of oneDNN for this weight's dtype on this CPU
    (docs/benchmarks.md): float32 on AVX2 CPUs without AVX-512, bf16 with AVX-512 BF16 but no AMX."""
    cpu = cpu_features()
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return cpu.avx2 and not cpu.avx512
    return weight.dtype == torch.bfloat16 and cpu.avx512_bf16 and not cpu.amx_bf16


def panel_twin(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PanelLinear | None:
    """A twin of (weight, bias) through the panel kernel where it pays and agrees with `F.linear`
    (to rounding; bf16 to one step), else None."""
    if not panels_pay(weight):
        return None
    panels = cpu_kernels.pack_panels(weight)
    if panels is None:
        return None
    twin = PanelLinear(panels, weight, bias)
    return twin if agrees(twin, weight, bias, exact_bf16=False) else None


def fast_twin(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module | None:
    """The fastest twin of (weight, bias) this CPU has: panels, else oneDNN's packing, else None."""
    return panel_twin(weight, bias) or packed_twin(weight, bias)


def pack_linear(layer: nn.Linear) -> nn.Module:
    """The fastest twin of `layer`, or the layer itself."""
    return fast_twin(layer.weight, layer.bias) or layer
