"""Where a decode step's time goes: the model forward and sampling, in-process.

Builds `--batch-size` requests of `--prompt-len` tokens on the default model (or
`--model`), prefills them, then times decode steps at growing context with the
torch profiler, and prints the top operators by self CPU time plus per-phase
wall times (forward, sampling). No server, no scheduler: the forward alone.

Usage:
    .venv/bin/python bench/profile_step.py [--dtype bfloat16] [--batch-size 64]
        [--prompt-len 41] [--steps 16] [--backend torch] [--rows 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.config import resolve_dtype  # noqa: E402
from service.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch  # noqa: E402
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool  # noqa: E402
from service.engine.sampler import Sampler  # noqa: E402
from service.model_prep import prepare_default_model  # noqa: E402
from service.models.backends import get_attention_backend  # noqa: E402
from service.models.loader import load_model  # noqa: E402


def greedy_sampling(bs: int, vocab: int) -> SamplingBatch:
    f = torch.zeros(bs)
    return SamplingBatch(
        temperatures=f,
        top_ks=torch.full((bs,), vocab),
        top_ps=f + 1,
        min_ps=f,
        repetition_penalties=f + 1,
        frequency_penalties=f,
        presence_penalties=f,
        seeds=torch.zeros(bs, dtype=torch.int64),
        steps=torch.zeros(bs, dtype=torch.int64),
        req_slots=torch.arange(bs),
        all_greedy=True,
        need_top_k_p=False,
        need_min_p=False,
        need_penalties=False,
    )


def extend_batch(bs: int, n: int, table: torch.Tensor, kv: TokenToKVPool, vocab: int) -> ForwardBatch:
    locs = kv.alloc(bs * n)
    table[:bs, :n] = locs.view(bs, n)
    j = torch.arange(n)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.randint(0, vocab, (bs * n,)),
        positions=j.repeat(bs),
        out_cache_loc=locs,
        kv_indices=table[:bs, :n].clone(),
        q_positions=j.repeat(bs, 1),
        logits_index=torch.arange(bs) * n + n - 1,
        sampling=greedy_sampling(bs, vocab),
        q_pad_index=torch.arange(bs * n),
        q_unpad_index=torch.arange(bs * n),
        extend_lens=[n] * bs,
        seq_lens=torch.full((bs,), n),
        extend_prefix_lens=torch.zeros(bs, dtype=torch.int64),
    )


def decode_batch(
    bs: int, pos: int, table: torch.Tensor, kv: TokenToKVPool, ids: torch.Tensor, vocab: int
) -> ForwardBatch:
    locs = kv.alloc(bs)
    table[:bs, pos] = locs
    positions = torch.full((bs,), pos)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=ids,
        positions=positions,
        out_cache_loc=locs,
        kv_indices=table[:bs, : pos + 1].clone(),
        q_positions=positions.unsqueeze(1),
        logits_index=torch.arange(bs),
        sampling=greedy_sampling(bs, vocab),
        seq_lens=positions + 1,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=41)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--backend", default="torch")
    p.add_argument("--no-pack", action="store_true", help="plain F.linear weights (no oneDNN packing)")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--prefill-repeats", type=int, default=1,
                   help="time the prefill this many times (the first includes one-time set-up), median")  # fmt: skip
    p.add_argument("--profile-prefill", action="store_true", help="print the operators of a warm prefill too")
    args = p.parse_args()

    model_dir = Path(args.model) if args.model else prepare_default_model()
    dtype = resolve_dtype(args.dtype)
    bs, n = args.batch_size, args.prompt_len
    ctx = n + args.steps + 8
    model = load_model(model_dir, dtype, 4096, pack=not args.no_pack)
    s = model.shape
    kv = TokenToKVPool(bs * ctx + 8, s.num_layers, s.num_kv_heads, s.head_dim, dtype)
    table = ReqToTokenPool(bs, ctx).table
    attn = get_attention_backend(args.backend, dtype=dtype)
    sampler = Sampler(bs, s.vocab_size)
    print(f"model {model_dir.name} {dtype} threads={torch.get_num_threads()} bs={bs} prompt={n}")

    with torch.no_grad():
        fb = extend_batch(bs, n, table, kv, s.vocab_size)
        times = []
        for _ in range(max(1, args.prefill_repeats)):
            t0 = time.perf_counter()
            logits = model(fb, fb.input_ids, kv, attn)
            times.append(time.perf_counter() - t0)
        warm = f", warm median {statistics.median(times[1:]) * 1e3:.1f} ms" if len(times) > 1 else ""
        print(f"prefill {bs}x{n}: first {times[0] * 1e3:.1f} ms{warm}")
        if args.profile_prefill:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model(fb, fb.input_ids, kv, attn)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        ids = sampler.sample(logits, fb.sampling)
        fwd, smp = [], []
        pos = n

        def step() -> None:
            nonlocal ids, pos
            fb = decode_batch(bs, pos, table, kv, ids, s.vocab_size)
            t0 = time.perf_counter()
            logits = model(fb, fb.input_ids, kv, attn)
            t1 = time.perf_counter()
            ids = sampler.sample(logits, fb.sampling)
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            smp.append(t2 - t1)
            pos += 1

        for _ in range(3):  # warm-up
            step()
        fwd.clear(), smp.clear()
        for _ in range(args.steps // 2):
            step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps - args.steps // 2):
                step()
    print(
        f"decode bs={bs}: forward median {statistics.median(fwd) * 1e3:.1f} ms, "
        f"sampling median {statistics.median(smp) * 1e3:.2f} ms (unprofiled steps: {len(fwd) - args.steps // 2 or len(fwd)})"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
