"""The GPU check: kernels vs SDPA, overlap vs normal on random-init models, no host syncs.

One command on a machine with one GPU (< 5 minutes on an H200):

    python bench/gpu_check.py --out gpu_check.json

It needs no network and no weights: models are random-init (--load-format dummy)
from configs of SmolLM2-135M's shape and a ~1B Llama shape (Llama-3.2-1B's
layers, SmolLM2's 49152-token vocabulary so they share its tokenizer); with
`--models qwen3-moe` also a Qwen3-MoE of Qwen3-30B-A3B's layer shapes (128
experts, top-8, fewer layers). The tokenizer comes from --tokenizer (default:
the prepared SmolLM2 directory).

1. kernels: the Triton decode / extend kernels against SDPA (float32 math on the
   same inputs) in bf16 and fp16 at realistic shapes, next to the torch backend's
   own error, with timings (triton.testing.do_bench); the fused-MoE kernel against
   the grouped torch experts (float32 math) at 30B-A3B's expert shapes;
2. loops: N greedy requests x M tokens in the normal and the overlap loop (tokens
   must be identical), CUDA events on the forward stream around every step: the
   median gap between consecutive decode forwards, busy fraction, and throughput
   overlap/normal;
3. syncs: one short overlap run (after its warm-up) under
   torch.cuda.set_sync_debug_mode("warn"): every synchronizing CUDA call, on any
   thread, is reported with its thread and stack.

4. features (bench/gpu_features.py): every feature alone and all of them together, in both
   loops, on random-init models (the first of --models, and a LLaVA over its shape): tokens
   identical between the loops, the median device gap between consecutive forwards, busy
   fraction, throughput overlap/normal, host syncs of the overlap run (CUDA), and from the
   matrix counters whether each feature stayed full, became a sync point or fell back —
   `python -m service matrix --measured gpu_check.json` renders it as a column of the matrix.

Decode runs as CUDA graphs (the engine's default with the Triton backend);
`--no-cuda-graph` measures the eager path.

`--device cpu --quick` runs the same code on tiny shapes on CPU (the kernels in
the Triton interpreter) — how the script itself is tested.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL_GAP_RATIO = 0.10  # overlap's median decode gap < 10% of normal's
GOAL_SPEEDUP = 1.30  # overlap / normal throughput on the 135M shape

SHAPES = {
    # SmolLM2-135M
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=100000.0,
    ),
    # Llama-3.2-1B's layers (vocabulary: SmolLM2's, to share its tokenizer)
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
    ),
    # Qwen3-30B-A3B's layers (128 experts of 768, top-8), 8 of its 48 layers
    "qwen3-moe": dict(
        family="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
    ),
    # --quick on CPU
    "tiny-moe": dict(
        family="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
    ),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--quick", action="store_true", help="tiny shapes (for a CPU run of the script itself)")
    p.add_argument(
        "--models",
        default=None,
        help="comma-separated shapes (default: smollm2-135m,llama-1b,qwen3-moe; quick: tiny,tiny-moe)",
    )
    p.add_argument(
        "--requests", type=int, default=None, help="concurrent greedy requests (default 64; quick 8)"
    )
    p.add_argument("--tokens", type=int, default=None, help="new tokens per request (default 128; quick 8)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--tokenizer", default=None, help="directory with tokenizer.json (default: the prepared SmolLM2)"
    )
    p.add_argument(
        "--no-cuda-graph", action="store_true", help="decode eagerly (default: CUDA graphs on CUDA)"
    )
    p.add_argument("--skip", default="", help="comma-separated parts to skip: kernels,loops,syncs,features")
    p.add_argument(
        "--workloads", default=None, help="comma-separated feature workloads (default: all of them)"
    )
    p.add_argument("--out", default=None, help="write the results here as JSON")
    return p.parse_args()


# ---- 1. kernels ------------------------------------------------------------------------------
def sdpa_reference(fb, data, hq: int, hkv: int, window: int | None):
    """Attention per request with SDPA in float32 over the pool (after this step's K/V store)."""
    import torch
    import torch.nn.functional as F

    k_cache, v_cache = data["k_cache"].clone(), data["v_cache"].clone()
    k_cache[fb.out_cache_loc] = data["k"]
    v_cache[fb.out_cache_loc] = data["v"]
    q = data["q"].float()
    out = torch.empty(q.shape[0], hq, q.shape[2], device=q.device)
    prefix = fb.extend_prefix_lens.tolist()
    seq = fb.seq_lens.tolist()
    starts = fb.extend_start_loc.tolist()
    for b in range(len(seq)):
        n = seq[b] - prefix[b]
        rows = fb.kv_indices[b, : seq[b]]
        k = k_cache[rows].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)  # [Hq, L, D]
        v = v_cache[rows].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        qp = torch.arange(prefix[b], seq[b], device=q.device).unsqueeze(1)
        kp = torch.arange(seq[b], device=q.device).unsqueeze(0)
        mask = kp <= qp
        if window:
            mask &= kp > qp - window
        qb = q[starts[b] : starts[b] + n].transpose(0, 1)  # [Hq, n, D]
        out[starts[b] : starts[b] + n] = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(
            0, 1
        )
    return out.reshape(q.shape[0], -1)


def time_backend(backend, fb, data, hq: int, hkv: int, window: int | None, k_cache, v_cache) -> float:
    """Median ms of one attention call (store + attend; rewriting the same rows is idempotent)."""
    from triton.testing import do_bench

    scale = data["q"].shape[-1] ** -0.5

    def call():
        meta = backend.prepare(fb, hq, hkv, window)
        backend.forward(data["q"], data["k"], data["v"], k_cache, v_cache, meta, scale)

    return do_bench(call)


def kernel_cases(quick: bool) -> list[dict]:
    rng = random.Random(0)
    if quick:
        return [
            dict(
                name="decode tiny",
                hq=4,
                hkv=2,
                d=16,
                prefix=[rng.randrange(1, 60) for _ in range(4)],
                ext=[1] * 4,
            ),
            dict(name="extend tiny", hq=4, hkv=2, d=16, prefix=[0, 5, 0], ext=[7, 20, 33]),
            dict(name="decode tiny window", hq=4, hkv=2, d=16, prefix=[10, 50], ext=[1, 1], window=16),
        ]
    cases = []
    for model, hq, hkv in (("smollm2-135m", 9, 3), ("llama-1b", 32, 8)):
        cases.append(
            dict(
                name=f"decode {model} bs64 L<=2048",
                hq=hq,
                hkv=hkv,
                d=64,
                prefix=[rng.randrange(16, 2048) for _ in range(64)],
                ext=[1] * 64,
            )
        )
        cases.append(
            dict(
                name=f"extend {model} 8 prompts <=1024",
                hq=hq,
                hkv=hkv,
                d=64,
                prefix=[0] * 8,
                ext=[rng.randrange(17, 1024) for _ in range(8)],
            )
        )
        cases.append(
            dict(
                name=f"extend {model} cached prefix",
                hq=hq,
                hkv=hkv,
                d=64,
                prefix=[rng.randrange(1, 700) for _ in range(8)],
                ext=[rng.randrange(1, 300) for _ in range(8)],
            )
        )
    cases.append(
        dict(
            name="decode window 512 (Mistral-like)",
            hq=32,
            hkv=8,
            d=128,
            prefix=[rng.randrange(16, 2048) for _ in range(32)],
            ext=[1] * 32,
            window=512,
        )
    )
    cases.append(
        dict(
            name="extend window 512 (Mistral-like)",
            hq=32,
            hkv=8,
            d=128,
            prefix=[0, 100, 0, 900],
            ext=[1500, 700, 64, 333],
            window=512,
        )
    )
    return cases


def check_kernels(device, quick: bool) -> list[dict]:
    import torch

    from service.models.attention import TorchAttention
    from service.models.triton_attention import TritonAttention
    from tests.attention_batches import make_batch, run_backend

    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
    dtypes = [torch.float32, torch.float16] if device.type == "cpu" else [torch.bfloat16, torch.float16]
    rows = []
    for case in kernel_cases(quick):
        for dtype in dtypes:
            fb, data = make_batch(
                case["prefix"], case["ext"], case["hq"], case["hkv"], case["d"], dtype, device=device
            )
            window = case.get("window")
            ref = sdpa_reference(fb, data, case["hq"], case["hkv"], window)
            triton_be, torch_be = TritonAttention(), TorchAttention()
            out, kc, vc = run_backend(triton_be, fb, data, case["hq"], case["hkv"], window)
            tout, tkc, tvc = run_backend(torch_be, fb, data, case["hq"], case["hkv"], window)
            err = (out.float() - ref).abs()
            terr = (tout.float() - ref).abs()
            limit = max(tol.get(dtype, 1e-4), 2 * float(terr.max()))
            row = dict(
                case=case["name"],
                dtype=str(dtype).replace("torch.", ""),
                tokens=int(fb.seq_lens.sum()),
                max_err=float(err.max()),
                mean_err=float(err.mean()),
                torch_backend_max_err=float(terr.max()),
                store_ok=bool(torch.equal(kc, tkc) and torch.equal(vc, tvc)),
            )
            row["ok"] = row["store_ok"] and row["max_err"] <= limit
            if device.type == "cuda":
                row["triton_ms"] = time_backend(triton_be, fb, data, case["hq"], case["hkv"], window, kc, vc)
                row["torch_ms"] = time_backend(torch_be, fb, data, case["hq"], case["hkv"], window, tkc, tvc)
            rows.append(row)
            print(
                f"  {row['case']:<40} {row['dtype']:<9} max|err| {row['max_err']:.2e} (torch backend {row['torch_backend_max_err']:.2e})"
                + (
                    f"  triton {row['triton_ms']:.3f} ms  torch {row['torch_ms']:.3f} ms"
                    if "triton_ms" in row
                    else ""
                )
                + ("" if row["ok"] else "  FAIL"),
                flush=True,
            )
    return rows + check_moe_kernels(device, quick)


def moe_cases(quick: bool) -> list[dict]:
    if quick:
        return [
            dict(name="moe tiny decode", tokens=5, hidden=64, inter=32, experts=8, top_k=2),
            dict(name="moe tiny prefill", tokens=37, hidden=64, inter=32, experts=8, top_k=2),
        ]
    a3b = dict(hidden=2048, inter=768, experts=128, top_k=8)  # Qwen3-30B-A3B's experts
    return [
        dict(name="moe 30B-A3B decode bs1", tokens=1, **a3b),
        dict(name="moe 30B-A3B decode bs64", tokens=64, **a3b),
        dict(name="moe 30B-A3B prefill 2048", tokens=2048, **a3b),
    ]


def check_moe_kernels(device, quick: bool) -> list[dict]:
    """The Triton fused-MoE kernel against the grouped torch experts in float32 (same inputs)."""
    import torch

    from service.models.moe import experts_torch, route
    from service.models.triton_moe import fused_experts

    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
    dtypes = [torch.float32, torch.float16] if device.type == "cpu" else [torch.bfloat16, torch.float16]
    rows = []
    for case in moe_cases(quick):
        g = torch.Generator(device=device).manual_seed(0)
        e, h, i, t = case["experts"], case["hidden"], case["inter"], case["tokens"]
        w_gate_up = torch.randn(e, 2 * i, h, device=device, generator=g) * h**-0.5
        w_down = torch.randn(e, h, i, device=device, generator=g) * i**-0.5
        x = torch.randn(t, h, device=device, generator=g)
        weights, ids = route(torch.randn(t, e, device=device, generator=g), case["top_k"], True)
        ref = experts_torch(x, w_gate_up, w_down, weights, ids)
        scale = float(ref.abs().max())
        for dtype in dtypes:
            args = (x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights, ids)
            out = fused_experts(*args)
            err = float((out.float() - ref).abs().max()) / scale
            terr = float((experts_torch(*args).float() - ref).abs().max()) / scale
            row = dict(
                case=case["name"],
                dtype=str(dtype).replace("torch.", ""),
                tokens=t,
                max_err=err,
                torch_backend_max_err=terr,
                store_ok=True,
            )
            row["ok"] = err <= max(tol[dtype], 2 * terr)
            if device.type == "cuda":
                from triton.testing import do_bench

                row["triton_ms"] = do_bench(lambda: fused_experts(*args))
                row["torch_ms"] = do_bench(lambda: experts_torch(*args))
            rows.append(row)
            print(
                f"  {row['case']:<40} {row['dtype']:<9} max|err|/max|ref| {err:.2e} (torch experts {terr:.2e})"
                + (
                    f"  triton {row['triton_ms']:.3f} ms  torch {row['torch_ms']:.3f} ms"
                    if "triton_ms" in row
                    else ""
                )
                + ("" if row["ok"] else "  FAIL"),
                flush=True,
            )
    return rows


# ---- 2. loops ---------------------------------------------------------------------------------
CONFIG_CLASSES = {  # a shape's family: (transformers config class, architecture)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def make_model_dir(shape: str, tokenizer_dir: Path, root: Path) -> Path:
    import transformers

    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    fields = dict(SHAPES[shape])
    config_class, arch = CONFIG_CLASSES[fields.pop("family", "llama")]
    rope = dict(rope_type="default", rope_theta=fields.pop("rope_theta"))
    cfg = getattr(transformers, config_class)(
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.02,
        rope_parameters=rope,
        **fields,
    )
    cfg.architectures = [arch]
    cfg.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    return out


def run_loop(
    model_dir: Path,
    overlap: bool,
    device_name: str,
    dtype: str,
    n: int,
    tokens: int,
    prompt_len: int,
    cuda_graph: bool = True,
    sync_log: list | None = None,
) -> dict:
    """Warm up, then one measured run of n requests; with `sync_log`, the measured run
    is under CUDA's sync debug mode and each synchronizing call is logged (thread, stack)."""
    from service.config import ServerArgs
    from service.core.request import SamplingParams
    from service.engine.engine import SyncClient, collect
    from service.engine.modules import builtin_features

    # Grammars are not measured here: no grammar-init thread (nor xgrammar) needed.
    off = [f.name for f in builtin_features() if f.name == "constrained"]
    args = ServerArgs(
        model=str(model_dir),
        device=device_name,
        dtype=dtype,
        load_format="dummy",
        disabled_features=off,
        loop="overlap" if overlap else "normal",
        max_running_requests=n,
        max_queued_requests=4 * n,
        kv_cache_tokens=n * (prompt_len + tokens) + 64,
        context_length=prompt_len + tokens + 8,
        max_prefill_tokens=max(4096, n * prompt_len),
        disable_cuda_graph=not cuda_graph,
    )
    client = SyncClient(args, model_dir)
    engine = client.engine
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49000) for _ in range(prompt_len)] for _ in range(n)]
    sp = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)

    def once(tag: str) -> tuple[list[list[int]], float]:
        reqs = [
            engine.build_request(f"{tag}-{i}", p, SamplingParams(**vars(sp))) for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        engine.submit_all(reqs)  # admitted together: the same batches in both loops
        outs = [collect(client.wait(r.rid, timeout=600))[0] for r in reqs]
        return outs, time.perf_counter() - t0

    try:
        once("warmup")  # compiles the kernels for every batch shape the measured run meets
        engine.timeline.device_timing = True
        engine.timeline.clear_device_spans()
        if sync_log is not None:
            with sync_debug(sync_log):
                outs, wall = once("run")
        else:
            outs, wall = once("run")
        engine.timeline.device_timing = False
        dev = engine.timeline.device_forward_stats("decode")
        busy, host_gap = engine.timeline.forward_stats()
    finally:
        client.close()
    return dict(
        loop="overlap" if overlap else "normal",
        wall_s=wall,
        tokens_per_s=n * tokens / wall,
        decode_pairs=dev.pairs,
        median_decode_gap_ms=dev.median_gap_ms,
        median_decode_forward_ms=dev.median_forward_ms,
        device_busy_fraction=dev.busy_fraction,
        host_median_gap_ms=host_gap * 1e3,
        attention_backend=engine.attention_backend,
        cuda_graphs=engine.worker.graphs is not None,
        graph_replays=engine.worker.graphs.replays if engine.worker.graphs is not None else 0,
        outputs=outs,
    )


def check_loops(
    model_dirs: dict[str, Path],
    device_name: str,
    dtype: str,
    n: int,
    tokens: int,
    prompt_len: int,
    cuda_graph: bool,
) -> list[dict]:
    rows = []
    for shape, model_dir in model_dirs.items():
        try:
            res = {
                o: run_loop(model_dir, o, device_name, dtype, n, tokens, prompt_len, cuda_graph)
                for o in (False, True)
            }
        except Exception:
            rows.append(dict(model=shape, identical_tokens=False, error=traceback.format_exc()))
            print(f"  {shape} FAILED:\n{rows[-1]['error']}", flush=True)
            continue
        normal, overlap = res[False], res[True]
        identical = normal.pop("outputs") == overlap.pop("outputs")
        gap_ratio = (
            overlap["median_decode_gap_ms"] / normal["median_decode_gap_ms"]
            if normal["median_decode_gap_ms"]
            else float("nan")
        )
        speedup = overlap["tokens_per_s"] / normal["tokens_per_s"]
        row = dict(
            model=shape,
            requests=n,
            tokens=tokens,
            dtype=dtype,
            identical_tokens=identical,
            cuda_graphs=overlap["cuda_graphs"],
            normal=normal,
            overlap=overlap,
            gap_ratio=gap_ratio,
            speedup=speedup,
        )
        rows.append(row)
        for r in (normal, overlap):
            print(
                f"  {shape:<14} {r['loop']:<8} {r['tokens_per_s']:9.0f} tok/s  decode forward {r['median_decode_forward_ms']:.3f} ms"
                f"  gap {r['median_decode_gap_ms']:.3f} ms  busy {r['device_busy_fraction']:.1%}  ({r['attention_backend']}"
                f"{', cuda graphs: {} replays'.format(r['graph_replays']) if r['cuda_graphs'] else ', eager'})",
                flush=True,
            )
        print(
            f"  {shape:<14} overlap/normal {speedup:.2f}x  gap ratio {gap_ratio:.3f}  tokens identical: {identical}",
            flush=True,
        )
    return rows


# ---- 3. syncs ---------------------------------------------------------------------------------
@contextlib.contextmanager
def sync_debug(log: list):
    """CUDA's sync debug mode, each warning logged with its thread and the caller's frames."""
    import torch

    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message) and "prototype" not in str(message):
            frames = [
                f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-8:-1]
            ]
            log.append(
                dict(
                    thread=threading.current_thread().name, message=str(message).splitlines()[0], stack=frames
                )
            )

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous


def check_syncs(model_dir: Path, device_name: str, dtype: str, cuda_graph: bool) -> dict:
    """A short overlap run (after warm-up) under CUDA's sync debug mode."""
    import torch

    if not torch.cuda.is_available() or not device_name.startswith(("cuda", "auto")):
        return dict(skipped="needs CUDA")
    log: list = []
    run_loop(model_dir, True, device_name, dtype, 8, 16, 16, cuda_graph, sync_log=log)
    print(f"  synchronizing CUDA calls during a measured overlap run: {len(log)}", flush=True)
    for entry in log[:5]:
        print(
            f"    [{entry['thread']}] {entry['message']}\n      " + "\n      ".join(entry["stack"]),
            flush=True,
        )
    return dict(sync_calls=len(log), first=log[:5])


# ---- 4. features ------------------------------------------------------------------------------
def check_features_part(
    a: argparse.Namespace, text_dir: Path, shape: str, tok: Path, tmp: Path, device_name: str, dtype: str
) -> dict:
    """Each feature alone and all together (bench/gpu_features.py); the LLaVA only if needed."""
    import torch
    from gpu_features import WORKLOAD_NAMES, check_features, make_llava_dir

    only = a.workloads.split(",") if a.workloads else list(WORKLOAD_NAMES)
    llava = None
    if {"multimodal", "all"} & set(only):
        llava = make_llava_dir(SHAPES[shape], tok, tmp / f"llava-{shape}", dtype)
    cuda = torch.cuda.is_available() and device_name.startswith(("cuda", "auto"))
    quick = a.quick or not cuda
    return dict(
        check_features(
            text_dir,
            llava,
            device_name,
            dtype,
            quick,
            not a.no_cuda_graph,
            sync_debug if cuda else None,
            only,
        ),
        device=results_device(device_name),
        setup=f"{shape}, {dtype}" + (", quick" if quick else ""),
    )


def results_device(device_name: str) -> str:
    import torch

    if torch.cuda.is_available() and device_name.startswith(("cuda", "auto")):
        return torch.cuda.get_device_name(torch.device(device_name if device_name != "auto" else "cuda"))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def default_tokenizer_dir() -> Path:
    from service.model_prep import MODEL_NAME, cache_root

    return cache_root() / "models" / MODEL_NAME


def main() -> int:
    a = parse_args()
    import torch  # noqa: F401  (imported before triton: it decides interpret mode below)

    from service.core.device import resolve_device

    device = resolve_device(a.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
    quick = a.quick or device.type == "cpu"
    models = (a.models or ("tiny,tiny-moe" if quick else "smollm2-135m,llama-1b,qwen3-moe")).split(",")
    n = a.requests or (8 if quick else 64)
    tokens = a.tokens or (8 if quick else 128)
    dtype = a.dtype if device.type == "cuda" else "float32"
    skip = set(filter(None, a.skip.split(",")))
    import triton

    info = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        interpret=os.environ.get("TRITON_INTERPRET") == "1",
    )
    print(
        f"gpu_check on {info['device']}: torch {info['torch']}, triton {info['triton']}"
        + (" (interpreter)" if info["interpret"] else ""),
        flush=True,
    )
    results: dict = dict(info=info, goals=dict(gap_ratio_below=GOAL_GAP_RATIO, speedup_at_least=GOAL_SPEEDUP))
    t0 = time.perf_counter()
    errors: dict[str, str] = {}

    def part(name: str, fn):
        """One part failing must not lose the others' figures; nor must a run stopped by its time limit."""
        try:
            results[name] = fn()
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"  {name} FAILED:\n{errors[name]}", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(dict(results, errors=errors, partial=True), indent=1))

    if "kernels" not in skip:
        print("1. kernels vs SDPA (float32 math on the same inputs)", flush=True)
        part("kernels", lambda: check_kernels(device, quick))
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(a.tokenizer) if a.tokenizer else default_tokenizer_dir()
        dirs = {m: make_model_dir(m, tok, Path(tmp)) for m in models}
        if "loops" not in skip:
            print(f"2. {n} greedy requests x {tokens} tokens, normal vs overlap loop ({dtype})", flush=True)
            part(
                "loops",
                lambda: check_loops(dirs, str(device), dtype, n, tokens, a.prompt_len, not a.no_cuda_graph),
            )
        if "syncs" not in skip:
            print("3. host syncs", flush=True)
            part("syncs", lambda: check_syncs(dirs[models[0]], str(device), dtype, not a.no_cuda_graph))
        if "features" not in skip:
            print("4. features alone and together, normal vs overlap loop", flush=True)
            part(
                "features",
                lambda: check_features_part(
                    a, dirs[models[0]], models[0], tok, Path(tmp), str(device), dtype
                ),
            )
    results["errors"] = errors
    results["elapsed_s"] = time.perf_counter() - t0
    ok = (
        not errors
        and all(r["ok"] for r in results.get("kernels", []))
        and all(r["identical_tokens"] for r in results.get("loops", []))
        and all(r.get("ok") for r in results.get("features", {}).get("workloads", []))
        and not any(
            v["measured"] == "unused" for v in results.get("features", {}).get("verdicts", {}).values()
        )
    )
    goals = []
    for r in results.get("loops", []):
        if r["model"] in ("smollm2-135m", "tiny") and "error" not in r:
            goals.append(
                dict(
                    model=r["model"],
                    gap_ratio_ok=r["gap_ratio"] < GOAL_GAP_RATIO,
                    speedup_ok=r["speedup"] >= GOAL_SPEEDUP,
                )
            )
    results["goals_met"] = goals
    results["ok"] = ok
    print(
        f"done in {results['elapsed_s']:.0f}s: correctness {'OK' if ok else 'FAILED'}; goals {goals}",
        flush=True,
    )
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
