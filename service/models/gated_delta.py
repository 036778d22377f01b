"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5, over packed batches.

A layer keeps, per request slot, two states instead of K/V rows: the last `conv_kernel - 1` inputs
of its short causal convolution (the model's dtype) and the recurrent state S [v_heads, k_dim, v_dim]
(float32). Per token t, with q and k L2-normalised and q scaled by k_dim ** -0.5:

    S = exp(g_t) S;  S += k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S

where beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias). A decode step runs that update
for every request at once (`recurrent_step`); the tokens of an extend batch run chunk by chunk
(`chunked_rule`: the updates of a chunk of 64 condensed into triangular solves and matmuls), each
request from its own state, or from zeros where its prompt starts in this batch. The output is
RMSNorm(o) * weight * silu(z) per head, then the out projection.

The states live in the engine's `SlotStates`, indexed by the request's slot (recurrent.py says how
they get along with the loops, and how the prefix cache restores them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

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

CHUNK = 64  # tokens per chunk of the chunked rule


@dataclass(frozen=True)
class GatedDeltaShape:
    """The numbers of a Gated DeltaNet layer (transformers' `linear_*` config fields)."""

    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each q/k head serves that many v heads
    k_dim: int
    v_dim: int
    conv_kernel: int
    norm_eps: float
    beta_scale: float = (
        1.0  # beta = scale * sigmoid(b): 2 lets the update's eigenvalues go negative (OLMo hybrid)
    )

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_size + self.value_size

    def state_shapes(self, dtype: torch.dtype) -> StateSpec:
        """Per slot: the convolution's last inputs (model dtype), the recurrent state (float32)."""
        return [
            ((self.conv_kernel - 1, self.conv_channels), dtype),
            ((self.num_v_heads, self.k_dim, self.v_dim), torch.float32),
        ]

    def build(self, hidden_size: int) -> GatedDeltaNet:
        return GatedDeltaNet(self, hidden_size)


def gated_delta_shape(config) -> GatedDeltaShape:
    return GatedDeltaShape(
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        k_dim=config.linear_key_head_dim,
        v_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        norm_eps=config.rms_norm_eps,
    )


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H] (float32), state [B, H, Dk, Dv]
    -> (o [B, H, Dv], the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    state = state + k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several tokens per row, right-padded to L. q, k [B, H, L, Dk], v [B, H, L, Dv], g, beta
    [B, H, L] (float32; padding has g = 0, beta = 0, which leaves the state as it was), state
    [B, H, Dk, Dv] -> (o [B, H, L, Dv], the state after the last token).

    Within a chunk, with G the cumulative log decay and D[i, j] = exp(G_i - G_j) for j <= i, the
    chunk's corrected values U = (I + A)^-1 (beta v) and decayed keys W = (I + A)^-1 (beta k e^G),
    A = strictly_lower((beta k) k^T * D), turn the chunk's sequential updates into
    V' = U - W S,  o = (q e^G) S + ((q k^T) * D) V',  S <- e^G_last S + (k e^(G_last - G))^T V'."""
    b, h, n, dk = k.shape
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    m = (n + pad) // chunk
    q, k, v = (x.reshape(b, h, m, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, m, chunk), beta.reshape(b, h, m, chunk)
    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], dk], -1
    )
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(u)
    for i in range(m):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + inner[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, m * chunk, -1)[:, :, :n], state


class GatedDeltaNet(nn.Module):
    """in projections -> short causal conv (SiLU) -> gated delta rule per slot -> gated RMSNorm -> out.

    `in_proj` fuses q, k, v (the conv's channels, in that order) and z; `in_ba` fuses b and a."""

    float32_parameters = ("A_log", "dt_bias")

    def __init__(self, s: GatedDeltaShape, hidden_size: int):
        super().__init__()
        self.s = s
        self.in_proj = nn.Linear(hidden_size, s.conv_channels + s.value_size, bias=False)
        self.in_ba = nn.Linear(hidden_size, 2 * s.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(s.conv_channels, s.conv_kernel))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.norm = nn.Parameter(torch.ones(s.v_dim))
        self.out = nn.Linear(s.value_size, hidden_size, bias=False)

    def forward(self, x, positions, cos, sin, states, unused, rows: RecurrentRows, attn) -> torch.Tensor:
        s = self.s
        conv_state, state = states
        mixed, z = self.in_proj(x).split([s.conv_channels, s.value_size], dim=-1)
        b, a = self.in_ba(x).float().chunk(2, dim=-1)
        beta = b.sigmoid() * s.beta_scale if s.beta_scale != 1.0 else b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        o = rows.run(
            partial(self._step, conv_state, state),
            partial(self._chunks, conv_state, state),
            (mixed, g, beta),
            (s.num_v_heads, s.v_dim),
        )
        return self.out(self._gated_norm(o, z))

    def _step(self, conv_state, state, mixed, g, beta, rows: StepRows) -> torch.Tensor:
        """One token per request: the conv and the rule a step on from each slot's states."""
        conv = conv_step(mixed, conv_state, self.conv_weight, None, rows)
        q, k, v = self._heads(F.silu(conv).to(mixed.dtype), shared=True)
        o = cpu_kernels.gated_delta_rule(
            *(x.unsqueeze(1) for x in (q, k, v, g, beta)), state, rows.slots, rows.keep
        )
        if o is not None:
            return o[:, 0]
        q, k = self._per_v_head(q), self._per_v_head(k)  # not on a CPU, or no kernel library
        o, new = recurrent_step(q, k, v, g, beta, read_states(state, rows.slots, rows.keep))
        state.index_copy_(0, rows.slots, new)
        return o

    def _heads(self, mixed: torch.Tensor, shared: bool = False):
        """[.., conv_channels] -> q, k [.., Hv, Dk] (float32, normalised, q scaled; `shared`: [.., Hk,
        Dk], each serving Hv / Hk v heads), v [.., Hv, Dv]."""
        s = self.s
        q, k, v = mixed.float().split([s.key_size, s.key_size, s.value_size], dim=-1)
        q = l2_normalise(q.unflatten(-1, (s.num_k_heads, s.k_dim))) * s.k_dim**-0.5
        k = l2_normalise(k.unflatten(-1, (s.num_k_heads, s.k_dim)))
        v = v.unflatten(-1, (s.num_v_heads, s.v_dim))
        return (q, k, v) if shared else (self._per_v_head(q), self._per_v_head(k), v)

    def _per_v_head(self, x: torch.Tensor) -> torch.Tensor:
        """q or k heads [.., Hk, Dk] -> one per v head [.., Hv, Dk]."""
        group = self.s.num_v_heads // self.s.num_k_heads
        return x.repeat_interleave(group, dim=-2) if group > 1 else x

    def _chunks(self, conv_state, state, mixed, g, beta, rows: ChunkRows) -> torch.Tensor:
        """Several tokens per request, from each slot's states (zeros where it starts afresh),
        right-padded and run together; the states written back. [tokens, Hv, Dv] in packed order."""
        conv = conv_extend(mixed, conv_state, self.conv_weight, None, rows)
        q, k, v = self._heads(F.silu(conv).to(mixed.dtype), shared=True)  # [m, L, H, D]
        valid = rows.valid.unsqueeze(-1)
        g, beta = (x[rows.packed] * valid for x in (g, beta))  # padding: no decay, no update
        o = cpu_kernels.gated_delta_rule(q, k, v, g, beta, state, rows.slots, rows.keep, rows.lens)
        if o is not None:
            return o[rows.valid]
        q, k = self._per_v_head(q), self._per_v_head(k)  # not on a CPU, or no kernel library
        o, new = chunked_rule(
            *(x.transpose(1, 2) for x in (q, k, v, g, beta)), read_states(state, rows.slots, rows.keep)
        )
        state.index_copy_(0, rows.slots, new)
        return o.transpose(1, 2)[rows.valid]

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's output, times the weight, times silu(z); [T, Hv * Dv]."""
        s = self.s
        dtype = z.dtype
        o = o.reshape(-1, s.num_v_heads, s.v_dim)
        normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + s.norm_eps)).to(dtype) * self.norm
        gate = F.silu(z.float()).view(-1, s.num_v_heads, s.v_dim)
        return (normed * gate).to(dtype).flatten(1)
