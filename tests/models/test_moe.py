"""The mixture-of-experts block: router, grouping by expert, the grouped experts (torch and Triton).

The grouped forms must equal a dense reference (every expert on every token, weighted by the
routing) on random router logits, with ties, experts no token chose and batches where every
token picks the same expert(s); the router's top-k and weights must equal transformers'.
The Triton kernels run on CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it).
"""

from __future__ import annotations

import os

import pytest
import torch

from service.models import cpu_kernels
from service.models.moe import (
    KERNEL_PAIRS_PER_EXPERT,
    ExpertGroups,
    experts_dense_reference,
    experts_torch,
    route,
    run_experts,
)


def _weights(num_experts: int, hidden: int, inter: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.2).to(dtype)
    return w_gate_up, w_down


def _logits(kind: str, tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    if kind == "ties":  # whole rows equal, and pairs of equal experts
        logits[::3] = 0.25
        logits[1::3, 1] = logits[1::3, 2]
    elif kind == "unused":  # half the experts never chosen
        logits[:, num_experts // 2 :] = -30.0
    elif kind == "one":  # every token picks the same first expert (and second)
        logits[:, 3] += 40.0
        logits[:, 5] += 20.0
    return logits


CASES = [  # (logits kind, tokens, experts, top_k, renormalize)
    ("random", 17, 8, 2, True),
    ("random", 9, 16, 4, False),
    ("ties", 12, 8, 2, True),
    ("ties", 7, 6, 3, False),
    ("unused", 11, 8, 2, True),
    ("one", 10, 8, 1, False),
    ("one", 10, 8, 2, True),
    ("random", 1, 8, 2, True),  # a single decode token
]


@pytest.mark.parametrize("kind,tokens,experts,top_k,renorm", CASES)
def test_grouped_experts_equal_dense_reference(kind, tokens, experts, top_k, renorm):
    hidden, inter = 24, 20
    w_gate_up, w_down = _weights(experts, hidden, inter, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = route(_logits(kind, tokens, experts, seed=2), top_k, renorm)
    if renorm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    ref = experts_dense_reference(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(experts_torch(x, w_gate_up, w_down, weights, ids), ref, atol=1e-5, rtol=1e-5)


def test_grouping_sorts_pairs_by_expert_and_counts_active_ones():
    ids = torch.tensor([[3, 1], [1, 0], [3, 0], [1, 3]])
    groups = ExpertGroups.of(ids, num_experts=5)
    assert groups.counts == [2, 3, 0, 3, 0]
    assert groups.order.tolist() == [5, 6, 1, 3, 4, 0, 2, 7]  # pair = slot * 4 + token: by slot, then token
    assert groups.active() == [(0, 0, 2), (1, 2, 3), (3, 5, 3)]


def test_all_tokens_on_one_expert_runs_one_matmul_pair(monkeypatch):
    import service.models.moe as moe

    calls = []
    real = moe.F.linear
    monkeypatch.setattr(moe.F, "linear", lambda a, w: calls.append(tuple(a.shape)) or real(a, w))
    w_gate_up, w_down = _weights(8, 16, 12, seed=0)
    x = torch.randn(6, 16)
    weights, ids = route(_logits("one", 6, 8, seed=0), 1, False)
    assert set(ids.flatten().tolist()) == {3}
    out = experts_torch(x, w_gate_up, w_down, weights, ids)
    assert calls == [(6, 16), (6, 12)]  # one gate_up, one down, over all six tokens
    torch.testing.assert_close(out, experts_dense_reference(x, w_gate_up, w_down, weights, ids))


# (logits kind, tokens, experts, top_k, hidden, inter): the native kernel's shapes, with a hidden
# size and an expert width that are not multiples of the kernel's 32-element steps and 4-row tiles
NATIVE_CASES = [
    ("random", 1, 32, 4, 128, 64),
    ("random", 13, 8, 2, 96, 40),
    ("ties", 12, 8, 2, 72, 18),
    ("unused", 11, 16, 4, 64, 32),
    ("one", 10, 8, 1, 40, 23),
    ("random", 40, 128, 8, 64, 24),
]


@pytest.mark.parametrize("kind,tokens,experts,top_k,hidden,inter", NATIVE_CASES)
def test_native_bf16_experts_equal_the_dense_reference(kind, tokens, experts, top_k, hidden, inter):
    """bf16 on CPU: the native kernel where the CPU has AVX-512 BF16 (float32 sums, a token's experts
    summed before one rounding) is about as close to a float64 reference as the torch matmuls
    (their worst errors are a few bf16 roundings of the largest outputs either way); elsewhere
    `run_experts` is the torch form."""
    w_gate_up, w_down = _weights(experts, hidden, inter, seed=tokens, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights, ids = route(_logits(kind, tokens, experts, seed=2), top_k, True)
    ref = experts_dense_reference(x.double(), w_gate_up.double(), w_down.double(), weights.double(), ids)
    torch_form = experts_torch(x, w_gate_up, w_down, weights, ids)
    out = run_experts(x, w_gate_up, w_down, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    if not cpu_kernels.has_moe_kernel(x):
        assert torch.equal(out, torch_form)
        return
    err, torch_err = (out.double() - ref).abs().max(), (torch_form.double() - ref).abs().max()
    assert err <= 1.5 * max(torch_err, 2**-8 * ref.abs().max()), (err, torch_err)
    torch.testing.assert_close(out.double(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


def test_native_bf16_experts_give_a_token_the_same_bits_alone_or_in_a_batch():
    """The kernel's tiles sum each row in one fixed order: a decode token's output does not depend on
    the tokens beside it (or on how many share its experts)."""
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w_gate_up, w_down = _weights(8, 96, 40, seed=4, dtype=torch.bfloat16)
    weights, ids = route(_logits("one", 9, 8, seed=5), 2, True)  # every token on experts 3 and 5
    if not cpu_kernels.has_moe_kernel(x):  # not built for this CPU: the torch form serves
        assert cpu_kernels.load() is None or cpu_kernels.load().moe_experts_isa() == 0
        assert torch.equal(
            run_experts(x, w_gate_up, w_down, weights, ids), experts_torch(x, w_gate_up, w_down, weights, ids)
        )
        return
    batch = cpu_kernels.moe_experts(x, w_gate_up, w_down, weights, ids)
    for t in range(9):
        alone = cpu_kernels.moe_experts(x[t : t + 1], w_gate_up, w_down, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batch[t])


def test_long_prompts_take_the_torch_matmuls(monkeypatch):
    """Past KERNEL_PAIRS_PER_EXPERT pairs per expert (a long prompt chunk) the experts run as torch
    matmuls (oneDNN's GEMMs win there); a decode-sized batch takes the kernel where it is built."""
    import service.models.moe as moe

    used = []
    monkeypatch.setattr(moe, "experts_torch", lambda *a: used.append("torch") or experts_torch(*a))
    w_gate_up, w_down = _weights(4, 32, 16, seed=0, dtype=torch.bfloat16)
    for tokens in (2, KERNEL_PAIRS_PER_EXPERT * 4 // 2 + 1):
        x = torch.randn(tokens, 32).to(torch.bfloat16)
        weights, ids = route(_logits("random", tokens, 4, seed=1), 2, True)
        run_experts(x, w_gate_up, w_down, weights, ids)
    kernel = cpu_kernels.has_moe_kernel(x)
    assert used == (["torch"] if kernel else ["torch", "torch"])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_router_and_experts_equal_transformers(family, kind):
    """Our route equals transformers' router bit for bit (ties included); the grouped experts equal its
    experts module (fp32)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hidden, experts, top_k = 32, 8, 2
    torch.manual_seed(0)
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=hidden, intermediate_size=24, num_local_experts=experts)
        block, renorm = MixtralSparseMoeBlock(cfg).eval(), True
    else:
        cfg = Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=24, num_experts=experts, num_experts_per_tok=top_k
        )
        block, renorm = Qwen3MoeSparseMoeBlock(cfg).eval(), False
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        if kind == "ties":  # two experts with the same router row: tied probabilities on every token
            block.gate.weight[4] = block.gate.weight[1]
    x = torch.randn(1, 15, hidden)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x.view(-1, hidden))
        ref = block(x).view(-1, hidden)
        weights, ids = route(torch.nn.functional.linear(x.view(-1, hidden), block.gate.weight), top_k, renorm)
        out = experts_torch(
            x.view(-1, hidden), block.experts.gate_up_proj, block.experts.down_proj, weights, ids
        )
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights.float())
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)  # our native silu_mul rounds differently


def test_block_with_shared_expert_equals_transformers_qwen2_moe_block():
    """MoEBlock loaded from transformers' Qwen2-MoE block (fused in-memory expert layout, a shared
    expert behind its sigmoid gate) computes what that block computes (fp32)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from service.models.moe import MoEBlock, MoEShape, load_moe_block

    cfg = Qwen2MoeConfig(
        hidden_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    hf = Qwen2MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    state = hf.state_dict()

    class Take:
        __call__ = state.__getitem__
        has = state.__contains__

    ours = MoEBlock(MoEShape(32, 8, 2, 16, renormalize=True, shared_intermediate_size=40))
    with torch.no_grad():
        load_moe_block(ours, Take(), "", ("gate_proj", "up_proj", "down_proj"))
        x = torch.randn(11, 32)
        torch.testing.assert_close(ours(x), hf(x[None])[0], atol=2e-6, rtol=2e-6)


# ---- the Triton kernels (interpreted on CPU) ---------------------------------------------------------

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
TRITON_TOL = {torch.float32: 2e-5, torch.float16: 1e-2}  # fp16: the torch form rounds more often


@pytest.fixture(scope="module")
def triton_moe():
    pytest.importorskip("triton", reason="triton is not installed")
    if DEVICE == "cpu" and not INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from service.models import triton_moe

    return triton_moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "kind,tokens,experts,top_k,renorm,block_m",
    [
        ("random", 21, 8, 2, True, None),
        ("ties", 12, 8, 2, True, 16),
        ("unused", 40, 8, 2, True, 32),  # several blocks per expert
        ("one", 10, 8, 2, True, None),
        ("random", 3, 16, 4, False, None),
    ],
)
def test_triton_fused_experts_equal_torch(triton_moe, dtype, kind, tokens, experts, top_k, renorm, block_m):
    hidden, inter = 72, 40  # neither a multiple of the kernels' column/K blocks
    w_gate_up, w_down = _weights(experts, hidden, inter, seed=3, dtype=dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights, ids = route(_logits(kind, tokens, experts, seed=5), top_k, renorm)
    args = [t.to(DEVICE) for t in (x, w_gate_up, w_down, weights, ids)]
    out = triton_moe.fused_experts(*args, block_m=block_m)
    ref = experts_torch(*args)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tol = TRITON_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_alignment_pads_each_expert_to_whole_blocks(triton_moe):
    ids = torch.tensor([[3, 1], [1, 0], [3, 0], [1, 3], [1, 0]])
    al = triton_moe.align(ids, num_experts=5, block_m=4)
    n = ids.numel()
    blocks = al.sorted_pairs.view(-1, 4)
    used = al.block_expert >= 0
    assert al.block_expert[used].tolist() == [0, 1, 3]  # experts 2 and 4 have no block
    for e, block in zip(al.block_expert[used].tolist(), blocks[used]):
        pairs = block[block < n]
        assert (ids.t().flatten()[pairs.long()] == e).all()
    assert sorted(al.sorted_pairs[al.sorted_pairs < n].tolist()) == list(range(n))
    assert (blocks[~used] == n).all()


def test_cuda_path_routing_and_alignment_make_no_host_sync(triton_moe):
    """What runs around the kernels on CUDA (router, alignment) never reads a device value on the
    host, so the overlap loop never waits and CUDA graphs capture the MoE layers."""
    from tests.engine.test_device_path import HostSyncDetector

    found: list[str] = []
    logits = _logits("unused", 9, 8, seed=0)
    with HostSyncDetector(found):
        _, ids = route(logits, 2, True)
        al = triton_moe.align(ids, 8, triton_moe.pick_block_m(ids.numel(), 8))
    assert found == [] and al.sorted_pairs.numel() == al.block_expert.numel() * al.block_m
