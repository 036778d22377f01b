"""Mamba (the first selective state-space layer: Mamba, FalconMamba), a recurrent layer
(recurrent.py) with two states per request slot: its conv's last `conv_kernel - 1` inputs (the
model's dtype) and the SSM state S [d_inner, d_state] (float32).

    x, z = in_proj(h);  u = silu(conv(x));  dt, B, C = x_proj(u)  (FalconMamba: each RMS-normed)
    dt = softplus(dt_proj(dt));  per token: S = exp(dt A) S + dt u B^T;  y = S C + D u
    out_proj(y * silu(z))                                    (A = -exp(A_log) [d_inner, d_state])

Unlike Mamba-2's, the decay differs per channel and state, so a chunk cannot be condensed into
matmuls: prompt tokens run the recurrence token by token, on a CPU in a native kernel
(`cpu_kernels.ssm1_scan`), elsewhere every request of the batch at once in torch ops (right-padded:
padding has dt = 0, no decay, no update)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from service.models import cpu_kernels
from service.models.recurrent import (
    ChunkRows,
    RecurrentRows,
    StateSpec,
    StepRows,
    conv_extend,
    conv_step,
    read_states,
)


@dataclass(frozen=True)
class Mamba1Shape:
    hidden_size: int
    inner: int  # expand * hidden_size
    d_state: int
    dt_rank: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # in_proj's and out_proj's
    bcdt_norm_eps: float | None = None  # FalconMamba, Jamba: B, C and dt RMS-normed with this eps
    bcdt_norm_weights: bool = (
        False  # ... times weights (Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`)
    )

    def state_shapes(self, dtype: torch.dtype) -> StateSpec:
        return [((self.conv_kernel - 1, self.inner), dtype), ((self.inner, self.d_state), torch.float32)]

    def build(self, hidden_size: int) -> Mamba1:
        return Mamba1(self)


def mamba1_shape(config, **overrides: Any) -> Mamba1Shape:
    """From transformers' Mamba config fields (`intermediate_size`, `state_size`, `time_step_rank`, ...;
    a family with other names gives every field in `overrides`)."""
    if {"inner", "d_state", "dt_rank", "conv_kernel", "conv_bias", "proj_bias"} <= set(overrides):
        return Mamba1Shape(hidden_size=config.hidden_size, **overrides)
    fields = dict(
        hidden_size=config.hidden_size,
        inner=config.intermediate_size,
        d_state=config.state_size,
        dt_rank=int(config.time_step_rank),
        conv_kernel=config.conv_kernel,
        conv_bias=bool(config.use_conv_bias),
        proj_bias=bool(config.use_bias),
    )
    return Mamba1Shape(**{**fields, **overrides})


def ssm_step(u, dt, a, b, c, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: u, dt [n, D], a [D, N], b, c [n, N], state [n, D, N] -> (S C [n, D], the new
    state); all float32."""
    state = state * (dt.unsqueeze(-1) * a).exp() + (dt * u).unsqueeze(-1) * b.unsqueeze(1)
    return (state @ c.unsqueeze(-1)).squeeze(-1), state


class Mamba1(nn.Module):
    float32_parameters = ("A_log", "D")

    def __init__(self, s: Mamba1Shape):
        super().__init__()
        self.s = s
        self.in_proj = nn.Linear(s.hidden_size, 2 * s.inner, bias=s.proj_bias)
        self.conv_weight = nn.Parameter(torch.zeros(s.inner, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(s.inner)) if s.conv_bias else None
        self.x_proj = nn.Linear(s.inner, s.dt_rank + 2 * s.d_state, bias=False)
        self.dt_proj = nn.Linear(s.dt_rank, s.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(s.inner, s.d_state))
        self.D = nn.Parameter(torch.ones(s.inner))
        self.out = nn.Linear(s.inner, s.hidden_size, bias=s.proj_bias)
        if s.bcdt_norm_weights:
            self.dt_norm = nn.Parameter(torch.ones(s.dt_rank))
            self.b_norm = nn.Parameter(torch.ones(s.d_state))
            self.c_norm = nn.Parameter(torch.ones(s.d_state))

    def forward(self, x, positions, cos, sin, states, unused, rows: RecurrentRows, attn) -> torch.Tensor:
        s = self.s
        conv_state, state = states
        u, z = self.in_proj(x).chunk(2, dim=-1)
        y = rows.run(
            partial(self._step, conv_state, state), partial(self._chunks, conv_state, state), (u,), (s.inner,)
        )
        return self.out((y * F.silu(z.float())).to(x.dtype))

    def _ssm_inputs(self, conv: torch.Tensor, dtype: torch.dtype):
        """silu(conv) -> u, dt, b, c (float32)."""
        s = self.s
        u = F.silu(conv).to(dtype)
        dt, b, c = self.x_proj(u).split([s.dt_rank, s.d_state, s.d_state], dim=-1)
        if s.bcdt_norm_eps is not None:
            dt, b, c = (
                (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + s.bcdt_norm_eps)).to(
                    t.dtype
                )
                for t in (dt, b, c)
            )
            if s.bcdt_norm_weights:
                dt, b, c = dt * self.dt_norm, b * self.b_norm, c * self.c_norm
        dt = F.softplus(self.dt_proj(dt).float())
        return u.float(), dt, b.float(), c.float()

    def _step(self, conv_state, state, u, rows: StepRows) -> torch.Tensor:
        conv = conv_step(u, conv_state, self.conv_weight, self.conv_bias, rows)
        u, dt, b, c = self._ssm_inputs(conv, u.dtype)
        a = -self.A_log.float().exp()
        one = [t.unsqueeze(1) for t in (u, dt, b, c)]  # one token per request: [n, 1, ...]
        y = cpu_kernels.ssm1_scan(one[0], one[1], a, one[2], one[3], state, rows.slots, rows.keep)
        if y is not None:
            y = y[:, 0]
        else:  # not on a CPU, or no kernel library
            y, new = ssm_step(u, dt, a, b, c, read_states(state, rows.slots, rows.keep))
            state.index_copy_(0, rows.slots, new)
        return y + self.D.float() * u

    def _chunks(self, conv_state, state, u, rows: ChunkRows) -> torch.Tensor:
        conv = conv_extend(u, conv_state, self.conv_weight, self.conv_bias, rows)  # [m, L, D]
        xs, dt, b, c = self._ssm_inputs(conv, u.dtype)
        dt = dt * rows.valid.unsqueeze(-1)  # padding: no decay, no update
        a = -self.A_log.float().exp()
        y = cpu_kernels.ssm1_scan(xs, dt, a, b, c, state, rows.slots, rows.keep, rows.lens)
        if y is not None:
            return (y + self.D.float() * xs)[rows.valid]
        s = read_states(state, rows.slots, rows.keep)  # not on a CPU, or no kernel library
        ys = []
        for t in range(xs.shape[1]):
            y, s = ssm_step(xs[:, t], dt[:, t], a, b[:, t], c[:, t], s)
            ys.append(y)
        state.index_copy_(0, rows.slots, s)
        return (torch.stack(ys, dim=1) + self.D.float() * xs)[rows.valid]


def load_mamba1(m: Mamba1, take: Any, a: str) -> None:
    """A Mamba layer's tensors under `a` (`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`)."""
    for linear, name in (
        (m.in_proj, "in_proj"),
        (m.out, "out_proj"),
        (m.x_proj, "x_proj"),
        (m.dt_proj, "dt_proj"),
    ):
        linear.weight.copy_(take(a + name + ".weight"))
        if linear.bias is not None:
            linear.bias.copy_(take(a + name + ".bias"))
    m.conv_weight.copy_(take(a + "conv1d.weight").reshape(m.s.inner, m.s.conv_kernel))
    if m.conv_bias is not None:
        m.conv_bias.copy_(take(a + "conv1d.bias"))
    m.A_log.copy_(take(a + "A_log"))
    m.D.copy_(take(a + "D"))
    if m.s.bcdt_norm_weights:
        for param, name in (
            (m.dt_norm, "dt_layernorm"),
            (m.b_norm, "b_layernorm"),
            (m.c_norm, "c_layernorm"),
        ):
            param.copy_(take(a + name + ".weight"))
