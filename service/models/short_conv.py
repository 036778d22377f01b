"""LFM2's short convolution: a recurrent layer (recurrent.py) of gated depthwise conv, no attention.

    B, C, x = in_proj(h);  y = C * conv(B * x);  out_proj(y)

where conv is a causal depthwise conv of `conv_L_cache` taps (a bias where `conv_bias`). Its only
state per request slot is the conv's last `conv_L_cache - 1` inputs (the model's dtype)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from service.models.recurrent import RecurrentRows, StateSpec, conv_extend, conv_step


@dataclass(frozen=True)
class ShortConvShape:
    channels: int  # the hidden size
    kernel: int  # conv_L_cache
    bias: bool  # conv_bias: on in_proj, the conv and out_proj

    def state_shapes(self, dtype: torch.dtype) -> StateSpec:
        return [((self.kernel - 1, self.channels), dtype)]

    def build(self, hidden_size: int) -> ShortConv:
        return ShortConv(self, hidden_size)


class ShortConv(nn.Module):
    def __init__(self, s: ShortConvShape, hidden_size: int):
        super().__init__()
        self.s = s
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=s.bias)
        self.conv_weight = nn.Parameter(torch.zeros(hidden_size, s.kernel))
        self.conv_bias = nn.Parameter(torch.zeros(hidden_size)) if s.bias else None
        self.out = nn.Linear(hidden_size, hidden_size, bias=s.bias)

    def forward(self, x, positions, cos, sin, states, unused, rows: RecurrentRows, attn) -> torch.Tensor:
        (conv_state,) = states
        b, c, u = self.in_proj(x).chunk(3, dim=-1)
        bx = b * u
        y = rows.run(
            lambda v, r: conv_step(v, conv_state, self.conv_weight, self.conv_bias, r),
            lambda v, r: conv_extend(v, conv_state, self.conv_weight, self.conv_bias, r)[r.valid],
            (bx,),
            (x.shape[1],),
        )
        return self.out(c * y.to(x.dtype))
