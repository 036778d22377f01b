"""Mixture-of-experts feed-forward for packed tokens: the router, expert grouping, the experts.

The router is transformers': softmax over the experts in float32, top-k, the k weights
renormalised to sum to one where the config says so (Mixtral always; Qwen3-MoE per
`norm_topk_prob`); or one whose choice is made on its scores plus a per-expert correction bias,
the chosen experts weighted by their plain scores (`BiasedRouting`): DeepSeek-V3's (GLM-4.5,
dots.llm1: sigmoid scores in float32, the choice within the `topk_group` best of `n_group` groups, a
group ranked by its two best, renormalised where the config says so, then times
`routed_scaling_factor`) and ERNIE 4.5's (softmax scores, renormalised).

The experts' weights are stacked, gate and up fused: `w_gate_up` [E, 2I, H] and `w_down` [E, H, I].

The experts run over tokens grouped by expert: the T x k (token, slot) pairs are sorted by
expert, stably in transformers' order (by slot, then token, within an expert; a token's
experts summed in increasing expert order), so fp32 results equal transformers' bit for bit;
each expert that got a pair runs its two matmuls once over its rows. An expert
no token chose costs nothing; no Python loop runs per token. On CUDA the same computation
is a Triton grouped GEMM over the sorted pairs (`triton_moe.py`), with no host sync (CUDA
graphs capture it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from service.models import cpu_kernels
from service.models.ops import clamped_swiglu, relu2, silu_mul

# The native bf16 kernel streams each active expert's weights once per call: it wins while the
# experts get few rows (decode steps, short chunks: 1.4-2.7x the torch matmuls at 1-16 rows per
# expert, 32 experts of 512 x 1024); from ~64 rows per expert oneDNN's GEMMs win (compute-bound).
KERNEL_PAIRS_PER_EXPERT = 32


@dataclass(frozen=True)
class MoEShape:
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # the top-k weights divided by their sum
    shared_intermediate_size: int = 0  # a shared expert beside the routed ones (0: none)
    shared_gated: bool = (
        True  # its output times sigmoid(gate(x)) (Qwen2-MoE); False: added as it is (Granite)
    )
    shared_bias: bool = False  # the shared expert's projections have biases (ERNIE 4.5's `use_bias`)
    biased: BiasedRouting | None = None  # the choice made on scores plus a correction bias; None: softmax
    router_bias: bool = False  # the router's linear has a bias (gpt-oss)
    expert_bias: bool = False  # each expert's gate_up and down have biases (gpt-oss)
    # (alpha, limit): gpt-oss's clamped SwiGLU instead of SiLU(gate) * up (`ops.clamped_swiglu`)
    clamped_swiglu: tuple[float, float] | None = None
    # experts (and the shared one) without a gate: down(act(up(x))), `w_gate_up` holding up alone
    # [E, I, H]; the activation by name ("relu2": Nemotron 3's ReLU squared)
    ungated_act: str | None = None


@dataclass(frozen=True)
class BiasedRouting:
    """A router whose choice is made on its scores plus a per-expert correction bias, the chosen
    experts weighted by their plain scores: DeepSeek-V3's (`noaux_tc`: sigmoid scores, the choice
    within the best `topk_group` of `n_group` groups, the weights times `scale`) and ERNIE 4.5's
    (softmax scores, renormalised over a floor); or without the bias, DeepSeek-V2's (softmax
    scores, the groups ranked by their best expert)."""

    scoring: str = "sigmoid"  # or "softmax"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0  # routed_scaling_factor
    norm_floor: float | None = None  # renormalised w / max(sum, floor) (ERNIE); None: w / (sum + norm_eps)
    norm_eps: float = 1e-20  # LFM2-MoE's 1e-6: it matters where the bias chose experts of tiny scores
    correction: bool = True  # a per-expert bias on the scores the choice is made on (False: DeepSeek-V2)
    group_rank: str = "top2"  # a group's rank: the sum of its two best scores, or "max": its best


def sparse_layers(config, num_experts: int) -> tuple[bool, ...]:
    """Which layers are MoE, as transformers reads `decoder_sparse_step` and `mlp_only_layers`
    (a config without them: every layer)."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers)
    )


def v3_routing(config) -> BiasedRouting:
    """DeepSeek-V3's router as a config gives it: `n_group`, `topk_group`, `routed_scaling_factor`."""
    return BiasedRouting(
        n_group=config.n_group or 1,
        topk_group=config.topk_group or 1,
        scale=float(getattr(config, "routed_scaling_factor", None) or 1.0),
    )


def shared_experts_shape(
    config, num_experts: int, num_shared: int | None, routing: BiasedRouting, renormalize: bool
) -> MoEShape:
    """DeepSeek's layout: `num_experts_per_tok` of `num_experts` routed experts of
    `moe_intermediate_size` beside `num_shared` such experts fused into one, added without a gate."""
    return MoEShape(
        hidden_size=config.hidden_size,
        num_experts=num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=renormalize,
        shared_intermediate_size=config.moe_intermediate_size * (num_shared or 0),
        shared_gated=False,
        biased=routing,
    )


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): softmax in float32, then top-k
    (ties go as torch.topk breaks them, as in transformers), renormalised or not."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_biased(
    router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, r: BiasedRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) as DeepSeek-V3's, ERNIE 4.5's or
    (no bias) DeepSeek-V2's router gives them."""
    logits = router_logits.float()
    scores = logits.sigmoid() if r.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    t, e = choice.shape
    if r.n_group > 1:
        grouped = choice.view(t, r.n_group, e // r.n_group)
        group_scores = (
            grouped.amax(dim=-1) if r.group_rank == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        )
        best = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
        # DeepSeek-V2 zeroes the other groups' scores (they are >= 0), V3 sets them to -inf
        dropped = 0.0 if bias is None else float("-inf")
        choice = choice.masked_fill(~keep.repeat_interleave(e // r.n_group, dim=1), dropped)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + r.norm_eps if r.norm_floor is None else total.clamp(min=r.norm_floor))
    return weights * r.scale, ids


@dataclass(frozen=True)
class ExpertGroups:
    """The T x k (token, slot) pairs sorted by expert; pair p = slot * T + token."""

    order: torch.Tensor  # [T*k] pair ids, grouped by expert (stable: by slot, then token, within one)
    counts: list[int]  # pairs per expert [E] (host)

    @classmethod
    def of(cls, ids: torch.Tensor, num_experts: int) -> "ExpertGroups":
        flat = ids.t().reshape(-1)  # slot-major
        order = torch.argsort(flat, stable=True)
        return cls(order, torch.bincount(flat, minlength=num_experts).tolist())

    def active(self) -> list[tuple[int, int, int]]:
        """(expert, first sorted row, rows) for each expert that got at least one pair."""
        out, start = [], 0
        for e, n in enumerate(self.counts):
            if n:
                out.append((e, start, n))
                start += n
        return out


def experts_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_mul,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t: [T, H], in x's dtype.
    One gate_up and one down matmul per expert that got a token; `biases` (gate_up's [E, 2I],
    down's [E, H]) and the activation where the family has its own (gpt-oss)."""
    groups = ExpertGroups.of(ids, w_gate_up.shape[0])
    token = groups.order % ids.shape[0]
    xs = x.index_select(0, token)
    out = torch.empty_like(xs)
    for e, start, n in groups.active():
        rows = slice(start, start + n)
        if biases is None:
            out[rows] = F.linear(act(F.linear(xs[rows], w_gate_up[e])), w_down[e])
        else:
            b_gate_up, b_down = biases[0][e], biases[1][e]
            out[rows] = F.linear(act(F.linear(xs[rows], w_gate_up[e], b_gate_up)), w_down[e], b_down)
    out.mul_(weights.t().reshape(-1)[groups.order].unsqueeze(1).to(out.dtype))
    return torch.zeros_like(x).index_add_(0, token, out)


def experts_dense_reference(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, weighted by the routing (zero where not chosen): what the
    grouped forms must equal. For tests and checks only: it computes all experts."""
    gate_up = torch.einsum("th,eih->eti", x.float(), w_gate_up.float())
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, w_down.float())  # [E, T, H]
    dense = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, ids, weights.float())
    return torch.einsum("te,eth->th", dense, y).to(x.dtype)


class MoEBlock(nn.Module):
    """Router + stacked experts (+ a shared expert with its sigmoid gate, where the config has one)."""

    float32_parameters = ("router_weight", "score_bias")  # the loader keeps these float32 (biased routing)

    def __init__(self, s: MoEShape):
        super().__init__()
        self.s = s
        e, i, h = s.num_experts, s.intermediate_size, s.hidden_size
        if s.biased is None:
            self.router = nn.Linear(h, e, bias=s.router_bias)
        else:  # run in float32 as transformers does (kept so by the loader, not packed with the linears)
            self.router_weight = nn.Parameter(torch.zeros(e, h))
            if s.biased.correction:
                self.score_bias = nn.Parameter(torch.zeros(e))  # on the scores the choice is made on
        self.w_gate_up = nn.Parameter(torch.empty(e, i if s.ungated_act else 2 * i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        if s.expert_bias:
            self.b_gate_up = nn.Parameter(torch.zeros(e, 2 * i))
            self.b_down = nn.Parameter(torch.zeros(e, h))
        self.shared: nn.ModuleDict | None = None
        if s.shared_intermediate_size:
            si = s.shared_intermediate_size
            b = s.shared_bias
            up = si if s.ungated_act else 2 * si
            self.shared = nn.ModuleDict(dict(gate_up=nn.Linear(h, up, bias=b), down=nn.Linear(si, h, bias=b)))
            if s.shared_gated:
                self.shared["gate"] = nn.Linear(h, 1, bias=False)

    def _act(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What runs between an expert's two matmuls."""
        s = self.s
        if s.ungated_act is not None:
            return UNGATED[s.ungated_act]
        if s.clamped_swiglu is not None:
            return partial(clamped_swiglu, alpha=s.clamped_swiglu[0], limit=s.clamped_swiglu[1])
        return silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.s.biased is None:
            weights, ids = route(self.router(x), self.s.top_k, self.s.renormalize)
        else:
            logits = F.linear(x.float(), self.router_weight)
            bias = self.score_bias if self.s.biased.correction else None
            weights, ids = route_biased(logits, bias, self.s.top_k, self.s.renormalize, self.s.biased)
        act = self._act()
        if self.s.expert_bias or act is not silu_mul:  # the grouped torch form only
            biases = (self.b_gate_up, self.b_down) if self.s.expert_bias else None
            y = experts_torch(x, self.w_gate_up, self.w_down, weights, ids, biases, act)
        else:
            y = run_experts(x, self.w_gate_up, self.w_down, weights, ids)
        if self.shared is not None:
            sh = self.shared
            shared = sh["down"](act(sh["gate_up"](x)))
            y = y + (torch.sigmoid(sh["gate"](x)) * shared if self.s.shared_gated else shared)
        return y


UNGATED = {"relu2": relu2}  # the activations of experts without a gate, by MoEShape.ungated_act


def run_experts(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The Triton grouped GEMM on CUDA; on CPU in bf16 the native kernel (AVX-512 BF16), elsewhere
    the grouped torch form (float32: transformers' bits)."""
    if x.is_cuda:
        from service.models.triton_moe import fused_experts

        return fused_experts(x, w_gate_up, w_down, weights, ids)
    few_rows = ids.numel() <= KERNEL_PAIRS_PER_EXPERT * w_gate_up.shape[0]
    if few_rows and cpu_kernels.has_moe_kernel(x, ids.shape[1]):
        return cpu_kernels.moe_experts(x, w_gate_up, w_down, weights, ids)
    return experts_torch(x, w_gate_up, w_down, weights, ids)


def load_moe_block(
    block: MoEBlock,
    take: Any,
    prefix: str,
    names: tuple[str, str, str],
    shared: str = "shared_expert.",
    router: str = "gate.weight",
) -> None:
    """A checkpoint's router and experts into `block` (no grad). `take(name)` gives a tensor and
    `take.has(name)` says whether there is one. Experts as transformers' `save_pretrained` and
    the published checkpoints lay them out, one module per expert (`{prefix}experts.{e}.{gate,
    up, down}.weight` under the family's `names`), or fused 3-D (`{prefix}experts.gate_up_proj`
    [E, 2I, H] and `{prefix}experts.down_proj` [E, H, I], transformers' in-memory layout, or each
    [E, in, out] as Qwen3-VL-MoE publishes them). The router is `{prefix}{router}` (HunYuan's
    `gate.wg.weight`)."""
    if block.s.biased is None:
        block.router.weight.copy_(take(prefix + router))
    else:
        block.router_weight.copy_(take(prefix + router))
    if block.s.biased is not None and block.s.biased.correction:
        bias = (
            take.first(  # under the router, ERNIE's statistics, or the block (MiniMax-M2, EXAONE MoE, HY V3)
                prefix + "gate.e_score_correction_bias",
                prefix + "moe_statics.e_score_correction_bias",
                prefix + "e_score_correction_bias",
                prefix + "expert_bias",  # HY V3's published name
            )
        )
        block.score_bias.copy_(bias.reshape(-1))  # ERNIE's is [1, E]
    if take.has(prefix + "experts.gate_up_proj"):
        for param, name in ((block.w_gate_up, "gate_up_proj"), (block.w_down, "down_proj")):
            t = take(prefix + "experts." + name)
            # Qwen3-VL-MoE publishes them [E, in, out]: turned as transformers does, when the
            # shape says so (a square one is taken as it is)
            param.copy_(t if t.shape == param.shape else t.transpose(1, 2))
    else:
        gate, up, down = names
        for e in range(block.s.num_experts):
            q = f"{prefix}experts.{e}."
            block.w_gate_up[e].copy_(torch.cat([take(q + gate + ".weight"), take(q + up + ".weight")]))
            block.w_down[e].copy_(take(q + down + ".weight"))
    if block.shared is not None:
        sh, q = block.shared, prefix + shared
        sh["gate_up"].weight.copy_(torch.cat([take(q + "gate_proj.weight"), take(q + "up_proj.weight")]))
        sh["down"].weight.copy_(take(q + "down_proj.weight"))
        if block.s.shared_bias:
            sh["gate_up"].bias.copy_(torch.cat([take(q + "gate_proj.bias"), take(q + "up_proj.bias")]))
            sh["down"].bias.copy_(take(q + "down_proj.bias"))
        if "gate" in sh:
            sh["gate"].weight.copy_(take(prefix + "shared_expert_gate.weight"))
