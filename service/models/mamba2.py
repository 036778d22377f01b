"""Mamba-2: the state-space layers of Granite 4.0's hybrids (GraniteMoeHybrid), a recurrent layer
(recurrent.py) with two states per request slot: its conv's last `d_conv - 1` inputs (the model's
dtype) and the SSM state S [heads, head_dim, d_state] (float32).

    z, xBC, dt = in_proj(h);  x, B, C = silu(conv(xBC));  dt = softplus(dt + dt_bias)
    per token: S = exp(dt A) S + dt x B^T;  y = S C + D x     (A = -exp(A_log), B and C per group)
    out_proj(RMSNorm per group(y * silu(z)))

A decode step runs that update for every request at once; an extend's tokens run chunk by chunk
(`chunked_scan`, dt clamped to `time_step_limit` there only, as transformers and mamba_ssm do), each
request from its own state, right-padded together (padding has dt = 0: no decay, no update)."""

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

CHUNK = 64


@dataclass(frozen=True)
class Mamba2Shape:
    hidden_size: int
    inner: int  # mamba_expand * hidden_size = heads * head_dim
    heads: int
    head_dim: int
    groups: int  # B and C are shared by heads // groups heads
    d_state: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # on in_proj (and on out_proj unless out_bias says otherwise)
    norm_eps: float
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    # how z gates y before out_proj: "gate_norm" RMSNorm per group of y * silu(z) (Granite, Bamba,
    # Nemotron-H); "norm_gate" RMSNorm per group of y, then times silu(z); "gate" y * silu(z), no norm
    # (Falcon-H1 by `mamba_rms_norm` and `mamba_norm_before_gate`)
    gating: str = "gate_norm"
    out_bias: bool | None = (
        None  # out_proj's bias where it differs from in_proj's (Falcon-H1's `projectors_bias`)
    )

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.d_state

    def state_shapes(self, dtype: torch.dtype) -> StateSpec:
        return [
            ((self.conv_kernel - 1, self.conv_channels), dtype),
            ((self.heads, self.head_dim, self.d_state), torch.float32),
        ]

    def build(self, hidden_size: int) -> Mamba2:
        return Mamba2(self)


def ssm_step(x, dt, a, b, c, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [n, H, P], dt [n, H], a [H], b, c [n, H, N], state [n, H, P, N] ->
    (S C [n, H, P], the new state); all float32."""
    decay = (dt * a).exp()[..., None, None]
    state = state * decay + (dt.unsqueeze(-1) * x).unsqueeze(-1) * b.unsqueeze(-2)
    return torch.einsum("nhpk,nhk->nhp", state, c), state


def chunked_scan(x, dt, a, b, c, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Several tokens per row, right-padded to L: x [m, L, H, P], dt [m, L, H] (0 on padding), a [H],
    b, c [m, L, H, N], state [m, H, P, N] -> (S C per token [m, L, H, P], the state after the last
    token). Within a chunk, with G the cumulative log decay (dt a), token i reads the chunk's start
    state decayed by e^G_i and each earlier token j of the chunk through (c_i . b_j) e^(G_i - G_j)."""
    m, n, h, p = x.shape
    pad = (-n) % chunk
    if pad:
        x, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, b, c))
        dt = F.pad(dt, (0, 0, 0, pad))
    k = (n + pad) // chunk
    # [m, k, H, Q, .] per chunk and head
    xs = (x * dt.unsqueeze(-1)).reshape(m, k, chunk, h, p).transpose(2, 3)
    bs = b.reshape(m, k, chunk, h, -1).transpose(2, 3)
    cs = c.reshape(m, k, chunk, h, -1).transpose(2, 3)
    cum = (dt * a).reshape(m, k, chunk, h).transpose(2, 3).cumsum(-1)  # [m, k, H, Q]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    inner = (cs @ bs.transpose(-1, -2)) * decay  # [m, k, H, Q, Q]
    within = inner @ xs  # [m, k, H, Q, P]
    c_decayed = cs * cum.exp().unsqueeze(-1)
    b_decayed = bs * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [m, k, H, 1, 1]
    out = torch.empty_like(within)
    for i in range(k):
        out[:, i] = within[:, i] + c_decayed[:, i] @ state.transpose(-1, -2)
        state = state * chunk_decay[:, i] + xs[:, i].transpose(-1, -2) @ b_decayed[:, i]
    return out.transpose(2, 3).reshape(m, k * chunk, h, p)[:, :n], state


class Mamba2(nn.Module):
    float32_parameters = ("A_log", "dt_bias", "D")

    def __init__(self, s: Mamba2Shape):
        super().__init__()
        self.s = s
        self.in_proj = nn.Linear(s.hidden_size, s.inner + s.conv_channels + s.heads, bias=s.proj_bias)
        self.conv_weight = nn.Parameter(torch.zeros(s.conv_channels, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(s.conv_channels)) if s.conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(s.heads))
        self.A_log = nn.Parameter(torch.zeros(s.heads))
        self.D = nn.Parameter(torch.ones(s.heads))
        self.norm = nn.Parameter(torch.ones(s.inner))
        self.out = nn.Linear(s.inner, s.hidden_size, bias=s.proj_bias if s.out_bias is None else s.out_bias)

    def forward(self, x, positions, cos, sin, states, unused, rows: RecurrentRows, attn) -> torch.Tensor:
        s = self.s
        conv_state, state = states
        z, xbc, dt = self.in_proj(x).split([s.inner, s.conv_channels, s.heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        y = rows.run(
            partial(self._step, conv_state, state),
            partial(self._chunks, conv_state, state),
            (xbc, dt),
            (s.heads, s.head_dim),
        )
        return self.out(self._gated_norm(y.flatten(1), z))

    def _split(self, conv: torch.Tensor):
        """silu(conv) [.., C] float32 -> x [.., H, P], b, c [.., G, N] (a group's b and c serve
        H / G heads)."""
        s = self.s
        xs, b, c = F.silu(conv).split([s.inner, s.groups * s.d_state, s.groups * s.d_state], dim=-1)
        b, c = (t.unflatten(-1, (s.groups, s.d_state)) for t in (b, c))
        return xs.unflatten(-1, (s.heads, s.head_dim)), b, c

    def _per_head(self, t: torch.Tensor) -> torch.Tensor:
        """b or c per group [.., G, N] -> per head [.., H, N]."""
        return t.repeat_interleave(self.s.heads // self.s.groups, dim=-2)

    def _step(self, conv_state, state, xbc, dt, rows: StepRows) -> torch.Tensor:
        conv = conv_step(xbc, conv_state, self.conv_weight, self.conv_bias, rows)
        xs, b, c = self._split(conv.to(xbc.dtype).float())
        a = -self.A_log.float().exp()
        one = [t.unsqueeze(1) for t in (xs, dt, b, c)]  # one token per request: [n, 1, ...]
        y = cpu_kernels.ssm_scan(one[0], one[1], a, one[2], one[3], state, rows.slots, rows.keep)
        if y is not None:
            y = y[:, 0]
        else:  # not on a CPU, or no kernel library
            b, c = self._per_head(b), self._per_head(c)
            y, new = ssm_step(xs, dt, a, b, c, read_states(state, rows.slots, rows.keep))
            state.index_copy_(0, rows.slots, new)
        return y + self.D.float().unsqueeze(-1) * xs

    def _chunks(self, conv_state, state, xbc, dt, rows: ChunkRows) -> torch.Tensor:
        conv = conv_extend(xbc, conv_state, self.conv_weight, self.conv_bias, rows)
        xs, b, c = self._split(conv.to(xbc.dtype).float())  # [m, L, ...]
        # the chunked form's floor and ceiling on dt (`time_step_limit`); the step has none, as in
        # transformers and mamba_ssm (a one-token prompt chunk runs as a step: unclamped)
        dt = dt[rows.packed].clamp(*self.s.dt_limit) * rows.valid.unsqueeze(-1)
        a = -self.A_log.float().exp()
        y = cpu_kernels.ssm_scan(xs, dt, a, b, c, state, rows.slots, rows.keep, rows.lens)
        if y is None:  # not on a CPU, or no kernel library
            b, c = self._per_head(b), self._per_head(c)
            y, new = chunked_scan(xs, dt, a, b, c, read_states(state, rows.slots, rows.keep))
            state.index_copy_(0, rows.slots, new)
        return (y + self.D.float().unsqueeze(-1) * xs)[rows.valid]

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y gated by z as `gating` says (float32), back in the model's dtype."""
        s = self.s
        gate = F.silu(z.float())
        if s.gating == "gate":
            return (y * gate).to(z.dtype)
        g = (y * gate if s.gating == "gate_norm" else y).unflatten(-1, (s.groups, -1))
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + s.norm_eps)).flatten(-2)
        if s.gating == "gate_norm":
            return self.norm * g.to(z.dtype)
        return (self.norm.float() * g * gate).to(z.dtype)


def mamba2_shape(config, **overrides: Any) -> Mamba2Shape:
    """From transformers' `mamba_*` fields (GraniteMoeHybrid's, Bamba's, Falcon-H1's: its width
    `mamba_d_ssm` where given), then a family's own."""
    inner = getattr(config, "mamba_d_ssm", None) or int(config.mamba_expand * config.hidden_size)
    limit = getattr(config, "time_step_limit", None)
    fields = dict(
        hidden_size=config.hidden_size,
        inner=inner,
        heads=config.mamba_n_heads,
        head_dim=inner // config.mamba_n_heads,
        groups=config.mamba_n_groups,
        d_state=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        conv_bias=bool(config.mamba_conv_bias),
        proj_bias=bool(config.mamba_proj_bias),
        norm_eps=config.rms_norm_eps,
        dt_limit=(float(limit[0]), float(limit[1])) if limit else (0.0, float("inf")),
    )
    return Mamba2Shape(**{**fields, **overrides})


def load_mamba2(m: Mamba2, take: Any, a: str) -> None:
    """A Mamba-2 layer's tensors under `a` (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`)."""
    s = m.s
    for linear, name in ((m.in_proj, "in_proj"), (m.out, "out_proj")):
        linear.weight.copy_(take(a + name + ".weight"))
        if linear.bias is not None:
            linear.bias.copy_(take(a + name + ".bias"))
    m.conv_weight.copy_(take(a + "conv1d.weight").reshape(s.conv_channels, s.conv_kernel))
    if m.conv_bias is not None:
        m.conv_bias.copy_(take(a + "conv1d.bias"))
    for name in ("dt_bias", "A_log", "D"):
        getattr(m, name).copy_(take(a + name))
    if s.gating != "gate":
        m.norm.copy_(take(a + "norm.weight"))
