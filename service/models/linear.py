"""Linear layers with weights laid out once for oneDNN (bf16 on CPU).

`F.linear` re-blocks a bf16 weight for AMX / AVX-512 BF16 on every call;
oneDNN can do that once at load time (`_reorder_linear_weight`) and then run
`_linear_pointwise` on the packed copy — the same arithmetic (bit-identical
results), 1.3-2x faster at decode batch sizes. Float32 weights stay as they
are (packing them changes the accumulation order and buys little).

oneDNN packs bf16 weights only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT and raises
elsewhere (an AMD Zen 3, say): there the layers stay plain `nn.Linear`s, whose bf16 matmuls
torch runs on any x86-64 CPU (emulated, so slower).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.models.cpu_features import cpu_features

# Batch-size hint for oneDNN's weight layout; measured equally good from 1 to 2,624 rows.
PACK_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and cpu_features().onednn_packs_bf16
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN. Not a Parameter: `.to()` leaves it alone."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packed_if_exact(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """A packed twin of (weight, bias) where oneDNN runs it with the same results, else None."""
    if not can_pack(weight):
        return None
    try:
        packed = PackedLinear(weight, bias)
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        same = torch.equal(packed(x), F.linear(x, weight, bias))
    except RuntimeError:  # a CPU oneDNN refuses that the flags did not tell apart: stay plain
        return None
    return packed if same else None  # never trade exactness for speed


def pack_linear(layer: nn.Linear) -> nn.Module:
    """The packed twin of `layer`, or the layer itself."""
    return packed_if_exact(layer.weight, layer.bias) or layer
